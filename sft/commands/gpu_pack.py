"""`sft gpu-pack [--out gpu_pack] [-- bench overrides]`: every check that needs a CUDA GPU, in one command that lands
its figures within a lease.

1. `python -m sft.bench preset=gpu_7b`, side by side on one GPU: sft's LoRA on Qwen2.5-7B's shape as a user runs it
   (bf16, packed rows, the memory plan), TRL's SFTTrainer and a plain `Trainer` on the same rows at their own fastest
   documented settings, sft's full fine-tune of Qwen2.5-1.5B's shape, the levers, the loss alone: tokens/s, MFU
   (executed FLOPs, the 6N convention's beside it), peak memory, the ratios sft/TRL and sft/Trainer;
2. `pytest -m gpu` (tests/e2e/test_gpu.py), each test under a limit.

Each part runs under its own time limit (`--bench-timeout`, `--tests-timeout`: 330 s + 150 s, 8 minutes of a 15-minute
lease); a part out of time gets SIGTERM, then SIGKILL, and what it finished stands: every case's result and log, every
test's outcome, written as each ends (`sft.bench.pack`). Writes `<out>/gpu_pack.json` (what `--apply` reads),
`<out>/figures.md`, the logs, the machine's packages (`image.txt`); puts the figures between the `gpu-pack` markers of
docs/performance.md and a summary between the README's (`--no-readme`: neither).

    sft gpu-pack --wheels .whl    here: the wheels of what the GPU machine's image lacks, and their size
    sft gpu-pack --check          there: what the pack needs, each version against the pins; runs nothing
    sft gpu-pack                  there: the pack (the same `--check` first: a wrong version stops it in one line)
    sft gpu-pack --apply gpu_pack/gpu_pack.json    here: the returned figures into the docs

Without a CUDA GPU it says so in one line and exits 2, running nothing; `--cpu` rehearses the very same pack on the CPU
(its limits, outcomes and reports; its figures are no GPU figures). docs/performance.md gives the whole procedure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the checkout the pack runs in: its GPU tests and docs (sft/commands/gpu_pack.py -> the repository's root)
REPO = Path(__file__).resolve().parents[2]
GPU_TESTS = REPO / "tests" / "e2e" / "test_gpu.py"
PERFORMANCE_DOC = REPO / "docs" / "performance.md"  # every figure (its gpu-pack block); README: a summary
WHEELS = REPO / ".whl"  # where the device tool's README puts carried wheels, pins.txt beside them


def pins_file(given: str | None) -> Path | None:
    """The pins the check compares with: `--pins`, else the carried wheels' (`.whl/pins.txt`) where present."""
    if given:
        return Path(given)
    return WHEELS / "pins.txt" if (WHEELS / "pins.txt").is_file() else None


