"""Under SLURM: which job this process belongs to, whether it is a requeued job's next attempt, the run dir every
attempt of a batch job shares, what the scheduler's signals mean and how long it gives, and the requeue a stopped
run asks for.

- A job stopped at a signal (SIGTERM when a higher partition preempts it or `scancel --signal=TERM`, the `--signal`
  SLURM sends before the time limit, submitit's SIGUSR2) finishes its step, saves a complete checkpoint
  (`sft.training.step.preemption`), then its rank 0 asks SLURM why (`SlurmJob.stop`) and requeues it (`scontrol
  requeue`, where the job may be requeued) and it exits 75 (`RequeueExit=75` requeues it where the cluster sets that
  instead). A cancelled job (`scancel`) is not requeued: the run stays stopped with its checkpoint. A job SLURM
  requeued itself (a preemption under PreemptMode=REQUEUE, a node failure) is not requeued twice.
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
    """SLURM refused a sweep's jobs, in one line: sbatch refused to queue them (a partition that does not exist, more
    memory than any node has), or queued them for a wait that never ends (more CPUs than a node has: `PENDING
    (PartitionConfig)`), when they were cancelled. Exit code 2."""


class SweepStopped(RuntimeError):
    """The process of a sweep whose jobs are SLURM jobs got a signal while it waited for them: its jobs were cancelled
    (each run saves its checkpoint and is not requeued). Exit code 75: `sweep.resume=true` goes on."""


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
        """`scontrol show job`'s fields (BatchFlag, Requeue, Partition, ...) when first asked; {} where it does not
        answer."""
        return self.fields_now()

    def fields_now(self) -> dict[str, str]:
        """`scontrol show job`'s fields as they are now (JobState, Reason, Restarts change as the job ends)."""
        try:
            out = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True,
                                 timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def accounted_state(self) -> str | None:
        """The job's state in SLURM's accounting (`sacct`: "CANCELLED by 0", "PREEMPTED", "RUNNING"); None without
        accounting."""
        try:
            out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", self.id, "-o", "State"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
        return lines[-1].strip() if lines else None

    def stop(self) -> Stop:
        """Why this attempt is stopping, in SLURM's own words: `scontrol show job` read afresh and, where it cannot
        tell a cancel from a preemption, accounting (see `Stop`)."""
        now = self.fields_now()
        state, reason = now.get("JobState", ""), now.get("Reason", "")
        if not now:
            return Stop("unknown", "scontrol does not answer")
        if int(now.get("Restarts") or 0) > self.restart or state in ("PENDING", "REQUEUED", "REQUEUE_HOLD"):
            return Stop("requeued", "SLURM requeues it itself (preempted under PreemptMode=REQUEUE, or its node "
                        "failed)")
        if state == "RUNNING":  # only signalled: `scancel --signal`, `--signal`'s warning, a preemption's grace
            return Stop("signalled", "signalled while it runs")
        if reason == "TimeLimit" or state == "TIMEOUT":
            return Stop("time limit", "at its time limit")
        accounted = self.accounted_state() or ""
        if accounted.startswith("CANCELLED") or state == "CANCELLED":
            return Stop("cancelled", f"cancelled ({accounted or state}: scancel)")
        if accounted == "PREEMPTED" or state == "PREEMPTED":
            return Stop("preempted", "preempted (PreemptMode=CANCEL)")
        if not accounted:  # a cancel and a preemption under PreemptMode=CANCEL look alike to scontrol
            return Stop("cancelled", f"ending ({state}) without a time limit, not requeued by SLURM, and accounting "
                        "does not answer to tell a preemption from a cancel: taken as cancelled (scancel)")
        return Stop("ending", f"ending ({state}, {accounted})")

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
        """Ask SLURM to requeue this job (it ends this attempt); None where it did, else why not. Ask only where
        `stop()` says neither SLURM requeued it nor the user cancelled it: SLURM 22.05 accepts `scontrol requeue` of a
        job being cancelled, and a cancel would never end."""
        if not self.requeueable:
            return ("the job may not be requeued (submit it with sbatch --requeue)" if self.fields else
                    "scontrol does not answer")
        try:
            proc = subprocess.run(["scontrol", "requeue", self.id], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"scontrol requeue failed ({e})"
        return None if proc.returncode == 0 else (proc.stderr.strip() or f"scontrol requeue exit {proc.returncode}")


@dataclass(frozen=True)
class Stop:
    """Why a SLURM job's attempt is stopping, as SLURM has it when the run asks (after its checkpoint). Read on Slurm
    22.05 (tests/e2e/test_slurm.py, docs/distributed.md), `scontrol show job` while the job's processes handle the
    signal:

        scancel                          JobState=COMPLETING Reason=None       Restarts as before  sacct: CANCELLED by 0
        the time limit                   JobState=COMPLETING Reason=TimeLimit  Restarts as before
        preempted, PreemptMode=REQUEUE   JobState=RUNNING within its GraceTime; once requeued: COMPLETING, Restarts + 1
        preempted, PreemptMode=CANCEL    JobState=COMPLETING Reason=None       Restarts as before  sacct: PREEMPTED
        its node failed                  JobState=PENDING                      Restarts + 1
        scancel --signal, --signal=...   JobState=RUNNING

    `cause`: requeued (SLURM does it), cancelled (no requeue), signalled, time limit, preempted, ending (sft
    requeues these), unknown (scontrol does not answer)."""

    cause: str
    why: str

    @property
    def wants_requeue(self) -> bool:
        """Whether the run asks SLURM to requeue the job: not where SLURM does it itself, nor where it was cancelled."""
        return self.cause not in ("requeued", "cancelled")


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
