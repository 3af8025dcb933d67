"""`hydra/launcher=slurm` and `slurm_cpu`: each job of a sweep a SLURM job (an array task), through
hydra-submitit-launcher, as its `SlurmLauncher` does, with what a sweep of runs needs besides:

- a job SLURM refuses at submission (a partition that does not exist, more memory than any node has) is one line
  naming sbatch's reason (`SlurmRefused`), not a traceback; so is one SLURM queues for a wait no wait ends (more CPUs
  or nodes than the partition has: `PENDING (PartitionConfig)`, where the cluster does not set EnforcePartLimits),
  once seen pending so, and the sweep's jobs are cancelled;
- a signal to the sweep's process while it waits (SIGTERM, Ctrl-C) cancels its jobs (each run saves its checkpoint,
  not requeued: `sweep.resume=true` goes on) and stops the sweep, exit 75 (`SweepStopped`), rather than leaving them
  queued;
- the sweep waits until every job has ended, then writes its report: a job that ended without a result (killed, its
  node down, cancelled) is recorded as failed in its dir's `results.json`, with its SLURM job id, its state and the
  first line of its error, and the others are reported; Hydra's own launcher stopped the sweep at the first such job;
- a job stopped at a signal requeues itself once its checkpoint is complete and its next attempt continues the run
  (`sft.training.processes.slurm`): submitit's own requeue, which resubmits the job without a checkpoint of the run,
  is not used (the run takes submitit's SIGUSR2 as its own stop).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher

from sft.training.processes.slurm import SlurmRefused, SweepStopped

log = logging.getLogger("sft")

POLL_S = 2.0  # how often the sweep asks SLURM how its jobs are
# Why a job pends that no wait ends (squeue's %r; `man squeue`, JOB REASON CODES): the request is beyond what the
# partition, its QOS or the account allows one job. SLURM queues such a job unless the cluster sets EnforcePartLimits.
NEVER_STARTS = {
    "PartitionConfig": "asks more CPUs, memory or GPUs than the partition's nodes have",
    "PartitionNodeLimit": "asks more nodes than the partition has or allows",
    "PartitionTimeLimit": "asks a longer time limit than the partition allows",
    "BadConstraints": "asks for node features no node has",
    "InvalidAccount": "names an account that does not exist",
    "InvalidQOS": "names a QOS that does not exist or is not the account's",
    "QOSMaxCpuPerJobLimit": "asks more CPUs than its QOS allows a job",
    "QOSMaxNodePerJobLimit": "asks more nodes than its QOS allows a job",
    "QOSMaxWallDurationPerJobLimit": "asks a longer time limit than its QOS allows",
    "AssocMaxCpuPerJobLimit": "asks more CPUs than the account allows a job",
    "AssocMaxNodePerJobLimit": "asks more nodes than the account allows a job",
    "AssocMaxWallDurationLimit": "asks a longer time limit than the account allows",
}


class SlurmLauncher(SubmititSlurmLauncher):
    """hydra-submitit-launcher's `SlurmLauncher`, each job's end recorded whatever it was (see the module)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit
        from hydra.core.singleton import Singleton

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        params = [(list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", Singleton.get_state())
                  for number, overrides in enumerate(job_overrides, initial_job_idx)]
        with _stderr_kept() as said:  # sbatch writes its refusal there too: said once, in the error
            try:
                jobs = self.executor(submitit).map_array(self, *zip(*params))
            except submitit.core.utils.FailedJobError as e:
                reasons = refusal(said() + "\n" + str(e))
                raise SlurmRefused(f"sbatch refused the sweep's jobs: {reasons}") from None
            queued = said()
        sys.stderr.write(queued)
        log.info("sweep: %d SLURM job(s) queued (%s) in %s; waiting for every one to end", len(jobs),
                 ", ".join(j.job_id for j in jobs), sweep_dir)
        wait_for(jobs)
        returns = []
        for number, job in enumerate(jobs, initial_job_idx):
            try:
                returns.append(job.results()[0])
            except Exception as e:  # noqa: BLE001 - a job that ended without a result: recorded, the sweep goes on
                returns.append(self.ended_without_result(sweep_dir / str(number), job, e))
        return returns

    def executor(self, submitit):
        """submitit's executor with the launcher's parameters, as hydra-submitit-launcher builds it: the folder and
        `max_num_timeout` given to the executor, the queue's own knobs prefixed with `slurm_`."""
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init["slurm_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items()
                                      if k not in ("submitit_folder", "max_num_timeout")})
        return executor

    @staticmethod
    def ended_without_result(job_dir: Path, job, error: Exception) -> JobReturn:
        """A job that ended without a result, as a failed run of the sweep: its state in SLURM's accounting and the
        first line of its error in its `results.json` (where its run wrote no record of its own end), and a completed
        return for Hydra, whose sweeper would re-raise a failed one."""
        from sft.experiments.results import RunResults

        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = next((line for line in lines if "Traceback" not in line), type(error).__name__)
        recorded = RunResults.read(job_dir)
        if recorded is None or recorded.status not in ("ok", "failed"):
            RunResults.failed(f"SLURM job {job.job_id} ended {job.state}: {reason[:300]}", 0.0, job.job_id,
                              before=recorded).write(job_dir)
        log.error("sweep: SLURM job %s (%s) ended %s without a result: %s", job.job_id, job_dir, job.state, reason)
        ret = JobReturn()
        ret.status, ret.return_value = JobStatus.COMPLETED, None
        return ret


