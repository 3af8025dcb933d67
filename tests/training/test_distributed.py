"""Process-group details (`sft.training.distributed`): CPU threads shared out among the processes, one run dir decided
by rank 0."""

import sys

from conftest import free_port


def test_cpu_threads_share_the_cores_and_respect_the_users_setting():
    from sft.training.distributed import cpu_threads

    assert cpu_threads(16, 2, "1") == 8  # the 1 torchrun sets for a multi-process launch is replaced
    assert cpu_threads(16, 2, None) == 8 and cpu_threads(2, 4, None) == 1
    assert cpu_threads(16, 2, "4") is None  # the user's own setting stands
    assert cpu_threads(16, 1, "1") is None and cpu_threads(2, 1, None) is None  # one process: torch's choice


def test_rank_0_decides_the_run_dir_for_every_rank(monkeypatch):
    """share_run_dir through a real store: rank 1 gets rank 0's dir even when its own clock says otherwise."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    import sft.training.distributed as distributed

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
