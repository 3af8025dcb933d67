"""The loss zoo (`+experiment=loss_zoo`): every built-in loss runs in one sweep and the report compares them."""

import json
import math

import pytest
from conftest import REPO, run_train, write_jsonl


@pytest.mark.slow
def test_every_built_in_loss_runs_in_one_sweep_and_the_report_compares_them(tmp_path):
    import csv

    evaluation = write_jsonl(tmp_path / "eval.jsonl", [json.loads(line) for line in
                                                        (REPO / "sft/sample_data/validation.jsonl").open()][:48])
    losses = ["ce", "hard_sample", "keywords", "focal", "dft", "length"]
    proc = run_train("-m", f"loss={','.join(losses)}", f"data.eval_file={evaluation}", "trainer.max_steps=2",
                     "trainer.eval_steps=100", "trainer.save_steps=100", "trainer.report_to=[]",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        settings = {row["loss"]: row for row in csv.DictReader(f)}
    assert sorted(settings) == sorted(losses) and settings["ce"]["baseline"] == "True"
    buckets = [k for k in settings["ce"] if k.startswith("eval_loss_bucket_") and k[-1].isdigit()]
    assert len(buckets) == 4
    for name, row in settings.items():  # each compared with ce on eval_ce and every difficulty bucket
        assert all(math.isfinite(float(row[k])) for k in ["eval_ce", *buckets])
        assert name == "ce" or all(math.isfinite(float(row[f"diff_{k}"])) for k in ["eval_ce", *buckets])
