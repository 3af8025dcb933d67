"""Which process this is (`sft.ranks`), from the launcher's `RANK` before any process group exists."""

from sft.ranks import is_rank_zero, rank


def test_the_rank_is_the_launchers_and_zero_without_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert rank() == 0 and is_rank_zero()
    monkeypatch.setenv("RANK", "3")
    assert rank() == 3 and not is_rank_zero()


def test_the_first_process_of_a_machine_is_its_local_rank_zero(monkeypatch):
    from sft.ranks import is_local_rank_zero

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert is_local_rank_zero()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not is_local_rank_zero()
