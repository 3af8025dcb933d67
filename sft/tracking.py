"""Experiment trackers around a run: W&B run names and groups in sweeps, TensorBoard's HParams tab."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


def in_sweep() -> bool:
    """Whether this job is one of a Hydra multirun."""
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def job_overrides() -> list[str]:
    """The overrides that make this job what it is (Hydra's task overrides)."""
    return list(HydraConfig.get().overrides.task)


def name_the_run() -> None:
    """In a sweep, W&B runs share a group named after the sweep and are named by their overrides."""
    if in_sweep():
        os.environ.setdefault("WANDB_RUN_GROUP", Path(HydraConfig.get().sweep.dir).name)
        os.environ["WANDB_NAME"] = " ".join(job_overrides()) or "defaults"


def log_hparams(cfg: DictConfig, run_dir: str, metrics: dict, args) -> None:
    """The job's overrides and final metrics in TensorBoard's HParams tab, so sweeps compare side by side."""
    if "tensorboard" not in (args.report_to or []) or args.process_index != 0:
        return
    from torch.utils.tensorboard import SummaryWriter

    hparams = {k: v for k, v in (o.split("=", 1) for o in job_overrides() if "=" in o) if not k.startswith("hydra.")}
    hparams.update({"loss": cfg.loss._target_.rsplit(".", 1)[-1], "clip": cfg.clip._target_.rsplit(".", 1)[-1]})
    values = {f"hparam/{k}": metrics[k] for k in ("eval_loss", "eval_ce", "train_loss", "eval_exact_match_hardest")
              if isinstance(metrics.get(k), (int, float))}
    with SummaryWriter(log_dir=os.path.join(run_dir, "runs", "hparams")) as writer:
        writer.add_hparams({k: str(v) for k, v in hparams.items()}, values, run_name=".")


def finish_trackers() -> None:
    """Close this job's W&B run so that the next job of a sweep starts its own."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
