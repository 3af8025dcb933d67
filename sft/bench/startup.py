"""The bench's `startup` case: how long `python -m sft.train` takes to print its config, its help and a group's help,
and the default run from the command to its first optimizer step (`sft.bench.run`; targets there)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time


def drive_startup(context) -> tuple[dict, dict[str, float]]:
    """Each start-up's median wall time over `bench.startup_repeats` runs, in seconds, by its ratio's name."""
    repeats = context.base.bench.startup_repeats
    return {}, {"startup_cfg_job_s": startup_seconds("--cfg", "job", repeats=repeats),
                "startup_help_s": startup_seconds("--help", repeats=repeats),
                "startup_help_group_s": startup_seconds("--help", "loss", "loss=focal", repeats=repeats),
                "startup_first_step_s": first_step_seconds(repeats)}


def startup_seconds(*args: str, repeats: int = 5) -> float:
    """Wall time of `python -m sft.train args...`: the median of `repeats` runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sft.train", *args], capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def first_step_seconds(repeats: int = 5) -> float:
    """Wall time of the default run (`python -m sft.train`, no overrides but these) trained for one step,
    with no evaluation or checkpoint: from the command to the first optimizer step, plus saving the tiny
    model. Caches are warmed by one untimed run; the median of `repeats`."""
    times = []
    one_step = ["trainer.max_steps=1", "trainer.eval_strategy=no", "trainer.save_strategy=no", "trainer.report_to=[]"]
    with tempfile.TemporaryDirectory(prefix="sft-bench-first-step-") as tmp:
        for n in range(repeats + 1):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "sft.train", *one_step, f"hydra.run.dir={tmp}/{n}"],
                           capture_output=True, check=True)
            if n:  # the first run warms the caches (tiny model, tokenised data)
                times.append(time.perf_counter() - started)
    return statistics.median(times)