def gather_wheels(directory: Path, image_file: str | None) -> int:
    """`--wheels`: what the image lacks, as wheels for it, with their size and the line that installs them."""
    from sft.bench.wheels import BUDGET_MIB, IMAGE, IMAGE_BELOW, canonical, gather, install_line, plan, write_pins

    image = dict(IMAGE)
    if image_file:  # the image's own packages, as a pack wrote them there (image.txt): exact versions
        image = {}
        for line in Path(image_file).read_text().splitlines():
            if "==" in line:
                name, _, found = line.strip().partition("==")
                image[canonical(name)] = found
    required, carry, why = plan(image, {} if image_file else IMAGE_BELOW)
    print(f"gpu pack: {len(required)} distributions needed, {len(carry)} to carry:\n  " + "\n  ".join(why))
    wheels = gather(directory, carry)
    pins = write_pins(directory, required, carry)
    size = sum(w.stat().st_size for w in wheels) / 2**20
    for wheel in sorted(wheels, key=lambda w: -w.stat().st_size)[:3]:
        print(f"  {wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")
    print(f"gpu pack: {len(wheels)} wheels, {size:.1f} MiB in {directory} (pins: {pins.name}); on the machine, "
          f"before the pack: {install_line(directory.name)}")
    if size > BUDGET_MIB:
        print(f"gpu pack: the wheels take {size:.1f} MiB of the {BUDGET_MIB} MiB a device call carries beside the "
              "checkout: too many to travel; the largest are listed above (an image's own versions, --image "
              "image.txt from an earlier pack, may make some unneeded)", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="sft gpu-pack", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "gpu_pack"), help="where the figures and logs go")
    parser.add_argument("--bench-timeout", type=float, default=330)
    parser.add_argument("--tests-timeout", type=float, default=150)
    parser.add_argument("--test-limit", type=float, default=60, help="each GPU test's limit, in seconds")
    parser.add_argument("--preset", default="gpu_7b", help="the bench's preset (none: the overrides alone)")
    parser.add_argument("--tests", default=str(GPU_TESTS), help="the GPU tests run")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md and docs/performance.md as they are")
    parser.add_argument("--check", action="store_true", help="list what the pack needs and this machine has, each "
                        "version against the pins; run nothing")
    parser.add_argument("--pins", help="the pins the check compares with (default: .whl/pins.txt where present)")
    parser.add_argument("--wheels", metavar="DIR", help="gather the wheels the GPU machine's image lacks into DIR")
    parser.add_argument("--image", metavar="FILE", help="with --wheels: the image's packages as a pack wrote them "
                        "(image.txt), in place of the device tool's list")
    parser.add_argument("--apply", metavar="GPU_PACK_JSON", help="put a returned pack's figures into the docs")
    parser.add_argument("--cpu", action="store_true", help="rehearse the pack on the CPU (no GPU figures)")
    args = parser.parse_args(argv)
    from sft.bench import figures, pack, wheels

    if args.wheels:
        return gather_wheels(Path(args.wheels), args.image)
    if args.apply:
        report = json.loads(Path(args.apply).read_text())
        written = figures.apply(report, REPO)
        print(f"gpu pack: the figures of {report['machine']['date']} ({report['machine']['gpu']}) into "
              f"{', '.join(written) or 'no file (no gpu-pack markers found)'}")
        return 0
    pins = wheels.read_pins(pins_file(args.pins)) if pins_file(args.pins) else {}
    if args.check:
        lines, ready = pack.check_machine(pins)
        print("gpu pack: what it needs, and what this machine has\n" + "\n".join(lines)
              + f"\nready: {'yes' if ready else 'no'}")
        return 0
    tests = Path(args.tests)
    if not tests.is_file():
        print(f"gpu pack: {tests} is missing: the pack runs the repository's GPU tests, so run it from a checkout",
              file=sys.stderr)
        return 2
    if not args.cpu and (reason := pack.cuda_missing()):
        print(f"gpu pack: {reason}: nothing to run (the gpu tests skip without one; --cpu rehearses the pack)",
              file=sys.stderr)
        return 2
    if wrong := wheels.mismatches(pins):
        print(f"gpu pack: not the pinned packages, nothing run: {'; '.join(wrong)} (install the wheels of sft "
              "gpu-pack --wheels first)", file=sys.stderr)
        return 2
    out = Path(args.out)
    report = pack.run_pack(REPO, out, None if args.preset == "none" else args.preset, overrides, tests,
                           args.bench_timeout, args.tests_timeout, args.test_limit)
    text = figures.figures_markdown(report)
    (out / "figures.md").write_text(text)
    if not args.no_readme and not args.cpu and figures.apply(report, REPO):
        print("gpu pack: the GPU figures replaced in docs/performance.md, their summary in README.md", file=sys.stderr)
    print(text)
    failed = [t["test"] for t in report["tests"] if t["outcome"] == "failed"]
    bad_parts = [name for name, part in report["parts"].items() if part["exit_code"] not in (0, 5)]
    if failed or bad_parts:
        print(f"gpu pack: failed: {', '.join(failed + bad_parts)} (logs in {out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
