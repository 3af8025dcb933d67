"""`results.json` has one schema (`sft.experiments.results`): what the trainer writes, the fields its controllers
add, a failed job's record, and what `sft.experiments.report` reads."""

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


def test_a_controllers_own_fields_are_written_and_read_back_and_the_runs_own_fields_are_not_its(tmp_path):
    results = RunResults(eval_loss=0.5, eval_loss_buckets={"0": 0.3})
    results.add_controller_results("early_stopping", {"stopped_early": True})
    results.add_controller_results("stop_at_loss", {"reached_target_at": 12, "targets": {"loss": 2.0}})
    results.write(tmp_path)
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["stopped_early"] is True and written["reached_target_at"] == 12
    assert written["targets"] == {"loss": 2.0} and written["eval_loss_bucket_0"] == 0.3
    again = RunResults.read(tmp_path)
    assert again.extra == {"reached_target_at": 12, "targets": {"loss": 2.0}} and again.to_json() == written
    for key in ("eval_loss", "status", "eval_loss_bucket_3", "eval_ce_task_math"):
        with pytest.raises(ValueError, match=f"controllers.mine: results\\(\\) gives '{key}', a field the run"):
            results.add_controller_results("mine", {key: 1.0})
    with pytest.raises(ValueError, match="which another controller gives too"):
        results.add_controller_results("other", {"reached_target_at": 3})
    with pytest.raises(ValueError, match="not a JSON value"):
        results.add_controller_results("odd", {"when": object()})
