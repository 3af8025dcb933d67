"""The GPU pack's run (`sft gpu-pack`): its two parts, each under a time limit, and what it keeps of them.

1. the bench (`python -m sft.bench preset=gpu_7b` and the overrides given after `--`): each case's result and log
   written as it ends (`<out>/bench.json.partial`, `<out>/cases/`), a case past its own limit stopped, the others run
   on; the bench's figures are what the pack is for, so it goes first;
2. the GPU tests (`pytest -m gpu` with `sft.bench.outcomes`): each test under a limit, its outcome written as it ends.

A part out of its time gets SIGTERM, then SIGKILL with every process it started; what it finished stands (ratios
from the pairs that both finished). Before either, what the pack imports is checked against the pins
(`sft.bench.wheels`): a missing or wrong-version package is one line naming it, and nothing runs. The pack runs offline
(the machine reaches no hub: `HF_HUB_OFFLINE` and the like are set for both parts), and writes beside its figures the
machine's installed packages (`image.txt`), from which the next `--wheels` carries exactly what that image lacks.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

from sft.bench.figures import KERNELS
from sft.bench.run import stop

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
GRACE_S = 10  # a part out of time: SIGTERM, this long to save what it has, then SIGKILL
# (module, distribution, needed for, how to install): the pack's own imports first, then the kernels its tests check
REQUIREMENTS = [
    ("torch", "torch", "everything", "a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu128"),
    ("transformers", "transformers", "everything", "pip install -e . (pins the version); on the GPU machine: the "
     "wheels of sft gpu-pack --wheels"),
    ("peft", "peft", "LoRA", "pip install -e ."),
    ("accelerate", "accelerate", "the trainer", "pip install -e ."),
    ("datasets", "datasets", "the data", "pip install -e .; on the GPU machine: sft gpu-pack --wheels"),
    ("hydra", "hydra-core", "the config", "pip install -e .; on the GPU machine: sft gpu-pack --wheels"),
    ("omegaconf", "omegaconf", "the config", "pip install -e .; on the GPU machine: sft gpu-pack --wheels"),
    ("antlr4", "antlr4-python3-runtime", "Hydra's override parser", "pip install antlr4-python3-runtime==4.9.3 (a "
     "source distribution only: sft gpu-pack --wheels builds its wheel)"),
    ("pytest", "pytest", "the GPU tests", "pip install -e '.[dev]'"),
    ("trl", "trl", "the bench's TRL cases (trl_best, trl_padding_free: sft against TRL)",
     "pip install -e '.[bench]' (trl==1.16.0, the version the cases' like-for-like test was written against)"),
    ("cut_cross_entropy", "cut-cross-entropy", "loss.impl=cce and its test", "pip install -e '.[gpu]'"),
    ("liger_kernel", "liger-kernel", "loss.impl=liger, trainer.use_liger_kernel and their tests",
     "pip install -e '.[gpu]'"),
    ("flash_attn", "flash-attn", "the varlen packing test and flash_attention_2",
     "pip install flash-attn --no-build-isolation (no wheel for most images: it compiles against the machine's "
     "CUDA, 10+ minutes; torch's own varlen kernel, model.attn_implementation=sdpa_varlen, needs none)"),
    ("bitsandbytes", "bitsandbytes", "the QLoRA test", "pip install bitsandbytes"),
]
REQUIRED = {"torch", "transformers", "peft", "accelerate", "datasets", "hydra", "omegaconf", "antlr4", "pytest"}


def cuda_missing() -> str | None:
    """Why this machine cannot run the pack, or None."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU on this machine (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
    return None


def check_machine(pins: dict[str, str] | None = None) -> tuple[list[str], bool]:
    """What `--check` prints: one line per requirement (found with its version, or missing with how to install it),
    each pin the installed version does not satisfy (`pins`: `sft.bench.wheels`), the GPU; and whether the pack would
    run (the required modules at their pins, and a CUDA GPU)."""
    import importlib.util

    from sft.bench.wheels import mismatches

    lines, ready = [], True
    for module, dist, needed_for, how in REQUIREMENTS:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            try:
                where = version(dist)
            except PackageNotFoundError:
                where = "found (not installed as a distribution: run from the source tree)"
            lines.append(f"  ok       {dist:<24} {where}")
        else:
            ready &= module not in REQUIRED
            kind = "MISSING " if module in REQUIRED else "optional"
            lines.append(f"  {kind} {dist:<24} needed for {needed_for}: {how}")
    for mismatch in mismatches(pins or {}):
        ready = False
        lines.append(f"  WRONG    {mismatch}")
    try:
        gpu = cuda_missing()
    except ImportError:
        gpu = "torch is not installed"
    ready &= gpu is None
    lines.append(f"  {'ok      ' if gpu is None else 'MISSING '} {'CUDA GPU':<24} {gpu or gpu_name()}")
    return lines, ready


