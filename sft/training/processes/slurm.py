"""Under SLURM: which job this process belongs to, whether it is a requeued job's next attempt, the run dir every
attempt of a batch job shares, what the scheduler's signals mean and how long it gives, and the requeue a stopped
run asks for.

- A job stopped at a signal (SIGTERM when a higher partition preempts it or `scancel --signal=TERM`, the `--signal`
  SLURM sends before the time limit, submitit's SIGUSR2) finishes its step, saves a complete checkpoint
  (`sft.training.step.preemption`), then its rank 0 requeues it (`scontrol requeue`, where the job may be requeued)
  and it exits 75 (`RequeueExit=75` requeues it where the cluster sets that instead). A cancelled job is not
  requeued: SLURM refuses, and the run stays stopped with its checkpoint.
- The next attempt (`SLURM_RESTART_COUNT` > 0) continues the run: the same run dir (`run_dir`:
  `outputs/slurm-<job id>` for a batch job without `hydra.run.dir`; a sweep job's dir is its own), `resume=auto`,
  nothing trained twice; a run that finished stays finished.

    SLURM_JOB_ID=42 SLURM_RESTART_COUNT=1  ->  SlurmJob("42", restart=1).continuation is True
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from functools import cached_property

log = logging.getLogger("sft")

# The signals that came before the run could take them (`note_signals_from_the_start`), in order.
EARLY_SIGNALS: list[int] = []


def note_signals_from_the_start(argv: list[str]) -> None:
    """Under SLURM, from a command's first line: SIGTERM, SIGUSR1 and SIGUSR2 that come while the stack imports (some
    seconds) are noted instead of ending the process (SIGUSR's default action kills it, and a job killed so is not
    requeued); the run's own handler (`sft.training.step.preemption.Preemption.install`) then acts on them: a stop at
    start-up, exit 75, the job requeued. SLURM may send the `--signal` warning up to 30 s before it is due (its
    time-limit pass runs every 30 s), so a short limit can warn a job as it starts. Not for a sweep's own process
    (`-m`), which runs no `Preemption` of its own where its jobs run elsewhere."""
    if "SLURM_JOB_ID" not in os.environ or threading.current_thread() is not threading.main_thread() or \
            {"-m", "--multirun"} & set(argv):
        return
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: EARLY_SIGNALS.append(signum))


class SlurmRefused(RuntimeError):
    """SLURM refused to queue a job (sbatch's reasons, one line): a partition that does not exist, more CPUs or memory
    than any node has."""


@dataclass(frozen=True)
class SlurmJob:
    id: str  # the job's id; an array task's `<array job>_<task>`
    restart: int  # SLURM_RESTART_COUNT: 0 for the first attempt
    step: str | None = None  # SLURM_STEP_ID: the job step this process is a task of (none in the batch script)

    @classmethod
    def current(cls) -> SlurmJob | None:
        """The job this process runs in, from SLURM's environment; None outside one."""
        env = os.environ
        if "SLURM_JOB_ID" not in env:
            return None
        array = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        job_id = f"{array[0]}_{array[1]}" if all(array) else env["SLURM_JOB_ID"]
        return cls(job_id, int(env.get("SLURM_RESTART_COUNT") or 0), env.get("SLURM_STEP_ID"))

    @property
    def continuation(self) -> bool:
        """A requeued job's next attempt: the run it started goes on."""
        return self.restart > 0

    @cached_property
    def fields(self) -> dict[str, str]:
        """`scontrol show job`'s fields (BatchFlag, Requeue, Partition, ...); {} where it does not answer."""
        try:
            out = subprocess.run(["scontrol", "show", "job", "-o", self.id.split("_")[0]], capture_output=True,
                                 text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    @property
    def requeueable(self) -> bool:
        """A batch job that may be requeued (`sbatch --requeue`, or the cluster's JobRequeue=1)."""
        return self.fields.get("BatchFlag") == "1" and self.fields.get("Requeue") == "1"

    def grace(self) -> str:
        """How long the scheduler gives after its SIGTERM, as it says it: the partition's GraceTime and KillWait."""
        partition = self.fields.get("Partition", "")
        try:
            part = subprocess.run(["scontrol", "show", "partition", "-o", partition], capture_output=True, text=True,
                                  timeout=30).stdout
            config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return "as the scheduler gives"
        grace = next((i.split("=", 1)[1] for i in part.split() if i.startswith("GraceTime=")), "?")
        kill_wait = next((line.split("=", 1)[1].strip() for line in config.splitlines()
                          if line.startswith("KillWait")), "?")
        return f"partition {partition}'s GraceTime={grace} s, then KillWait={kill_wait}"

    def requeue(self) -> str | None:
        """Ask SLURM to requeue this job (it ends this attempt); None where it did, else why not."""
        if not self.requeueable:
            return ("the job may not be requeued (submit it with sbatch --requeue)" if self.fields else
                    "scontrol does not answer")
        try:
            proc = subprocess.run(["scontrol", "requeue", self.id], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"scontrol requeue failed ({e})"
        return None if proc.returncode == 0 else (proc.stderr.strip() or f"scontrol requeue exit {proc.returncode}")


def signal_meaning(name: str) -> str:
    """What a signal means under SLURM, for the log line that says it was received."""
    return {"SIGTERM": "preempted, cancelled with a signal, or at the time limit",
            "SIGUSR2": "submitit's (or --signal's) warning before the time limit or a preemption",
            "SIGUSR1": "--signal's warning before the time limit",
            "SIGINT": "interrupted"}.get(name, name)


def batch_run_dir(job: SlurmJob) -> str:
    """The run dir every attempt (and every task) of a batch job shares: `outputs/slurm-<job id>`, with the job step
    where the run is one step of several (`srun` in the batch script)."""
    return f"outputs/slurm-{job.id}" + (f".{job.step}" if job.step not in (None, "batch") else "")


def set_run_dir(argv: list[str]) -> None:
    """Under a requeueable batch job, with no run dir given (`hydra.run.dir`, `SFT_RUN_DIR`), use `batch_run_dir`: a
    requeued attempt finds the run it continues, and every task of the job the same dir, without talking."""
    job = SlurmJob.current()
    if job is None or os.environ.get("SFT_RUN_DIR") or any(a.startswith("hydra.run.dir=") for a in argv):
        return
    if {"-m", "--multirun"} & set(argv) or not job.requeueable:
        return
    os.environ["SFT_RUN_DIR"] = batch_run_dir(job)
