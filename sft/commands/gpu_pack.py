"""`sft gpu-pack [--out gpu_pack] [--no-readme]`: every check that needs a CUDA GPU, in one command.

1. `python -m sft.bench preset=gpu_7b`, side by side on one GPU: sft's LoRA on Qwen2.5-7B's shape as a user runs
   it (bf16, packed ~4k-token rows, the memory plan), TRL's SFTTrainer and a plain `Trainer` on the same rows with
   their own fastest documented settings, sft's full fine-tune of Qwen2.5-1.5B's shape (pure bf16, packed), then
   the levers (Liger's layer kernels, compiled layers) and the loss alone: tokens/s, MFU (executed FLOPs, and the
   6N convention beside it), peak memory, the ratios sft/TRL and sft/Trainer;
2. `pytest -m gpu` (tests/e2e/test_gpu.py: cut-cross-entropy and Liger per-token losses against the chunked loss,
   flash attention varlen packing against padded logits, QLoRA trains and merges, bf16 follows fp32, the memory
   estimate and plan against CUDA's allocator, compiled layers against eager ones, long rows offloaded and tiled,
   sequence parallelism over 2 GPUs with flash attention where there are 2).

The bench goes first: its figures are what the pack is for. Each part runs under its own time limit
(`--bench-timeout`, `--tests-timeout`; 330 s + 150 s by default: 8 minutes on one GPU); a bench stopped by its limit
keeps the cases it finished (written after each), and the figures say it stopped. Writes `<out>/figures.md` (the
date, the GPU, the bench's figures, every test's outcome), `<out>/gpu_pack.json`, the pytest and bench outputs, and
puts figures.md between the `gpu-pack` markers of docs/performance.md and a summary of it between the README's.

Without a CUDA GPU it says so in one line and exits 2, running nothing. Needs the project installed with a
CUDA build of torch (`pip install -e '.[gpu]'`; flash-attn and bitsandbytes separately, as their builds
need the machine's CUDA); a kernel that is not installed skips its test, and the figures say so.

`sft gpu-pack --check` runs nothing: it lists what the pack needs, what this machine has (a GPU or
not included) and how to install what is missing, and exits 0 (it reports; `ready: no` says the pack would
not run). Run it first on a fresh GPU image.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# the checkout the pack runs in: its GPU tests and docs (sft/commands/gpu_pack.py -> the repository's root)
REPO = Path(__file__).resolve().parents[2]
GPU_TESTS = REPO / "tests" / "e2e" / "test_gpu.py"
PERFORMANCE_DOC = REPO / "docs" / "performance.md"  # every figure (its gpu-pack block); README: a summary
FIGURES_BEGIN, FIGURES_END = "<!-- gpu-pack:begin -->", "<!-- gpu-pack:end -->"
KERNELS = ("cut-cross-entropy", "liger-kernel", "flash-attn", "bitsandbytes")
# (module, distribution, needed for, how to install): the pack's own imports first, then the kernels its tests check
REQUIREMENTS = [
    ("torch", "torch", "everything", "a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu128"),
    ("transformers", "transformers", "everything", "pip install -e . (pins the version)"),
    ("peft", "peft", "LoRA", "pip install -e ."),
    ("accelerate", "accelerate", "the trainer", "pip install -e ."),
    ("datasets", "datasets", "the data", "pip install -e ."),
    ("hydra", "hydra-core", "the config", "pip install -e ."),
    ("omegaconf", "omegaconf", "the config", "pip install -e ."),
    ("antlr4", "antlr4-python3-runtime", "Hydra's override parser", "pip install antlr4-python3-runtime==4.9.3 "
     "(a source distribution only: needs setuptools and wheel in the image)"),
    ("pytest", "pytest", "the GPU tests", "pip install -e '.[dev]'"),
    ("sft", "sft", "python -m sft.bench in a subprocess", "pip install -e . from the repository"),
    ("trl", "trl", "the bench's TRL cases (trl_best, trl_padding_free: sft against TRL)",
     "pip install -e '.[bench]' (trl==1.16.0, the version the cases' like-for-like test was written against)"),
    ("cut_cross_entropy", "cut-cross-entropy", "loss.impl=cce and its test", "pip install -e '.[gpu]'"),
    ("liger_kernel", "liger-kernel", "loss.impl=liger and its test", "pip install -e '.[gpu]'"),
    ("flash_attn", "flash-attn", "the varlen packing test and flash_attention_2",
     "pip install flash-attn --no-build-isolation (no wheel for most images: it compiles against the machine's "
     "CUDA, 10+ minutes)"),
    ("bitsandbytes", "bitsandbytes", "the QLoRA test", "pip install bitsandbytes"),
]
REQUIRED = {"torch", "transformers", "peft", "accelerate", "datasets", "hydra", "omegaconf", "antlr4", "pytest"}


def cuda_missing() -> str | None:
    """Why this machine cannot run the pack, or None."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU on this machine (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
    return None


