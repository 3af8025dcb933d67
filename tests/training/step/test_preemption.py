"""Preemption's signal handler stays in the run's own process: forked children die as their parent expects."""

import subprocess
import sys
import textwrap

import pytest

# A pool stopped while its workers are busy: `Pool.__exit__` sends each worker SIGTERM and joins it. lm-eval's
# bootstrap runs such a pool inside the run after training (the CI hang of an FSDP run with eval_harness).
POOL_EXITED_WHILE_BUSY = textwrap.dedent("""
    import multiprocessing as mp, time
    from sft.training.step.preemption import Preemption
    preemption = Preemption(grace_s=60)
    preemption.training_done = True
    preemption.install()
    with mp.get_context("fork").Pool(2) as pool:
        pending = [pool.apply_async(time.sleep, (2,)) for _ in range(2)]
        time.sleep(0.3)
    print("signal noted by the run:", preemption.signal)
""")


def test_a_forked_pool_stopped_with_sigterm_exits_and_the_run_notes_no_signal():
    done = subprocess.run([sys.executable, "-c", POOL_EXITED_WHILE_BUSY], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert "signal noted by the run: None" in done.stdout
    assert "finishing the run" not in done.stderr  # no worker took the signal for the run's own


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler of its own for `sig` (/proc's SigCgt mask)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (sig - 1) & 1)


@pytest.mark.slow
def test_a_slurm_warning_while_the_stack_imports_stops_the_start_up_for_a_requeue_not_a_kill(tmp_path):
    """SLURM may send its `--signal` warning as a job starts (its time-limit pass runs every 30 s). Noted from the
    command's first line, it becomes the start-up stop (exit 75: requeued), not SIGUSR2's default action (killed:
    the job fails, as a CI run saw)."""
    import os
    import signal
    import time

    (tmp_path / "scontrol").write_text("#!/bin/sh\nexit 1\n")  # no cluster here: SLURM does not answer
    (tmp_path / "scontrol").chmod(0o755)
    env = {**os.environ, "SLURM_JOB_ID": "7", "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "sft.train", f"hydra.run.dir={tmp_path / 'run'}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not _catches(proc.pid, signal.SIGUSR2) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "torch" not in open(f"/proc/{proc.pid}/maps").read()  # still importing: the stack is not loaded yet
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "SIGUSR2 during start-up: nothing trained yet" in err and "SLURM job 7" in err
