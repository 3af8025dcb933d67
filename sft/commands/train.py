"""`sft train [group=option] [key=value ...]` (also `python -m sft.train`): the command line of a training run.

`cli` settles what Hydra cannot (the answer to `--help GROUP`, secrets out of the command line, refusals before
Hydra writes the run dir, the run dir shared by every rank, a sweep's start), then Hydra composes the config
(`sft/conf/train.yaml`) and `main` checks it and runs it (`sft.run.train`), turning a refusal into one line.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from sft.training.observability.noise import quiet_foreign_noise

quiet_foreign_noise()  # before the imports below bring in DeepSpeed and PEFT (sft.training.observability.noise)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from sft.config.registry import CONF_DIR, register
from sft.config.schema import ConfigError
from sft.config.secrets import mask_saved_config, secrets_to_environment
from sft.config.validate import check
from sft.experiments.results import RunResults
from sft.experiments.tracking import in_sweep, job_overrides
from sft.ranks import is_rank_zero
from sft.run.train import train
from sft.training.observability.advice import TrainingStopped
from sft.training.processes.distributed import (exit_without_teardown, rank_overrides, refuse_multirun_in_launch,
                                                share_run_dir, slurm_distributed_env)
from sft.training.processes.rank_errors import report

log = logging.getLogger("sft")
register()


def fail(message: str, code: int = 2) -> None:
    """From an `except` block: stop with the reason and `code` (a traceback with HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1" and _full_error.composed:
        raise
    report(message, code)  # printed here, or once for all ranks by the launcher (sft.training.processes.rank_errors)
    sys.exit(code)


def fail_on_refusal(e: Exception, overrides: list[str]) -> None:
    """From the `except` block of a command that composes `overrides` itself (`sft inspect`, `sft distill`): stop with
    one line where `e` is a refusal (a config value, the data, an override Hydra refuses); else return (re-raise)."""
    from hydra.errors import ConfigCompositionException, HydraException, InstantiationException
    from omegaconf.errors import OmegaConfBaseException

    from sft.config.argv import composition_error
    from sft.data.rows.reading import DataError

    reason = e.__cause__ if isinstance(e, InstantiationException) else e
    if isinstance(reason, ConfigError):
        fail(f"config: {reason}")
    if isinstance(reason, DataError):
        fail(str(reason))
    if isinstance(reason, HydraException) and (said := composition_error(reason, overrides)) is not None:
        fail(f"config: {said}")  # an override Hydra cannot parse, a misspelt knob: one line naming it
    if isinstance(reason, (ConfigCompositionException, OmegaConfBaseException)):  # an override Hydra refuses
        fail(f"config: {reason}")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from hydra.errors import InstantiationException

    from sft.data.rows.reading import DataError
    from sft.training.processes.slurm import SlurmJob
    from sft.training.step.preemption import PREEMPTED_EXIT_CODE, Preempted

    started = time.time()
    _full_error.restore()  # composed: from here Hydra reports what fails as the user asked (compose_then_run)
    if is_rank_zero():
        mask_saved_config(HydraConfig.get().runtime.output_dir)
    finished = start_sweep_job(cfg) if in_sweep() else None
    if finished is not None:
        return finished.eval_ce
    try:
        check(cfg)
        results = train(cfg)
    except Exception as e:
        # instantiate wraps what the built function raised; the user needs that reason, not the wrapper.
        reason = e.__cause__ if isinstance(e, InstantiationException) else e
        if isinstance(reason, Preempted):  # also inside a sweep: the machine is going away, so is the sweep
            if is_rank_zero():
                print_summary(HydraConfig.get().runtime.output_dir)
            print(f"preempted: {reason}", file=sys.stderr)
            requeue_slurm_job(HydraConfig.get().runtime.output_dir)
            sys.exit(PREEMPTED_EXIT_CODE)
        if in_sweep() and cfg.sweep.continue_on_error:
            job = SlurmJob.current()
            run_dir = HydraConfig.get().runtime.output_dir
            RunResults.failed(reason, time.time() - started, job.id if job else None,
                              before=RunResults.read(run_dir)).record(run_dir)
            return None
        if isinstance(reason, ConfigError):
            fail(f"config: {reason}")
        if isinstance(reason, DataError):
            fail(str(reason))
        if isinstance(reason, TrainingStopped):
            fail(str(reason), code=1)
        raise
    if is_rank_zero():
        print_summary(HydraConfig.get().runtime.output_dir)
        print(f"run dir: {HydraConfig.get().runtime.output_dir}")
    return results.eval_ce  # the objective of sweeps: comparable across loss weights, unlike eval_loss


def requeue_slurm_job(run_dir: str) -> None:
    """Under SLURM, rank 0 of a run stopped at a signal (its checkpoint complete, every rank done) asks SLURM why
    (`SlurmJob.stop`): a job SLURM requeues itself or the user cancelled is left so; any other is requeued
    (`sft.training.processes.slurm`), and the next attempt continues the run. Said either way."""
    from sft.training.processes.slurm import SlurmJob

    job = SlurmJob.current()
    if job is None or not is_rank_zero():
        return
    sys.stderr.flush()
    stop = job.stop()
    if stop.cause == "requeued":
        print(f"SLURM job {job.id}: {stop.why}; attempt {job.restart + 2} continues this run from its checkpoint",
              file=sys.stderr, flush=True)
        return
    if stop.cause == "cancelled":
        print(f"SLURM job {job.id}: {stop.why}: not requeued; the run stays stopped at its checkpoint in {run_dir} "
              f"(to go on: sbatch it again with hydra.run.dir={run_dir} resume=auto)", file=sys.stderr, flush=True)
        return
    why = job.requeue()
    if why is None:
        print(f"SLURM job {job.id} ({stop.why}): requeued; attempt {job.restart + 2} continues this run from its "
              "checkpoint", file=sys.stderr, flush=True)
    else:
        print(f"SLURM job {job.id}: not requeued ({why}); exit code 75 (RequeueExit=75 requeues it where the "
              "cluster sets that; else submit it again: it continues the run)", file=sys.stderr, flush=True)


def print_summary(run_dir: str) -> None:
    """The run's summary (`sft.experiments.summary`: what changed, where the model is, what to run next), where it
    wrote one."""
    summary = Path(run_dir, "summary.txt")
    if summary.is_file():
        print("\n" + summary.read_text(), end="")


def start_sweep_job(cfg: DictConfig) -> RunResults | None:
    """A job of a multirun records its overrides in its dir; with `sweep.resume`, a job that finished before
    returns its results (it is not run again) and the others resume from their newest complete checkpoint."""
    from sft.experiments.sweep import start_job

    hydra_cfg = HydraConfig.get()
    try:
        finished = start_job(hydra_cfg.runtime.output_dir, hydra_cfg.job.num, job_overrides(), cfg.sweep.resume)
    except ConfigError as e:  # the sweep dir is another sweep's: no job of this one may write into it
        fail(f"config: {e}")
    if finished is not None:
        log.info("sweep.resume: this job finished before (results.json ok): skipped")
    elif cfg.sweep.resume:
        cfg.resume = "auto"
    return finished


def cli() -> None:
    """The `python -m sft.train` entry point: settle the multi-process details, then run `main`."""
    if {"--help", "-h"} & set(sys.argv[1:]):
        from sft.config.help import help_answer

        try:
            text = help_answer(sys.argv[1:])
        except ConfigError as e:
            fail(f"config: {e}")
        if text is not None:  # else Hydra's own --help (a pkg:// search path, or an error to report)
            print(text, end="")
            return
    from sft.config.argv import check_only, refused_before_composing
    from sft.training.checkpoints.run_dir import unlink_planted, unwritable_dir
    from sft.training.processes.slurm import set_run_dir as set_slurm_run_dir

    sys.argv[1:] = secrets_to_environment(sys.argv[1:])  # before Hydra writes or W&B records the command line
    if "--check" in sys.argv[1:]:  # compose and check only (./launch.sh, before several processes)
        sys.exit(check_only([a for a in sys.argv[1:] if a != "--check"]))

    # before Hydra, whose errors would not name the knob, and which writes into the run dir first
    if refused := refused_before_composing(sys.argv[1:]) or unwritable_dir(sys.argv[1:]):
        report(f"config: {refused}", 2)
        sys.exit(2)
    unlink_planted(sys.argv[1:])
    slurm_distributed_env()  # srun's tasks as ranks, before the run dir is shared among them
    set_slurm_run_dir(sys.argv[1:])  # a requeueable batch job: every attempt's run dir
    refuse_multirun_in_launch(sys.argv[1:])
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        from sft.commands.sweep import start_multirun

        start_multirun(sys.argv[1:])
    share_run_dir()
    sys.argv.extend(rank_overrides())
    compose_then_run(sys.argv[1:])


class _FullError:
    """HYDRA_FULL_ERROR as the user set it, while `compose_then_run` sets it to have Hydra raise a composition error."""

    def __init__(self):
        self.composed, self.saved = True, None

    def raise_until_composed(self) -> None:
        self.composed, self.saved = False, os.environ.get("HYDRA_FULL_ERROR")
        os.environ["HYDRA_FULL_ERROR"] = "1"

    def restore(self) -> None:
        if not self.composed:
            self.composed = True
            if self.saved is None:
                os.environ.pop("HYDRA_FULL_ERROR", None)
            else:
                os.environ["HYDRA_FULL_ERROR"] = self.saved


_full_error = _FullError()


def compose_then_run(overrides: list[str]) -> None:
    """`main` under Hydra, which composes the config once (nothing composes it before): a composition that fails
    (a misspelt knob, a value its type refuses, an option that does not exist) is said in one line naming the knob
    (`sft.config.argv.composition_error`), exit code 2, before Hydra writes anything; what fails once the config is
    composed, Hydra reports as it always does."""
    from sft.config.argv import composition_error

    _full_error.raise_until_composed()  # until `main` starts, Hydra raises what fails instead of printing it
    try:
        main()
    except Exception as e:
        if _full_error.composed:  # the run's own failure, with HYDRA_FULL_ERROR=1 set by the user
            raise
        _full_error.restore()
        from sft.training.processes.slurm import SlurmRefused, SweepStopped
        from sft.training.step.preemption import PREEMPTED_EXIT_CODE

        if isinstance(e, SlurmRefused):  # a sweep's jobs, which SLURM refused to queue or to start
            report(f"slurm: {e}", 2)
            sys.exit(2)
        if isinstance(e, SweepStopped):
            print(f"stopped: {e}", file=sys.stderr, flush=True)
            sys.exit(PREEMPTED_EXIT_CODE)
        plain = [o for o in overrides if "=" in o and not o.startswith(("-", "hydra/"))
                 and (not o.startswith("hydra.") or o.startswith("hydra.searchpath="))]
        refused = composition_error(e, plain)
        if refused is None:
            refused = ConfigError("command line", None, str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
        report(f"config: {refused}", 2)
        sys.exit(2)


if __name__ == "__main__":
    cli()
    exit_without_teardown()  # not in `cli`: tests call that in their own process
