"""A refusal inside the ranks said once: what each rank records and which one the launcher prints."""

import json
import os
import time

from sft.training.processes import rank_errors


def record(monkeypatch, folder, rank, message, code=2):
    monkeypatch.setenv(rank_errors.ERRORS_ENV, str(folder))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    rank_errors.report(message, code)


def test_a_rank_under_the_launcher_records_its_error_instead_of_printing_it(tmp_path, monkeypatch, capsys):
    record(monkeypatch, tmp_path, 1, "config: sp.size=2: splits the attention heads")
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "rank-1.json").read_text()) == {
        "rank": 1, "code": 2, "message": "config: sp.size=2: splits the attention heads"}
    assert not list(tmp_path.glob("*.partial"))


def test_rank_0s_error_is_printed_else_the_first_recorded(tmp_path, monkeypatch):
    record(monkeypatch, tmp_path, 3, "data: rank 3's shard")
    os.utime(tmp_path / "rank-3.json", ns=(time.time_ns() - 10**9,) * 2)  # recorded first
    record(monkeypatch, tmp_path, 2, "data: rank 2's shard")
    assert rank_errors.first_error(tmp_path)["message"] == "data: rank 3's shard"
    record(monkeypatch, tmp_path, 0, "config: rank 0's words", code=1)
    assert rank_errors.first_error(tmp_path) == {"rank": 0, "code": 1, "message": "config: rank 0's words"}


def test_without_a_launcher_or_with_one_process_the_rank_prints_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(rank_errors.ERRORS_ENV, raising=False)
    rank_errors.report("config: x", 2)
    record(monkeypatch, tmp_path, 0, "config: y")
    monkeypatch.setenv("WORLD_SIZE", "1")
    rank_errors.report("config: z", 2)
    assert capsys.readouterr().err == "error: config: x\nerror: config: z\n"
    assert rank_errors.first_error(tmp_path / "none") is None
