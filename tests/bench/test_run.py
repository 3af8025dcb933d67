"""`python -m sft.bench` runs every case end to end (tiny sizes) and writes bench.json with every key."""

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO

TRAINING = ("raw", "hf", "ce_naive", "ce", "ce_bf16", "ce_bf16_pure", "ce_lora", "ce_lora_naive", "hard_sample", "packing", "ce_spread", "packing_spread",
            "trl", "trl_padding_free", "trl_padding_free_mask")


@pytest.mark.slow
def test_bench_runs_every_case_and_writes_all_ratios(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sft.bench", "--out", str(out), "bench.steps=4", "bench.warmup_steps=1",
         "bench.repeats=1", "bench.loss_vocab=3000", "bench.loss_hidden=32", "bench.loss_batch=2",
         "bench.loss_seq=64", "loss.chunk_tokens=16", "bench.preprocess_rows=300", "bench.tokenize_rows=40",
         "bench.scale_rows=300", "bench.scale_processes=[1]", "bench.startup_repeats=1", "bench.min_cpu_share=0", "bench.isolate=false",
         "bench.batch_sizes=[8]", "bench.eval_repeats=1"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["skipped"], report["skipped"]  # (this machine has TRL and a CPU with bf16 instructions)
    assert set(report["ratios"]) == {"sft_vs_raw", "overhead_vs_hf", "lean_loss_gain", "lean_loss_gain_memory",
                                     "hard_sample_vs_ce", "packing_gain", "packing_gain_spread", "bf16_vs_fp32",
                                     "bf16_mixed_vs_fp32", "pure_vs_mixed",
                                     "lora_vs_full", "lean_loss_gain_lora", "lean_loss_gain_lora_memory",
                                     "ce_vs_trl", "ce_vs_trl_memory", "packing_vs_trl_padding_free",
                                     "packing_vs_trl_padding_free_memory", "varlen_vs_mask_kernel",
                                     "varlen_vs_mask_kernel_memory", "eval_vs_hf_time", "lean_vs_naive_loss_memory",
                                     "lean_vs_naive_loss_time", "preprocess_cached_speedup", "tokenize_vs_baseline",
                                     "tokenize_vs_tokenizer", "tokenize_vs_encode", "scale_rows_per_second_1p", "scale_peak_rss_gb", "scale_cached_load_s",
                                     "startup_cfg_job_s", "startup_help_s", "startup_help_group_s",
                                     "startup_first_step_s", *(f"hw_{kind}_{case}" for case in TRAINING
                                                               for kind in ("exec", "model"))}
    assert all(v > 0 for v in report["ratios"].values())
    for case in TRAINING:
        run = report["raw"][case][0]
        assert run["tokens_per_second"] > 0 and run["peak_memory_gb"] > 0 and run["timed_steps"] == 3
        assert run["cpu_seconds"] > 0 and 0 < run["cpu_share"] and run["threads"] >= 1
    assert len({run[0]["threads"] for run in report["raw"].values() if "threads" in run[0]}) == 1  # pinned alike
    # A ratio is the median of the per-round ratios of the two cases (one round here), with their spread.
    raw, cases = report["raw"], report["cases"]
    expected = raw["ce_naive"][0]["tokens_per_second"] / raw["raw"][0]["tokens_per_second"]
    assert report["ratios"]["sft_vs_raw"] == expected and report["spread"]["sft_vs_raw"] == [expected, expected]
    # The hardware ratios: a case's executed and model FLOP/s over the matmul rate of the dtype it trains in.
    assert report["ratios"]["hw_exec_ce"] == (raw["ce"][0]["exec_gflops"] / raw["matmul"][0]["gflops"])
    assert report["ratios"]["hw_model_ce_bf16"] == (raw["ce_bf16"][0]["model_gflops"] / raw["matmul_bf16"][0]["gflops"])
    assert raw["ce_bf16"][0]["dtype"] == raw["matmul_bf16"][0]["dtype"] == "bfloat16"
    # the lean loss projects only the trained positions: fewer FLOPs executed than the naive loss's for a token
    assert (raw["ce"][0]["exec_gflops"] / raw["ce"][0]["tokens_per_second"]
            < raw["ce_naive"][0]["exec_gflops"] / raw["ce_naive"][0]["tokens_per_second"])
    assert report["ratios"]["packing_vs_trl_padding_free"] == (cases["packing"]["tokens_per_second"]
                                                               / cases["trl_padding_free"]["tokens_per_second"])
    assert [(r["round"], r["attempt"], r["loaded"]) for r in report["rounds"]] == [(1, 1, False)]
    assert raw["loss_lean"][0]["impl"] == "chunked" and raw["loss_naive"][0]["impl"] == "naive"
    assert cases["preprocess"]["rows"] == 300 and cases["scale"]["rows"] == 300
    assert cases["tokenize"]["rows"] == 40 and cases["tokenize"]["baseline_renders_per_row"] == 5  # 2 answers
    assert cases["tokenize"]["sft_renders_per_row"] == 4
    # against the tokenizer's own chat path, through the same datasets.map: the ratio is sft's rows/s over its
    tokenize = cases["tokenize"]
    assert report["ratios"]["tokenize_vs_tokenizer"] == tokenize["round_ratios"]["vs_chat"][0] == pytest.approx(
        tokenize["sft_rows_per_second"] / tokenize["chat_rows_per_second"])
    assert cases["eval_sft"]["rows"] == cases["eval_hf"]["rows"] == 400  # the bundled validation set
    for ratio, target in [("tokenize_vs_tokenizer", "target >= 0.9"), ("sft_vs_raw", "target >= 0.95"),
                          ("packing_vs_trl_padding_free", "target >= 1.3"), ("ce_vs_trl", "target >= 1.0")]:
        assert any(line.startswith(ratio) and target in line for line in proc.stdout.splitlines()), ratio
    assert "bench.isolate=false: the cases shared one process" in proc.stdout
    assert "round 1 (attempt 1): load average" in proc.stdout  # (a fresh process per case: the preprocess cases)


@pytest.mark.slow  # two short training cases and a cache (about 40 s)
def test_the_cached_teacher_case_writes_its_cache_first_and_is_compared_with_the_live_teacher(tmp_path):
    """`distill_cached` (on request) writes its teacher's logits before its timed steps and trains from them: both
    distillation cases run, and the ratio compares them (`tests/model/test_teacher_cache.py` proves the cache equal to
    the live teacher)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sft.bench", "--out", str(out), "bench.cases=[distill,distill_cached]", "bench.steps=3",
         "bench.warmup_steps=1", "bench.repeats=1", "bench.min_cpu_share=0", "bench.isolate=false",
         "bench.batch_sizes=[8]"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["failed"] and set(report["ratios"]) == {"cached_vs_live_teacher", "cached_vs_live_teacher_memory"}
    assert all(math.isfinite(loss) for case in ("distill", "distill_cached")
               for loss in report["raw"][case][0]["losses"])
    assert report["ratios"]["cached_vs_live_teacher"] > 0


def test_a_loaded_round_is_run_again_and_flagged_if_it_stays_loaded(monkeypatch):
    from omegaconf import OmegaConf

    import sft.bench.run

    shares = iter([0.5, 0.95, 0.4, 0.3])  # round 1 loaded then quiet; round 2 loaded twice (reruns=1)
    monkeypatch.setattr(sft.bench.run, "spawn", lambda case, cfg: {"tokens_per_second": 1.0, "cpu_share": next(shares)})
    b = OmegaConf.create({"repeats": 2, "reruns": 1, "min_cpu_share": 0.8})
    report = {"rounds": []}
    rounds = sft.bench.run.run_rounds({"ce": ("ce", None)}, b, report)
    assert [r["ce"]["cpu_share"] for r in rounds] == [0.95, 0.3]
    assert [(r["round"], r["attempt"], r["loaded"]) for r in report["rounds"]] == [(1, 2, False), (2, 2, True)]


def test_every_other_round_runs_the_cases_in_reverse_order(monkeypatch):
    """A machine that slows down over a round must not favour the case that runs first."""
    from omegaconf import OmegaConf

    import sft.bench.run

    order = []
    monkeypatch.setattr(sft.bench.run, "spawn", lambda case, cfg: order.append(case) or {"tokens_per_second": 1.0})
    b = OmegaConf.create({"repeats": 3, "reruns": 0, "min_cpu_share": 0.8})
    sft.bench.run.run_rounds({"raw": ("raw", None), "ce": ("ce", None)}, b, {"rounds": []})
    assert order == ["raw", "ce", "ce", "raw", "raw", "ce"]


def test_ratios_at_each_batch_size_are_named_by_it_and_keep_their_targets():
    from sft.bench.cases import CASES, target_of
    from sft.bench.report import case_id, pair_ratios

    assert [case_id("ce", size, 64) for size in (64, 16)] == ["ce", "ce_b16"]
    rounds = [{f"{case}_b16": {"tokens_per_second": tps * k, "peak_memory_gb": mem}
               for case, tps, mem in [("hf", 100, 1.0), ("ce_naive", 110, 1.0), ("ce", 120, 1.0), ("trl", 80, 2.0)]}
              for k in (1.0, 0.5)]  # a loaded round halves every case: its ratios stay
    rounds[1]["ce_b16"]["tokens_per_second"] = 50  # ... but one case more than the others
    ratios = {}
    for case in ("hf", "ce_naive", "ce", "trl"):
        ratios.update(pair_ratios(CASES[case], rounds, ["_b16"]))
    assert ratios == {"overhead_vs_hf_b16": [1.1, 1.1], "lean_loss_gain_b16": [120 / 110, 50 / 55],
                      "lean_loss_gain_memory_b16": [1.0, 1.0], "ce_vs_trl_b16": [1.5, 1.25], "ce_vs_trl_memory_b16": [0.5, 0.5]}
    assert target_of("ce_vs_trl_b16") == target_of("ce_vs_trl") == (1.0, "min")
    assert target_of("ce_vs_trl_memory_b16") is None


def test_trl_cases_are_skipped_with_one_line_when_trl_is_missing(monkeypatch, capsys):
    import sft.bench.device
    import sft.bench.run

    monkeypatch.setattr(sft.bench.device, "trl_missing", lambda: "trl is not installed (pip install -e '.[bench]')")
    report = sft.bench.run.run_all(["bench.cases=[trl,trl_padding_free,trl_padding_free_mask]"])  # nothing spawned
    assert report["raw"] == {} and report["ratios"] == {}
    assert set(report["skipped"]) == {"trl", "trl_padding_free", "trl_padding_free_mask"}
    assert "skipping trl, trl_padding_free, trl_padding_free_mask: trl is not installed" in capsys.readouterr().err


@pytest.mark.slow
def test_long_rows_train_one_row_of_each_length_with_the_same_losses_in_every_variant(tmp_path):
    # Checkpointing and tiling change where the activations live, never the losses; each length is one row a step.
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sft.bench", "--out", str(out), "bench.cases=[long_rows]", "bench.long_row_lengths=[96,400]",
         "bench.long_row_steps=1", "bench.long_row_tile_tokens=64", "bench.isolate=false",
         "bench.long_row_variants=[plain,checkpointed,tiled,offloaded]"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    long_rows = json.loads(out.read_text())["cases"]["long_rows"]
    assert list(long_rows) == ["plain", "checkpointed", "tiled"]  # offloaded: on a GPU only
    for length in ("96", "400"):
        runs = [long_rows[variant][length] for variant in long_rows]
        assert all(run["row_tokens"] == int(length) and run["bytes_per_token"] >= 0 for run in runs)
        assert len(runs[0]["losses"]) == 2
        for run in runs[1:]:
            assert run["losses"] == pytest.approx(runs[0]["losses"], abs=1e-5)
    assert long_rows["plain"]["96"]["losses"] != long_rows["plain"]["400"]["losses"]
    assert "KiB/token" in proc.stdout


@pytest.mark.slow  # the command in a process of its own
@pytest.mark.parametrize("override, message", [
    ("bench.stepz=3", "error: config: bench.stepz: not a knob of bench (did you mean bench.steps?)"),
    ("model.random_init={model_type:qwen2}", "error: config: model.random_init.model_type: a new key of "
                                             "model.random_init (a free-form dict): add it with +"),
])
def test_a_bad_override_is_one_line_and_exit_code_2(override, message):
    proc = subprocess.run([sys.executable, "-m", "sft.bench", override], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(message) and len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("overrides", [[], ["model=qwen2_5_7b_random", "model.random_init.num_hidden_layers=2"]])
def test_the_matmul_case_times_the_models_own_linear_layers(overrides):
    """The products `matmul` times are those of the model's linear layers (its output layer included), as many."""
    from collections import Counter

    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft.bench.config import compose
    from sft.bench.matmul import model_matmul_shapes

    cfg = compose(overrides + ["model.dtype=float32"])
    if cfg.model.random_init:  # Qwen2.5-7B's shape: built on the meta device, its layers without weights
        with torch.device("meta"):
            config = AutoConfig.for_model(**OmegaConf.to_container(cfg.model.random_init))
            model = AutoModelForCausalLM.from_config(config)
    else:
        model = instantiate(cfg.model)
    linear = Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model_matmul_shapes(cfg) == dict(linear)


def test_each_cases_hardware_ratios_are_over_the_best_matmul_reading_of_its_dtype(monkeypatch):
    """The limit moves between rounds: each ratio is held to the best reading of the run, the spread reported."""
    import sft.bench.run

    ce = {"tokens_per_second": 10.0, "dtype": "float32"}
    rounds = iter([{**ce, "exec_gflops": 20.0, "model_gflops": 30.0}, {"gflops": 50.0, "dtype": "float32"},
                   {"gflops": 40.0, "dtype": "float32"}, {**ce, "exec_gflops": 18.0, "model_gflops": 27.0},  # reversed
                   {**ce, "exec_gflops": 22.0, "model_gflops": 33.0}, {"gflops": 100.0, "dtype": "float32"}])
    monkeypatch.setattr(sft.bench.run, "spawn", lambda case, cfg: next(rounds))
    report = sft.bench.run.run_all(["bench.cases=[ce,matmul]", "bench.batch_sizes=[8]", "bench.repeats=3",
                                    "bench.min_cpu_share=0"])
    assert report["spread"]["hw_exec_ce"] == [0.18, 0.22]
    assert report["ratios"]["hw_exec_ce"] == report["cases"]["ce"]["hw_exec"] == 0.2
    assert report["ratios"]["hw_model_ce"] == report["cases"]["ce"]["hw_model"] == 0.3
    assert report["cases"]["matmul"]["gflops_best"] == 100.0 and report["cases"]["matmul"]["gflops_spread"] == [40, 100]


def test_the_flex_attention_case_is_skipped_with_one_line_without_a_gpu(monkeypatch, capsys):
    import sft.bench.device
    import sft.bench.run

    monkeypatch.setattr(sft.bench.device, "gpu_missing", lambda: "needs a CUDA GPU (FlexAttention has no backward on a CPU)")
    report = sft.bench.run.run_all(["bench.cases=[packing_flex]"])  # nothing spawned
    assert report["raw"] == {} and report["skipped"] == {
        "packing_flex": "needs a CUDA GPU (FlexAttention has no backward on a CPU)"}
    assert "skipping packing_flex: needs a CUDA GPU" in capsys.readouterr().err


def test_a_case_that_fails_is_reported_failed_and_the_others_figures_stand(monkeypatch, capsys):
    """A GPU pack whose compiled case breaks keeps its other figures: the case is left out of every round."""
    import sft.bench.run

    def spawn(case, cfg):
        if case == "packing_compiled" and spawn.calls:  # its second round fails: its first is dropped too
            raise RuntimeError("bench case packing_compiled failed (exit 1):\ninductor: no C++ compiler")
        spawn.calls += case == "packing_compiled"
        return {"tokens_per_second": 100.0 if case == "packing" else 90.0, "peak_memory_gb": 1.0}

    spawn.calls = 0
    monkeypatch.setattr(sft.bench.run, "spawn", spawn)
    report = sft.bench.run.run_all(["bench.cases=[packing,packing_compiled,ce]", "bench.batch_sizes=[8]",
                                    "bench.repeats=2", "bench.min_cpu_share=0"])
    assert report["failed"] == {"packing_compiled": "bench case packing_compiled failed (exit 1):\n"
                                                    "inductor: no C++ compiler"}
    assert set(report["cases"]) == {"packing", "ce"} and report["ratios"]["packing_gain"] == pytest.approx(100 / 90)
    assert "compile_layers_gain" not in report["ratios"]
    sft.bench.run.print_report(report)
    assert "packing_compiled      failed: inductor: no C++ compiler" in capsys.readouterr().out


def test_the_liger_case_is_skipped_with_one_line_on_a_cpu(capsys):
    import torch

    import sft.bench.run

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    report = sft.bench.run.run_all(["bench.cases=[packing_liger]"])  # nothing spawned
    assert report["raw"] == {} and report["skipped"] == {"packing_liger": "needs a CUDA GPU (Liger's kernels are "
                                                                           "Triton's)"}
    assert "skipping packing_liger: needs a CUDA GPU" in capsys.readouterr().err


def test_the_flash_attention_case_is_skipped_with_one_line_without_flash_attn(capsys, monkeypatch):
    import importlib.util

    import sft.bench.device
    import sft.bench.run

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(sft.bench.device, "gpu_missing", lambda: None)  # as on a GPU machine without flash-attn
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else find_spec(name, *a))
    report = sft.bench.run.run_all(["bench.cases=[packing_flash]"])  # nothing spawned
    reason = "needs flash-attn (pip install flash-attn --no-build-isolation: built for the machine's CUDA)"
    assert report["raw"] == {} and report["skipped"] == {"packing_flash": reason}
    assert f"skipping packing_flash: {reason}" in capsys.readouterr().err
