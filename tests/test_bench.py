"""`python -m sft.bench` runs every case end to end (tiny sizes) and writes bench.json with every key."""

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_bench_runs_every_case_and_writes_all_ratios(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sft.bench", "--out", str(out), "bench.steps=4", "bench.warmup_steps=1",
         "bench.repeats=1", "bench.loss_vocab=3000", "bench.loss_hidden=32", "bench.loss_batch=2",
         "bench.loss_seq=64", "loss.chunk_tokens=16", "bench.preprocess_rows=300",
         "trainer.per_device_train_batch_size=8"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"ce_vs_hf", "hard_sample_vs_hf", "packing_vs_hf",
                                     "chunked_vs_naive_loss_memory", "chunked_vs_naive_loss_time",
                                     "preprocess_cached_speedup", "startup_cfg_job_s", "startup_help_s",
                                     "startup_first_step_s"}
    assert all(v > 0 for v in report["ratios"].values())
    for case in ("hf", "ce", "hard_sample", "packing"):
        run = report["raw"][case][0]
        assert run["tokens_per_second"] > 0 and run["peak_memory_gb"] > 0 and run["timed_steps"] == 3
    # The ratios are the medians' ratios, as printed.
    cases = report["cases"]
    assert report["ratios"]["packing_vs_hf"] == cases["packing"]["tokens_per_second"] / cases["hf"]["tokens_per_second"]
    assert cases["preprocess"]["rows"] == 300
    assert "packing_vs_hf" in proc.stdout and "target >= 1.3" in proc.stdout