def check_machine() -> tuple[list[str], bool]:
    """What `--check` prints: one line per requirement (found with its version, or missing with how to install it),
    the GPU; and whether the pack would run (the required modules and a CUDA GPU)."""
    import importlib.util

    lines, ready = [], True
    for module, distribution, needed_for, how in REQUIREMENTS:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            try:
                where = version(distribution)
            except PackageNotFoundError:
                where = "found (not installed as a distribution: run from the source tree)"
            lines.append(f"  ok       {distribution:<24} {where}")
        else:
            ready &= module not in REQUIRED
            kind = "MISSING " if module in REQUIRED else "optional"
            lines.append(f"  {kind} {distribution:<24} needed for {needed_for}: {how}")
    try:
        gpu = cuda_missing()
    except ImportError:
        gpu = "torch is not installed"
    ready &= gpu is None
    lines.append(f"  {'ok      ' if gpu is None else 'MISSING '} {'CUDA GPU':<24} {gpu or _gpu_name()}")
    return lines, ready


def _gpu_name() -> str:
    import torch

    return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, CUDA {torch.version.cuda}"


def machine() -> dict:
    """The GPU and the versions the figures were measured with."""
    import torch

    props = torch.cuda.get_device_properties(0)
    installed = {}
    for name in ("torch", "transformers", "peft", "trl", *KERNELS):
        try:
            installed[name] = version(name)
        except PackageNotFoundError:
            installed[name] = None
    return {"date": datetime.date.today().isoformat(), "gpu": props.name, "gpus": torch.cuda.device_count(),
            "memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda, "versions": installed}


def run_part(args: list[str], timeout: int, log: Path) -> dict:
    """Run one part of the pack with its output into `log`; its exit code (124 when it ran out of time: then it
    and every process it started, such as the bench's case in its own process, are killed, so that none holds the
    GPU into the next part)."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
    return {"command": " ".join(args[1:]), "exit_code": code, "seconds": round(time.monotonic() - started, 1),
            "log": log.name}


def test_outcomes(junit: Path) -> list[dict]:
    """Each test's outcome from pytest's JUnit XML: passed, failed (with the first line) or skipped (why)."""
    if not junit.is_file():
        return []
    outcomes = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                detail = (node.get("message") or "").splitlines()[0] if node.get("message") else ""
                break
        outcomes.append({"test": case.get("name"), "outcome": outcome, "detail": detail,
                         "seconds": float(case.get("time") or 0)})
    return outcomes


def bench_report(bench_json: Path) -> dict | None:
    """The bench's report; where its time limit stopped it, the cases it finished (`sft.bench.report.write_partial`'s
    file, `partial: true`); None where it wrote neither."""
    from sft.bench.report import read_partial

    if bench_json.is_file():
        return json.loads(bench_json.read_text())
    partial = bench_json.with_name(bench_json.name + ".partial")
    return read_partial(partial) if partial.is_file() else None


def figures_markdown(report: dict) -> str:
    """The GPU figures (docs/performance.md): where and when, each test's outcome, the bench's cases and ratios."""
    m = report["machine"]
    kernels = ", ".join(f"{k} {v}" if v else f"{k} not installed" for k, v in m["versions"].items() if k in KERNELS)
    lines = [f"Measured {m['date']} on {m['gpus']} x {m['gpu']} ({m['memory_gib']} GiB), torch "
             f"{m['versions']['torch']}, CUDA {m['cuda']}, transformers {m['versions']['transformers']}, TRL "
             f"{m['versions'].get('trl') or 'not installed'}; {kernels}. Command: `sft gpu-pack`."]
    bench = report.get("bench")
    lines += ["", "| `sft.bench.run preset=gpu_7b` | value |", "|---|---|"]
    if bench and bench.get("partial"):
        lines.append(f"| (stopped) | the bench ran out of its {report['parts']['bench']['seconds']:.0f} s: the cases "
                     "it finished, no ratios |")
    if bench:
        for case, c in bench["cases"].items():
            if "tokens_per_second" in c:
                mfu = (f", MFU {c['mfu']:.3f} (6N: {c['mfu_6n']:.3f})" if "mfu" in c
                       else ", MFU unknown (GPU not in the table)")
                lines.append(f"| {case} | {c['tokens_per_second']:,.0f} tokens/s{mfu}, "
                             f"peak {c['peak_memory_gb']:.1f} GiB |")
            elif case.startswith("loss_"):  # the loss alone: its kernel, time, memory, distance from fp32
                errors = (f"; from fp32: losses {c['loss_error']:.1e}, hidden-state gradient {c['grad_error']:.1e}"
                          if "grad_error" in c else "")
                lines.append(f"| {case} ({bench['raw'][case][0]['impl']}) | {c['seconds'] * 1000:.0f} ms forward+"
                             f"backward of {c['tokens']:,.0f} tokens, peak {c['peak_memory_gb']:.2f} GiB{errors} |")
        for case, error in bench.get("failed", {}).items():
            lines.append(f"| {case} | failed: {error.splitlines()[-1][:200]} |")
        for key, value in bench["ratios"].items():
            target = bench["targets"].get(key)
            mark = "" if target is None else f" (target {'>=' if target['kind'] == 'min' else '<='} " \
                                             f"{target['target']}: {'met' if target['met'] else 'not met'})"
            lines.append(f"| {key} | {value:.3f}{mark} |")
    else:
        lines.append(f"| (no bench result) | exit {report['parts']['bench']['exit_code']} |")
    lines += ["", "| GPU test | outcome |", "|---|---|"]
    for t in report["tests"]:
        lines.append(f"| `{t['test']}` | {t['outcome']}{': ' + t['detail'] if t['detail'] else ''} |")
    if not report["tests"]:
        lines.append(f"| (no test result) | pytest exit {report['parts']['tests']['exit_code']} |")
    return "\n".join(lines) + "\n"


def readme_summary(report: dict) -> str:
    """The README's few lines: where and when, the tests' counts, the 7B's throughput and the loss training picks;
    every figure stands in docs/performance.md."""
    m, tests, bench = report["machine"], report["tests"], report.get("bench")
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "failed", "skipped")}
    lines = [f"Measured {m['date']} on {m['gpus']} x {m['gpu']} (`sft gpu-pack`): GPU tests {counts['passed']} passed, "
             f"{counts['failed']} failed, {counts['skipped']} skipped."]
    cases, ratios = (bench or {}).get("cases", {}), (bench or {}).get("ratios", {})
    for case, what in (("packing", "LoRA on Qwen2.5-7B's shape (bf16, packed 4k-token rows)"),
                       ("packing_full", "a full fine-tune of Qwen2.5-1.5B's shape (pure bf16, packed)")):
        if case in cases:
            c = cases[case]
            mfu = f", MFU {c['mfu']:.3f}" if "mfu" in c else ""
            lines.append(f"{what}: {c['tokens_per_second']:,.0f} tokens/s{mfu}, peak {c['peak_memory_gb']:.1f} GiB.")
    versus = [f"{ratios[key]:.2f}x {who}" for key, who in (("packing_vs_trl_best", "TRL's SFTTrainer"),
                                                          ("packing_vs_hf_padding_free", "a plain Trainer"))
              if key in ratios]
    if versus:
        lines.append(f"The LoRA 7B's tokens/s: {' and '.join(versus)} at their fastest settings, same rows.")
    if "lean_vs_naive_loss_time" in ratios:
        impl = bench["raw"]["loss_lean"][0]["impl"]
        lines.append(f"The loss `loss.impl=auto` picks ({impl}) at its output layer: "
                     f"{ratios['lean_vs_naive_loss_time']:.2f}x the naive loss's time in "
                     f"{ratios['lean_vs_naive_loss_memory']:.3f}x its memory.")
    lines.append(f"Every figure: [Performance]({PERFORMANCE_DOC.relative_to(REPO).as_posix()}#gpu-figures).")
    return " ".join(lines) + "\n"


def put_between_markers(path: Path, text: str) -> bool:
    """Replace what stands between the file's gpu-pack markers by `text`; False if it has no markers."""
    content = path.read_text()
    begin, end = content.find(FIGURES_BEGIN), content.find(FIGURES_END)
    if begin < 0 or end < begin:
        return False
    path.write_text(content[:begin + len(FIGURES_BEGIN)] + "\n" + text + content[end:])
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sft gpu-pack", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "gpu_pack"), help="where the figures and logs go")
    parser.add_argument("--bench-timeout", type=int, default=330)
    parser.add_argument("--tests-timeout", type=int, default=150)
    parser.add_argument("--no-readme", action="store_true", help="leave README.md and docs/performance.md as they are")
    parser.add_argument("--check", action="store_true", help="list what the pack needs and this machine has; run "
                        "nothing")
    args = parser.parse_args(argv)
    if args.check:
        lines, ready = check_machine()
        print("gpu pack: what it needs, and what this machine has\n" + "\n".join(lines)
              + f"\nready: {'yes' if ready else 'no'}")
        return 0
    if not GPU_TESTS.is_file():
        print(f"gpu pack: {GPU_TESTS} is missing: the pack runs the repository's GPU tests, so run it from a checkout "
              "installed with pip install -e .", file=sys.stderr)
        return 2
    if reason := cuda_missing():
        print(f"gpu pack: {reason}: nothing to run (the gpu tests skip without one)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine(), "parts": {}}
    bench_json = out / "bench_gpu_7b.json"
    report["parts"]["bench"] = run_part([sys.executable, "-m", "sft.bench", "--out", str(bench_json), "preset=gpu_7b"],
                                        args.bench_timeout, out / "bench_gpu_7b.log")
    report["bench"] = bench_report(bench_json)
    junit = out / "gpu_tests.xml"
    report["parts"]["tests"] = run_part([sys.executable, "-m", "pytest", "-m", "gpu", str(GPU_TESTS), "-rA",
                                         "-p", "no:cacheprovider", f"--junitxml={junit}"],
                                        args.tests_timeout, out / "gpu_tests.log")
    report["tests"] = test_outcomes(junit)
    (out / "gpu_pack.json").write_text(json.dumps(report, indent=2) + "\n")
    figures = figures_markdown(report)
    (out / "figures.md").write_text(figures)
    if not args.no_readme and put_between_markers(PERFORMANCE_DOC, figures) and put_between_markers(
            REPO / "README.md", readme_summary(report)):
        print("gpu pack: the GPU figures replaced in docs/performance.md, their summary in README.md", file=sys.stderr)
    print(figures)
    failed = [t["test"] for t in report["tests"] if t["outcome"] == "failed"]
    bad_parts = [name for name, part in report["parts"].items() if part["exit_code"] not in (0, 5)]
    if failed or bad_parts:
        print(f"gpu pack: failed: {', '.join(failed + bad_parts)} (logs in {out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