def gpu_name() -> str:
    import torch

    return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, CUDA {torch.version.cuda}"


def machine() -> dict:
    """The GPU (or, rehearsed on a CPU, none) and the versions the figures were measured with."""
    import torch

    installed = {}
    for name in ("torch", "transformers", "peft", "trl", *KERNELS):
        try:
            installed[name] = version(name)
        except PackageNotFoundError:
            installed[name] = None
    if not torch.cuda.is_available():
        return {"date": datetime.date.today().isoformat(), "gpu": "no GPU (a rehearsal on the CPU)", "gpus": 0,
                "memory_gib": 0.0, "cuda": None, "versions": installed}
    props = torch.cuda.get_device_properties(0)
    return {"date": datetime.date.today().isoformat(), "gpu": props.name, "gpus": torch.cuda.device_count(),
            "memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda, "versions": installed}


def installed_packages() -> str:
    """This machine's installed distributions, `name==version` a line (as `pip freeze` writes them)."""
    return "".join(sorted({f"{d.metadata['Name']}=={d.version}\n" for d in distributions() if d.metadata["Name"]}))


def run_part(args: list[str], timeout: float, log: Path, env: dict | None = None, cwd: Path | None = None,
             grace_s: float = GRACE_S) -> dict:
    """Run one part of the pack with its output into `log`; its exit code (124 when it ran out of time: then it gets
    SIGTERM, and `grace_s` later SIGKILL, with every process it started, such as the bench's case in its own process,
    so that none holds the GPU into the next part)."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc, grace_s)
            code = 124
        try:  # what the part started and left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"command": " ".join(args[1:]), "exit_code": code, "seconds": round(time.monotonic() - started, 1),
            "log": log.name}


def bench_report(bench_json: Path) -> dict | None:
    """The bench's report; where its time limit stopped it, the cases it finished and the ratios of the pairs that
    both finished (`sft.bench.report.read_partial`, `partial: true`); None where it wrote neither."""
    from sft.bench.report import read_partial

    if bench_json.is_file():
        return json.loads(bench_json.read_text())
    partial = bench_json.with_name(bench_json.name + ".partial")
    return read_partial(partial) if partial.is_file() else None


def run_pack(repo: Path, out: Path, preset: str | None, overrides: list[str], tests: Path, bench_timeout: float,
             tests_timeout: float, test_limit_s: float) -> dict:
    """Both parts, one after the other, offline; the pack's report (`gpu_pack.json`'s contents), written as each part
    ends."""
    from sft.bench import outcomes

    out.mkdir(parents=True, exist_ok=True)
    (out / "image.txt").write_text(installed_packages())
    report: dict = {"machine": machine(), "parts": {}, "overrides": overrides, "tests": []}
    env = {**OFFLINE, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    bench_json = out / "bench.json"
    bench = [sys.executable, "-m", "sft.bench", "--out", str(bench_json), *([f"preset={preset}"] if preset else []),
             f"bench.case_logs={out / 'cases'}", *overrides]
    report["parts"]["bench"] = run_part(bench, bench_timeout, out / "bench.log", env, repo)
    report["bench"] = bench_report(bench_json)
    (out / "gpu_pack.json").write_text(json.dumps(report, indent=2) + "\n")
    outcomes_file = out / "tests.jsonl"
    report["parts"]["tests"] = run_part(
        [sys.executable, "-m", "pytest", "-m", "gpu", str(tests), "-rA", "-p", "no:cacheprovider", "-p",
         "sft.bench.outcomes"], tests_timeout, out / "gpu_tests.log",
        {**env, "SFT_TEST_OUTCOMES": str(outcomes_file), "SFT_TEST_LIMIT_S": str(test_limit_s)}, repo)
    report["tests"] = outcomes.read(outcomes_file)
    (out / "gpu_pack.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
