"""Experiment trackers around a run: W&B run names and groups in sweeps, TensorBoard's HParams tab, MLflow runs
with the whole config, the results and the sweep report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from sft.ranks import is_rank_zero


def in_sweep() -> bool:
    """Whether this job is one of a Hydra multirun."""
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def job_overrides() -> list[str]:
    """The overrides that make this job what it is (Hydra's task overrides), as given: an interpolation in one
    stays unresolved (a secret moved to the environment, `sft.config.secrets`, is never read back into it)."""
    return list(OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False))


def run_name() -> str | None:
    """A sweep job's name: its overrides (in a Hydra multirun, or `SFT_RUN_NAME` from `sft.experiments.sweep`); else None."""
    if in_sweep():
        return " ".join(job_overrides()) or "defaults"
    return os.environ.get("SFT_RUN_NAME")


def name_the_run() -> None:
    """In a sweep, W&B runs share a group named after the sweep and are named by their overrides."""
    if in_sweep():
        os.environ.setdefault("WANDB_RUN_GROUP", Path(HydraConfig.get().sweep.dir).name)
    if (name := run_name()) is not None:
        os.environ["WANDB_NAME"] = name


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


SWEEP_REPORT_FILES = ("sweep_summary.md", "sweep_summary.csv", "sweep_jobs.csv", "sweep_summary.png")


def sweep_experiment(sweep_dir) -> str:
    """The MLflow experiment that holds a sweep's runs and its report (unless MLFLOW_EXPERIMENT_NAME says)."""
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or f"sweep {sweep_dir}"


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: `{"loss": {"alpha": 1.0}}` -> `{"loss.alpha": "1.0"}`."""
    params = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flat_params(value, f"{name}."))
        else:
            params[name] = str(value)
    return params


def start_mlflow(cfg: DictConfig, run_dir: str) -> None:
    """With `trainer.report_to` naming mlflow, on rank 0: open this run's MLflow run before Trainer's
    `MLflowCallback` would, so the callback logs its params and metrics into it and leaves it open for the final
    evaluation and the artifacts (`finish_mlflow`). Experiment: MLFLOW_EXPERIMENT_NAME, the sweep's in a sweep,
    else `sft`; run name: `trainer.run_name`, a sweep job's overrides, else the run dir's name; params: the
    resolved config, flattened (`loss.alpha`), beside the callback's TrainingArguments fields."""
    if "mlflow" not in (cfg.trainer.report_to or []) or not is_rank_zero():
        return
    import mlflow

    from sft.config.secrets import masked

    mlflow.set_experiment(sweep_experiment(HydraConfig.get().sweep.dir) if in_sweep()
                          else os.environ.get("MLFLOW_EXPERIMENT_NAME", "sft"))
    mlflow.start_run(run_name=cfg.trainer.run_name or run_name() or Path(run_dir).name)
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    config = masked(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    params = [(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in flat_params(config).items()]
    for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
        mlflow.log_params(dict(params[i:i + MAX_PARAMS_TAGS_PER_BATCH]))
    mlflow.set_tag("sft.run_dir", str(Path(run_dir).resolve()))


def finish_mlflow(run_dir: str, status: str) -> None:
    """End this run's MLflow run (FINISHED, FAILED or KILLED) with `results.json` and `eval_rows.jsonl` as
    artifacts; nothing when no MLflow run is open."""
    if "mlflow" not in sys.modules:
        return
    import mlflow

    if mlflow.active_run() is None:
        return
    for name in ("results.json", "eval_rows.jsonl"):
        if (Path(run_dir) / name).is_file():
            mlflow.log_artifact(str(Path(run_dir) / name))
    if hasattr(mlflow, "flush_async_logging"):  # the callback logs metrics asynchronously
        mlflow.flush_async_logging()
    mlflow.end_run(status=status)


def log_sweep_report(sweep_dir, report_to) -> None:
    """The sweep report's files as the artifacts of a `sweep report` run in the sweep's MLflow experiment."""
    if "mlflow" not in (report_to or []):
        return
    import mlflow

    mlflow.set_experiment(sweep_experiment(sweep_dir))
    with mlflow.start_run(run_name="sweep report"):
        for name in SWEEP_REPORT_FILES:
            if (Path(sweep_dir) / name).is_file():
                mlflow.log_artifact(str(Path(sweep_dir) / name))
