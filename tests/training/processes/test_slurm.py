"""Why a SLURM job's attempt stops (`sft.training.processes.slurm.SlurmJob.stop`), read from what `scontrol show job`
and `sacct` said on Slurm 22.05 while a job handled the signal (recorded on the test cluster, tests/slurm_cluster.py;
the real thing runs in tests/e2e/test_slurm.py): a cancel is never requeued, a job SLURM requeued itself is not
requeued twice, every other stop is."""

import os
import stat

import pytest

from sft.training.processes.slurm import SlurmJob


def fake_slurm(folder, scontrol: str, sacct: str | None) -> None:
    """`scontrol show job` printing `scontrol` (and `scontrol requeue` noting it was asked), `sacct` printing `sacct`
    (failing where None: no accounting)."""
    for name, text in (("scontrol", f'[ "$1" = requeue ] && echo "$@" >> {folder}/requeued && exit 0\n'
                                    f"echo '{scontrol}'"),
                       ("sacct", f"echo '{sacct}'" if sacct is not None else "echo 'no accounting' >&2; exit 1")):
        path = folder / name
        path.write_text(f"#!/bin/sh\n{text}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


RUNNING = "JobId=42 JobState=RUNNING Reason=None Requeue=1 Restarts=0 BatchFlag=1"
# (what SLURM said, accounting's state, the cause sft reads, whether it requeues)
SEEN = [
    ("plain scancel", "JobId=42 JobState=COMPLETING Reason=None Requeue=1 Restarts=0 BatchFlag=1", "CANCELLED by 0",
     "cancelled", False),
    ("the time limit", "JobId=42 JobState=COMPLETING Reason=TimeLimit Requeue=1 Restarts=0 BatchFlag=1", "TIMEOUT",
     "time limit", True),
    ("preempted, PreemptMode=REQUEUE, once SLURM requeued it",
     "JobId=42 JobState=COMPLETING Reason=None Requeue=1 Restarts=1 BatchFlag=1",
     "REQUEUED", "requeued", False),
    ("preempted, PreemptMode=CANCEL", "JobId=42 JobState=COMPLETING Reason=None Requeue=1 Restarts=0 BatchFlag=1",
     "PREEMPTED", "preempted", True),
    ("its node failed", "JobId=42 JobState=PENDING Reason=None Requeue=1 Restarts=1 BatchFlag=1", "PENDING",
     "requeued", False),
    ("scancel --signal=TERM, --signal's warning, a preemption within its GraceTime", RUNNING, "RUNNING", "signalled",
     True),
    ("without accounting, a cancel and a CANCEL-mode preemption alike",
     "JobId=42 JobState=COMPLETING Reason=None Requeue=1 Restarts=0 BatchFlag=1", None, "cancelled", False),
]


@pytest.mark.parametrize("what, scontrol, sacct, cause, requeues", SEEN, ids=[s[0] for s in SEEN])
def test_each_stop_slurm_shows_is_read_as_its_cause_and_only_a_cancel_or_slurms_own_requeue_is_not_requeued(
        tmp_path, monkeypatch, what, scontrol, sacct, cause, requeues):
    fake_slurm(tmp_path, scontrol, sacct)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    stop = SlurmJob("42", restart=0).stop()
    assert (stop.cause, stop.wants_requeue) == (cause, requeues), stop.why


def test_the_command_requeues_only_where_the_stop_wants_it_and_says_why_not(tmp_path, monkeypatch, capsys):
    from sft.commands.train import requeue_slurm_job

    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    for name, scontrol, sacct, cause, requeues in SEEN:
        fake_slurm(tmp_path, scontrol, sacct)
        (tmp_path / "requeued").unlink(missing_ok=True)
        requeue_slurm_job("outputs/slurm-42")
        said = capsys.readouterr().err
        assert (tmp_path / "requeued").is_file() == requeues, (name, said)
        if cause == "cancelled":
            assert "not requeued; the run stays stopped at its checkpoint in outputs/slurm-42 (to go on: sbatch it " \
                   "again with hydra.run.dir=outputs/slurm-42 resume=auto)" in said
        elif cause == "requeued":
            assert "SLURM requeues it itself" in said and "attempt 2 continues this run" in said
        else:
            assert said.startswith("SLURM job 42 (") and "): requeued; attempt 2 continues" in said
