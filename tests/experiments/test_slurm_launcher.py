"""The wait of a sweep whose jobs are SLURM jobs (`sft.experiments.slurm_launcher.wait_for`), against stand-ins of
squeue and scancel that print what the test cluster's printed (the real sweep: tests/e2e/test_slurm.py): a job SLURM
queued for a wait no wait ends cancels the sweep's jobs in one line, and so does a signal to the sweep."""

import os
import signal
import stat
import threading

import pytest

from sft.experiments import slurm_launcher
from sft.experiments.slurm_launcher import never_starting, wait_for
from sft.training.processes.slurm import SlurmRefused, SweepStopped


class Job:
    def __init__(self, job_id: str):
        self.job_id = job_id

    def done(self) -> bool:
        return False


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """squeue printing `tmp_path/squeue.out`; scancel noting its arguments in `tmp_path/cancelled`."""
    for name, text in (("squeue", f"cat {tmp_path}/squeue.out"), ("scancel", f'echo "$@" >> {tmp_path}/cancelled')):
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\n{text}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(slurm_launcher, "POLL_S", 0.05)
    return tmp_path


def test_a_job_pending_for_a_reason_no_wait_ends_cancels_the_sweeps_jobs_in_one_line(slurm):
    # sbatch --cpus-per-task=8 on nodes of 2 CPUs, as the test cluster's squeue -h -r -o "%i|%T|%r" showed it
    (slurm / "squeue.out").write_text("14_0|PENDING|PartitionConfig\n14_1|PENDING|PartitionConfig\n")
    with pytest.raises(SlurmRefused) as refused:
        wait_for([Job("14_0"), Job("14_1")])
    assert str(refused.value) == ("SLURM queued the sweep's jobs but will never start job 14_0 (PENDING "
                                  "PartitionConfig: asks more CPUs, memory or GPUs than the partition's nodes have); "
                                  "the sweep's 2 job(s) cancelled")
    assert (slurm / "cancelled").read_text().split() == ["14_0", "14_1"]


def test_jobs_waiting_for_resources_are_waited_for(slurm):
    (slurm / "squeue.out").write_text("14_0|PENDING|Resources\n14_1|PENDING|Priority\n15_0|PENDING|PartitionConfig\n")
    assert never_starting(["14_0", "14_1"]) is None  # 15_0 is not the sweep's


def test_a_signal_to_the_sweep_cancels_its_jobs_and_says_how_to_go_on(slurm):
    (slurm / "squeue.out").write_text("14_0|RUNNING|None\n14_1|PENDING|Resources\n")
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(SweepStopped) as stopped:
        wait_for([Job("14_0"), Job("14_1")])
    assert str(stopped.value).startswith("SIGTERM to the sweep: its 2 SLURM job(s) cancelled (14_0, 14_1)")
    assert "sweep.resume=true goes on" in str(stopped.value)
    assert (slurm / "cancelled").read_text().split() == ["14_0", "14_1"]
    assert signal.getsignal(signal.SIGTERM) is before  # the sweep's own handler back
