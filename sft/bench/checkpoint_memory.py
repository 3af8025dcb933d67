"""The `checkpoint_memory` case of `python -m sft.bench` (on request): what a full fine-tune's checkpoint costs each
rank's memory, sharded against gathered (`checkpoint.format`, `sft.training.checkpoints.sharded`).

Two processes under FSDP2 (gloo on a CPU), one optimizer step, one checkpoint, once in each format; each rank's peak
resident memory during the save above its own at the save's start, as the run logs it
(`WeightedLossTrainer._save_checkpoint`):

    checkpoint-1 (sharded): 0.4 s; memory above the step's: rank 0 +3 MiB, rank 1 +2 MiB

A rank's share is the checkpoint's model and optimizer bytes over the ranks (what each writes when sharded).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FORMATS = ("gathered", "sharded")
PROCESSES = 2
LINE = re.compile(r"checkpoint-\d+ \((?:sharded|gathered)\): ([\d.]+) s; memory above the step's: (.*)$", re.M)


def launch_args(port: int) -> list[str]:
    """`sft launch`'s arguments for two processes on this machine (as launch.sh gives them)."""
    return ["--num_processes", str(PROCESSES), "--num_machines", "1", "--machine_rank", "0", "--main_process_ip",
            "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
            "--multi_gpu"]


def save_figures(log: str) -> dict | None:
    """The first checkpoint's save in a run's log (`CheckpointSaving._save_checkpoint`'s line): its seconds and each
    rank's memory above the step's, in MiB; None where no save was logged."""
    found = LINE.search(log)
    if found is None:
        return None
    return {"seconds": float(found.group(1)), "rank_mib": [float(m) for m in re.findall(r"rank \d+ \+(\d+) MiB",
                                                                                         found.group(2))]}


def checkpoint_bytes(folder: Path) -> int:
    """The model's and optimizer's bytes in a checkpoint, as its sharded files hold them."""
    return sum(p.stat().st_size for name in ("pytorch_model_fsdp_0", "optimizer_0") for p in (folder / name).iterdir())


def run_checkpoint_memory(overrides: list[str], timeout_s: int, free_port) -> dict:
    """Both formats' figures; `free_port()` gives each launch its rendezvous port."""
    result = {}
    with tempfile.TemporaryDirectory(prefix="sft-bench-checkpoint-memory-") as tmp:
        for fmt in FORMATS:
            run = Path(tmp, fmt)
            cmd = [sys.executable, "-m", "sft.commands.launch", *launch_args(free_port()), "-m", "sft.train",
                   *[o for o in overrides if not o.startswith("bench.")], "fsdp=full_shard", f"checkpoint.format={fmt}",
                   "trainer.max_steps=1",
                   "trainer.save_steps=1", "trainer.eval_strategy=no", "trainer.report_to=[]", f"hydra.run.dir={run}"]
            print(f"[checkpoint_memory] {fmt} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
            found = save_figures(Path(run, "train.log").read_text()) if Path(run, "train.log").is_file() else None
            if proc.returncode != 0 or found is None:
                raise RuntimeError(f"checkpoint_memory {fmt}: exit {proc.returncode}: {proc.stderr[-2000:]}")
            result[fmt] = found
            if fmt == "sharded":
                result["checkpoint_mib"] = checkpoint_bytes(run / "checkpoint-1") / 2**20
    result["share_mib"] = result["checkpoint_mib"] / PROCESSES
    return result


def drive_checkpoint_memory(context) -> tuple[dict, dict]:
    """Both formats' figures, and rank 0's peak above its step's while saving: sharded, over its share of the
    checkpoint (the target), and each format's in MiB."""
    figures = run_checkpoint_memory(context.overrides, context.base.bench.case_timeout_s, context.free_port)
    return figures, {"checkpoint_rank0_vs_share": figures["sharded"]["rank_mib"][0] / figures["share_mib"],
                     "checkpoint_rank0_gathered_mib": figures["gathered"]["rank_mib"][0],
                     "checkpoint_rank0_sharded_mib": figures["sharded"]["rank_mib"][0]}


def show_checkpoint_memory(name: str, report: dict) -> list[str]:
    c = report["cases"][name]
    return [f"checkpoint    full fine-tune, 2 processes (FSDP2), a {c['checkpoint_mib']:.0f} MiB checkpoint ("
            f"{c['share_mib']:.0f} MiB a rank): memory above the step's while saving: " + "; ".join(
                f"{fmt} " + ", ".join(f"rank {r} +{m:.0f} MiB" for r, m in enumerate(c[fmt]["rank_mib"]))
                + f" ({c[fmt]['seconds']:.1f} s)" for fmt in FORMATS)]
