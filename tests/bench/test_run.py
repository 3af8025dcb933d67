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
         "bench.loss_seq=64", "loss.chunk_tokens=16", "bench.preprocess_rows=300", "bench.tokenize_rows=40",
         "bench.scale_rows=300",
         "bench.batch_sizes=[8]", "bench.eval_repeats=1"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"ce_vs_hf", "hard_sample_vs_hf", "packing_vs_hf", "ce_vs_trl",
                                     "ce_vs_trl_memory", "packing_vs_trl_padding_free",
                                     "packing_vs_trl_padding_free_memory", "eval_vs_hf_time",
                                     "chunked_vs_naive_loss_memory", "chunked_vs_naive_loss_time",
                                     "preprocess_cached_speedup", "tokenize_vs_baseline",
                                     "tokenizer_alone_vs_baseline", "scale_peak_rss_gb", "scale_cached_load_s",
                                     "startup_cfg_job_s", "startup_help_s", "startup_help_group_s",
                                     "startup_first_step_s"}
    assert all(v > 0 for v in report["ratios"].values())
    for case in ("hf", "ce", "hard_sample", "packing", "trl", "trl_padding_free"):
        run = report["raw"][case][0]
        assert run["tokens_per_second"] > 0 and run["peak_memory_gb"] > 0 and run["timed_steps"] == 3
    # The ratios are the medians' ratios, as printed.
    cases = report["cases"]
    assert report["ratios"]["packing_vs_hf"] == cases["packing"]["tokens_per_second"] / cases["hf"]["tokens_per_second"]
    assert cases["preprocess"]["rows"] == 300 and cases["scale"]["rows"] == 300
    assert cases["tokenize"]["rows"] == 40 and cases["tokenize"]["baseline_renders_per_row"] == 5  # 2 answers
    assert cases["tokenize"]["sft_renders_per_row"] == 4
    assert "tokenize_vs_baseline" in proc.stdout and "target >= 3.0" in proc.stdout
    assert cases["eval_sft"]["rows"] == cases["eval_hf"]["rows"] == 400  # the bundled validation set
    assert report["ratios"]["ce_vs_trl"] == cases["ce"]["tokens_per_second"] / cases["trl"]["tokens_per_second"]
    assert "packing_vs_hf" in proc.stdout and "target >= 1.3" in proc.stdout
    assert "ce_vs_trl" in proc.stdout and "target >= 1.05" in proc.stdout


def test_ratios_at_each_batch_size_are_named_by_it_and_keep_their_targets():
    from sft.bench.run import case_id, target_of, training_ratios

    assert [case_id("ce", size, 64) for size in (64, 16)] == ["ce", "ce_b16"]
    cases = {f"{case}_b16": {"tokens_per_second": tps, "peak_memory_gb": mem}
             for case, tps, mem in [("hf", 100, 1.0), ("ce", 110, 1.0), ("trl", 88, 2.0)]}
    ratios = training_ratios(cases, "_b16")
    assert ratios == {"ce_vs_hf_b16": 1.1, "ce_vs_trl_b16": 1.25, "ce_vs_trl_memory_b16": 0.5}
    assert target_of("ce_vs_trl_b16") == target_of("ce_vs_trl") == (1.05, "min")
    assert target_of("ce_vs_trl_memory_b16") is None


def test_trl_cases_are_skipped_with_one_line_when_trl_is_missing(monkeypatch, capsys):
    import sft.bench.run

    monkeypatch.setattr(sft.bench.run, "trl_missing", lambda: "trl is not installed (pip install -e '.[bench]')")
    report = sft.bench.run.run_all(["bench.cases=[trl,trl_padding_free]"])  # nothing else: nothing is spawned
    assert report["raw"] == {} and report["ratios"] == {}
    assert set(report["skipped"]) == {"trl", "trl_padding_free"}
    assert "skipping trl, trl_padding_free: trl is not installed" in capsys.readouterr().err