def wait_for(jobs) -> None:
    """Until every job of the sweep has ended. A job pending for a reason no wait ends (`NEVER_STARTS`) cancels the
    sweep's jobs and raises `SlurmRefused`; a SIGTERM or SIGINT to this process cancels them and raises
    `SweepStopped`."""
    stopped: list[str] = []

    def on_signal(signum, frame):
        stopped.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not all(job.done() for job in jobs):
            if never := never_starting([job.job_id for job in jobs]):
                cancel(jobs)
                raise SlurmRefused(f"SLURM queued the sweep's jobs but will never start {never}; the sweep's "
                                   f"{len(jobs)} job(s) cancelled")
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        cancel(jobs)
        raise SweepStopped(f"{stopped[0] if stopped else 'SIGINT'} to the sweep: its {len(jobs)} SLURM job(s) "
                           f"cancelled ({', '.join(j.job_id for j in jobs)}); each running one saved its checkpoint: "
                           "the same command with sweep.resume=true goes on") from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def never_starting(job_ids: list[str]) -> str | None:
    """The first of the jobs that pends for a reason no wait ends, as `job 14_0 (PENDING PartitionConfig: asks ...)`;
    None where none does (or squeue does not answer)."""
    arrays = sorted({job_id.split("_")[0] for job_id in job_ids})
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(arrays), "-o", "%i|%T|%r"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        job_id, state, reason = (line.split("|") + ["", ""])[:3]
        if state == "PENDING" and reason in NEVER_STARTS and job_id in job_ids:
            return f"job {job_id} (PENDING {reason}: {NEVER_STARTS[reason]})"
    return None


def cancel(jobs) -> None:
    """scancel the sweep's jobs: a running one gets SIGTERM, saves its checkpoint and is not requeued
    (`sft.training.processes.slurm.Stop`)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["scancel", *(job.job_id for job in jobs)], capture_output=True, timeout=60)


def refusal(message: str) -> str:
    """sbatch's reasons, from its output and submitit's error, in one line.

        "sbatch: error: Memory specification can not be satisfied / sbatch: error: Batch job submission failed: ..."
            -> "Memory specification can not be satisfied; Batch job submission failed: ..."
    """
    reasons = [line.split("error:", 1)[1].strip() for line in message.splitlines() if "error:" in line]
    return "; ".join(dict.fromkeys(r for r in reasons if r)) or message.strip().splitlines()[-1]


@contextlib.contextmanager
def _stderr_kept():
    """Within the block, what this process and its children write to stderr (file descriptor 2) is kept, not shown;
    yields a function that returns it."""
    sys.stderr.flush()
    saved, kept = os.dup(2), tempfile.TemporaryFile()
    os.dup2(kept.fileno(), 2)
    try:
        yield lambda: (kept.seek(0), kept.read().decode(errors="replace"))[1]
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
