"""`results.json` has one schema: what the trainer writes, a failed job's record and what sft.experiments.report reads."""

import json

import pytest

from sft.experiments.report import job_row
from sft.experiments.results import RunResults


def test_a_finished_run_round_trips_with_its_buckets_as_flat_keys(tmp_path):
    results = RunResults(eval_loss=0.5, eval_ce=0.4, eval_loss_buckets={"1": 0.2, "10": 0.9, "2": 0.3},
                         global_step=12, stopped_early=True, eval_history=[{"step": 0, "eval_loss": 1.0}])
    results.write(tmp_path)
    written = json.loads((tmp_path / "results.json").read_text())
    assert [k for k in written if k.startswith("eval_loss_bucket_")] == [
        "eval_loss_bucket_1", "eval_loss_bucket_2", "eval_loss_bucket_10"]
    assert written["status"] == "ok" and "error" not in written and written["stopped_early"] is True
    assert RunResults.read(tmp_path) == results


def test_a_failed_run_keeps_the_errors_first_line_and_nothing_else(tmp_path):
    RunResults.failed(ValueError("bad value\nmore detail"), 3.14159).write(tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == {
        "status": "failed", "error": "ValueError: bad value", "wall_time_s": 3.1}


def test_the_report_reads_ok_failed_and_missing_results(tmp_path):
    for job, results in (("0", RunResults(eval_loss=0.5, eval_history=[{"step": 5, "eval_loss": 0.4}])),
                         ("1", RunResults.failed("boom", 1.0)), ("2", None)):
        (tmp_path / job).mkdir()
        if results:
            results.write(tmp_path / job)
    rows = [job_row(tmp_path / j) for j in "012"]
    assert [r["status"] for r in rows] == ["ok", "failed", "interrupted"]
    assert rows[0]["best_eval_loss"] == 0.4 and rows[1]["error"] == "boom"


def test_a_controller_reporting_an_unknown_field_is_an_error():
    with pytest.raises(TypeError, match="stoped_early"):
        RunResults(**{"stoped_early": True})
