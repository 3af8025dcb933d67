"""Preemption's signal handler stays in the run's own process: forked children die as their parent expects."""

import subprocess
import sys
import textwrap

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
