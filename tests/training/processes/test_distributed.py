"""Process-group details (`sft.training.processes.distributed`): CPU threads shared out among the processes, one run dir
decided by rank 0, the allocator and OpenMP's spinning on a CPU, the exit of a finished run."""

import sys

import pytest

from conftest import free_port


def test_cpu_threads_share_the_cores_and_respect_the_users_setting():
    from sft.training.processes.distributed import cpu_threads

    assert cpu_threads(16, 2, "1") == 8  # the 1 torchrun sets for a multi-process launch is replaced
    assert cpu_threads(16, 2, None) == 8 and cpu_threads(2, 4, None) == 1
    assert cpu_threads(16, 2, "4") is None  # the user's own setting stands
    assert cpu_threads(16, 1, "1") is None and cpu_threads(2, 1, None) is None  # one process: torch's choice


@pytest.mark.parametrize("users", [None, "infinite"])
def test_openmp_threads_spin_briefly_set_before_torch_loads_unless_the_user_chose(users):
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: `import sft` must set it without importing torch."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | ({"GOMP_SPINCOUNT": users} if users else {})
    script = "import os, sys, sft; print('torch' in sys.modules, os.environ['GOMP_SPINCOUNT'])"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", users or "1000"]


def test_rank_0_decides_the_run_dir_for_every_rank(monkeypatch):
    """share_run_dir through a real store: rank 1 gets rank 0's dir even when its own clock says otherwise."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    import sft.training.processes.distributed as distributed

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))  # the launcher's store
    base = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
    monkeypatch.setattr(sys, "argv", ["sft.train"])
    seen = {}
    for rank, clock in (("0", "outputs/2026-01-01/10-00-00"), ("1", "outputs/2026-01-01/10-00-01")):
        for k, v in {**base, "RANK": rank}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("SFT_RUN_DIR", raising=False)
        monkeypatch.setattr(distributed.time, "strftime", lambda fmt, clock=clock: clock)
        distributed.share_run_dir()
        seen[rank] = __import__("os").environ["SFT_RUN_DIR"]
    assert seen == {"0": "outputs/2026-01-01/10-00-00", "1": "outputs/2026-01-01/10-00-00"}
    del server


EXIT_SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from sft.training.processes.distributed import exit_without_teardown

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))


class TornDown:  # a module global: the interpreter's teardown finalises it, the fast exit does not
    def __del__(self):
        (out / "teardown").write_text("ran")


held = TornDown()
if sys.argv[2] == "thread":  # a non-daemon thread still at work: the interpreter's own exit must wait for it
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
print("buffered, not yet flushed", end="")
exit_without_teardown()
"""


def test_a_finished_run_exits_without_teardown_yet_loses_nothing(tmp_path):
    """The fast exit skips the interpreter's teardown yet still runs the atexit handlers (logging's close among them)
    and flushes the streams; with a non-daemon thread alive it leaves the exit to the interpreter, which waits for
    the thread (and tears down)."""
    import subprocess

    for mode in ("plain", "thread"):
        out = tmp_path / mode
        out.mkdir()
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(out), mode], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "buffered, not yet flushed"
        assert (out / "atexit").read_text() == "ran"
        assert (out / "thread").exists() == (mode == "thread")
        assert (out / "teardown").exists() == (mode == "thread")


ALLOC_SCRIPT = """
import resource, sys
from sft.training.processes.distributed import reuse_freed_memory

if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(8):  # a training step's tensors on a CPU: blocks of 256 KiB to 8 MiB, all freed at its end
    blocks = [bytearray((k % 32 + 1) << 18) for k in range(64)]
    del blocks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_reusing_freed_memory_spares_the_page_faults_of_every_step():
    """glibc by default gives a step's freed blocks back to the system and faults them in again at the next step."""
    import subprocess

    faults = {mode: int(subprocess.run([sys.executable, "-c", ALLOC_SCRIPT, mode], capture_output=True, text=True,
                                       check=True, timeout=60).stdout) for mode in ("default", "reuse")}
    assert faults["reuse"] * 5 < faults["default"], faults
