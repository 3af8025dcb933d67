"""The real pretrained model (`model=smollm2_135m`: SmolLM2-135M-Instruct from its GGUF file), where the tiny model can
only suggest: the conversion against the GGUF's own de-quantized tensors, sft's loss against the model's own on the
real weights and template (padded and packed, each kernel), the labels against the template's own rendering, a LoRA
run's adapter merged against PEFT's base + adapter, and the stop token a server reads. A few steps each: CI time."""

import json
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2, assert_dequantized, labelled_runs, run_train, sft_loss, write_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def sample_rows(n: int) -> list[dict]:
    """The first `n` rows of the bundled addition data that have a system turn or a follow-up, and plain ones."""
    lines = (REPO / "sft" / "sample_data" / "train.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:200]]
    special = [r for r in rows if r["messages"][0]["role"] == "system" or len(r["messages"]) > 3][: n // 2]
    return special + [r for r in rows if r not in special][: n - len(special)]


@pytest.fixture(scope="module")
def real(smollm2_dir):
    from sft.model.loading import load_tokenizer

    return smollm2_dir, load_tokenizer(*SMOLLM2[:1], gguf_file=SMOLLM2[1])


def test_the_converted_weights_are_the_gguf_files_own_tensors_dequantized_with_no_quantization_left(real):
    model_dir, _ = real
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert_dequantized(model_dir, SMOLLM2[1], [("model.embed_tokens.weight", "token_embd.weight"),
                                               ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                                               ("model.layers.29.self_attn.v_proj.weight", "blk.29.attn_v.weight")])


def test_the_labels_are_each_answer_and_its_stop_as_the_real_template_renders_the_chat(real, tmp_path):
    """SmolLM2's template adds a default system prompt where a chat has none: the model trains on exactly the
    template's rendering, every answer and its `<|im_end|>` trained, nothing else."""
    from sft.data.load import load_sft_datasets
    from sft.data.spec import DataSpec

    _, tokenizer = real
    rows = sample_rows(12)
    data = load_sft_datasets(DataSpec(train_file=str(write_jsonl(tmp_path / "rows.jsonl", rows)), max_length=512),
                             tokenizer)
    assert len(data.train) == len(rows)
    for row, sequence in zip(rows, data.train):
        rendered = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        expected_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert sequence["input_ids"] == expected_ids
        if row["messages"][0]["role"] != "system":
            assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        answers = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in labelled_runs(sequence["input_ids"], sequence["labels"])] == answers


@pytest.fixture(scope="module")
def real_batch(real, tmp_path_factory):
    """Six real rows tokenised, the real model, and its own loss and gradients on them padded (plus the cross entropy
    of its hidden states in float64, what the fp32 arithmetic of the loss approximates)."""
    from sft.data.tokens.collator import WeightedDataCollator
    from sft.data.load import load_sft_datasets
    from sft.data.spec import DataSpec
    from sft.model.loading import load_model

    _, tokenizer = real
    rows = write_jsonl(tmp_path_factory.mktemp("real-rows") / "rows.jsonl", sample_rows(6))
    features = list(load_sft_datasets(DataSpec(train_file=str(rows)), tokenizer).train)
    model = load_model(SMOLLM2[0], gguf_file=SMOLLM2[1], attn_implementation="sdpa_varlen")
    model.train()
    padded = WeightedDataCollator(tokenizer)(features)
    inputs = {k: padded[k] for k in ("input_ids", "attention_mask", "labels")}
    own = model(**inputs).loss
    params = [model.model.embed_tokens.weight, model.model.layers[0].self_attn.q_proj.weight,
              model.model.layers[29].mlp.down_proj.weight]
    own_grads = torch.autograd.grad(own, params)
    with torch.no_grad():  # the same hidden states, projected and their cross entropy taken in float64
        hidden = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       output_hidden_states=True).hidden_states[-1][:, :-1]
        targets = inputs["labels"][:, 1:]
        logits = hidden[targets != -100].double() @ model.lm_head.weight.double().T
        exact = torch.nn.functional.cross_entropy(logits, targets[targets != -100]).item()
    return features, model, params, own.item(), own_grads, exact, padded["labels"]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("impl", ["naive", "chunked"])
def test_the_training_loss_on_the_real_weights_is_the_models_own_loss(real, real_batch, tmp_path, packing, impl):
    """sft's loss and gradients on a batch of real rows, padded or packed into one row, equal the model's own
    (transformers' mean over the labelled tokens, of the padded batch).

    The tolerances are fp32's on this arithmetic: the model's own cross entropy over 49,152 logits of up to ~43 in
    fp32 is itself ~1e-5 (relative) off the same cross entropy in float64 (measured: 9e-6), so sft's loss is held to
    1e-5 of it, and the chunked kernel, which sums each token's exponentials in its own pass, to 2e-6 of float64
    (measured: 1e-6); gradients, sums over ~300 tokens and the vocabulary in
    another order, to 1e-4 of their norm (measured: 3e-5 for the chunked kernel, 1e-6 for the naive one)."""
    _, tokenizer = real
    features, model, params, own, own_grads, exact, labels = real_batch
    ours = sft_loss(model, tokenizer, features, labels, impl, packing, tmp_path)
    assert ours.item() == pytest.approx(own, rel=1e-5)
    assert ours.item() == pytest.approx(exact, rel=2e-6 if impl == "chunked" else 1e-5)
    for p, a, b in zip(params, own_grads, torch.autograd.grad(ours, params)):
        assert (b - a).norm() <= 1e-4 * a.norm()


@pytest.fixture(scope="module")
def lora_run(real, tmp_path_factory):
    """Twelve LoRA steps on the real model's additions, lm-evaluation-harness's bundled likelihood tasks before and
    after (48 eval rows), its adapter merged by `sft merge`."""
    from sft.commands.merge import main as merge_main

    tmp = tmp_path_factory.mktemp("real-lora")
    rows = write_jsonl(tmp / "rows.jsonl", sample_rows(48))
    proc = run_train("model=smollm2_135m", "lora=default", "loss=ce", "data=jsonl", f"data.train_file={rows}",
                     f"data.eval_file={rows}", "trainer.max_steps=12", "trainer.eval_steps=12",
                     "trainer.per_device_train_batch_size=4", "trainer.learning_rate=2e-3", "trainer.save_strategy=no",
                     "trainer.report_to=[tensorboard]", "eval_harness=sample", "eval_harness.every=1",
                     "eval_harness.limit=48", "eval_harness.tasks=[sft_sample_addition_choice,sft_sample_addition_ppl]",
                     "eval_harness.system_instruction=null", f"hydra.run.dir={tmp / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    merge_main([f"checkpoint={tmp / 'run'}", f"output={tmp / 'merged'}"])
    return tmp / "run", tmp / "merged"


def test_the_bundled_benchmark_measures_the_real_models_ability_and_moves_with_fine_tuning(lora_run):
    """Before any training the real model picks the right sum among four far above chance (0.25): an ability, not
    noise; a short fine-tune on the answers' format makes the reference answers more likely."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = lora_run
    events = EventAccumulator(str(next(d for d in (run / "runs").iterdir() if d.name != "hparams")))
    events.Reload()
    choice, ppl = ([(e.step, e.value) for e in events.Scalars(f"eval/harness/sft_sample_addition_{task}")]
                   for task in ("choice/acc", "ppl/byte_perplexity"))
    assert [step for step, _ in choice] == [step for step, _ in ppl] == [0, 12]
    assert choice[0][1] >= 0.35  # measured 0.41 on 100 rows; 48 rows' standard error is 0.07 at 0.25
    assert ppl[1][1] < ppl[0][1]  # the answers more likely after training
    results = json.loads((run / "results.json").read_text())
    assert results["eval_harness/sft_sample_addition_ppl/byte_perplexity"] == pytest.approx(ppl[1][1], rel=1e-6)


def test_the_merged_real_model_equals_peft_base_plus_adapter_and_carries_no_quantization(real, lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, tokenizer = real
    run, merged_dir = lora_run
    assert json.loads((run / "model" / "adapter_config.json").read_text())["r"] == 16
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert getattr(merged.config, "quantization_config", None) is None
    assert "quantization_config" not in (merged_dir / "config.json").read_text()
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = PeftModel.from_pretrained(base, run / "model").eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ours, theirs = merged(ids).logits, reference(ids).logits
        untrained = AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits
    # fp32 rounding of W + s*BA against x@W + s*(x@A)@B through 30 layers: logits of about 10 differ by up to 1.4e-4
    # (measured 2026-12-04); the adapter itself moves them by more than 1e-2
    torch.testing.assert_close(ours, theirs, atol=5e-4, rtol=1e-4)
    assert (ours - untrained).abs().max() > 1e-2  # the adapter changed the model: the comparison can fail


def test_the_trained_real_model_stops_at_im_end_under_plain_generate(real, lora_run):
    from transformers import AutoModelForCausalLM, GenerationConfig

    _, tokenizer = real
    run, merged_dir = lora_run
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for saved in (run / "model", merged_dir):  # beside the adapter, and in the merged model
        eos = GenerationConfig.from_pretrained(saved).eos_token_id
        assert im_end in ([eos] if isinstance(eos, int) else eos), saved
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = merged.generate(**prompt, max_new_tokens=40, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert out[-1] == im_end and len(out) < 40, tokenizer.decode(out)  # it ended, at its stop, not at the limit


def test_the_real_model_experiment_runs_and_reports_at_toy_size(real, tmp_path):
    """+experiment=real_hard_sample as docs/experiments.md ran it, at toy size: both losses train the real model,
    answer every bucket, and the report compares them in a verdict."""
    import csv

    rows = [json.loads(line) for line in (REPO / "sft/sample_data/validation.jsonl").read_text().splitlines()[:48]]
    evaluation = write_jsonl(tmp_path / "eval.jsonl", rows)
    proc = run_train("-m", "+experiment=real_hard_sample", "trainer.max_steps=2", "exact_match.max_rows=3",
                     "trainer.per_device_train_batch_size=4", "exact_match.max_new_tokens=12",
                     "trainer.seed=1", f"data.eval_file={evaluation}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        settings = {row["loss"]: row for row in csv.DictReader(f)}
    assert set(settings) == {"ce", "hard_sample"}
    assert all(0 <= float(settings["ce"][f"eval_exact/bucket_{k}"]) <= 1 for k in range(4))
    verdict = (tmp_path / "sweep" / "sweep_summary.md").read_text().split("## Verdict\n\n")[1]
    assert verdict.startswith("- loss=hard_sample against loss=ce (1 seed, paired): ")


def test_the_second_model_experiment_runs_and_reports_at_toy_size(real, tmp_path):
    """+experiment=real_second_model at toy size, its teacher (and reference) the real model's own dir: distill and
    reference_weighted compose with their second model from $SFT_TEACHER, train, answer every bucket, and the report
    pairs each with ce (hard_sample's job is real_hard_sample's, tested above)."""
    import csv

    model_dir, _ = real
    rows = [json.loads(line) for line in (REPO / "sft/sample_data/validation.jsonl").read_text().splitlines()[:48]]
    evaluation = write_jsonl(tmp_path / "eval.jsonl", rows)
    # 16 training rows: the reference scores the whole split before training (the bundled 4,000 take minutes)
    first = (REPO / "sft/sample_data/train.jsonl").read_text().splitlines()[:16]
    train = write_jsonl(tmp_path / "train.jsonl", [json.loads(line) for line in first])
    proc = run_train("-m", "+experiment=real_second_model", "+loss_zoo=ce,distill,reference_weighted",
                     "trainer.max_steps=2", "exact_match.max_rows=3", "trainer.per_device_train_batch_size=4",
                     "exact_match.max_new_tokens=12", "trainer.seed=1", f"data.eval_file={evaluation}",
                     f"data.train_file={train}",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", env={"SFT_TEACHER": str(model_dir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        settings = {row["loss_zoo"]: row for row in csv.DictReader(f)}
    assert set(settings) == {"ce", "distill", "reference_weighted"}
    assert all(0 <= float(settings["distill"][f"eval_exact/bucket_{k}"]) <= 1 for k in range(4))
    verdict = (tmp_path / "sweep" / "sweep_summary.md").read_text().split("## Verdict\n\n")[1]
    assert "- loss_zoo=distill against loss_zoo=ce (1 seed, paired): " in verdict
    assert "- loss_zoo=reference_weighted against loss_zoo=ce (1 seed, paired): " in verdict
    logs = {p.parent.name: p.read_text() for p in (tmp_path / "sweep").glob("*/app.log")}
    assert any(f"teacher: {model_dir} (LlamaForCausalLM" in log for log in logs.values())
    assert any("reference weights: " in log and " trained tokens kept (top 60%" in log for log in logs.values())


def test_bf16_step_losses_follow_fp32_over_10_real_steps(real, tmp_path):
    """`trainer.bf16=true` on a CPU with bf16 instructions (sft.training.processes.precision): ten full fine-tuning
    steps of the real model follow fp32's step losses to bf16's resolution, and both learn."""
    from conftest import composed

    from sft.run.build import build
    from sft.training.processes.precision import cpu_bf16_instructions

    if cpu_bf16_instructions() is None or torch.cuda.is_available():
        pytest.skip("needs a CPU with bf16 instructions and no GPU")
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):  # the 20-step schedule, cut short: the steps that prove it, in CI's time
        def __init__(self, steps: int):
            self.steps = steps

        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == self.steps

    rows = write_jsonl(tmp_path / "rows.jsonl", sample_rows(40))
    shared = ["model=smollm2_135m", "loss=ce", "data=jsonl", f"data.train_file={rows}", "data.eval_file=null",
              "trainer.max_steps=20", "trainer.logging_steps=1", "trainer.per_device_train_batch_size=2",
              "trainer.learning_rate=1e-4", "trainer.save_strategy=no", "trainer.report_to=[]"]
    losses = {}
    for name, extra, steps in (("fp32", [], 10), ("bf16", ["trainer.bf16=true"], 10),
                               ("pure", ["trainer.bf16=true", "trainer.precision=pure"], 5)):
        trainer = build(composed(*shared, *extra), str(tmp_path / name)).trainer
        trainer.add_callback(StopAfter(steps))
        trainer.train()
        losses[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    fp32, bf16 = losses["fp32"], losses["bf16"]
    assert len(fp32) == len(bf16) == 10
    # bf16 products carry 8 bits of mantissa through 30 layers: the first step's loss (the same weights) already
    # differs by about 1%, and the two runs' weights drift apart from there; each step within 6%, the run's mean
    # within 2% (measured 2026-12-04: first step 1.2%, worst step 4.8%, mean 1.4% over 8 steps; 2026-12-05, these
    # 10: worst 5.9%, mean 0.5%)
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32)) < 0.06, list(zip(bf16, fp32))
    assert abs(sum(bf16) - sum(fp32)) / sum(fp32) < 0.02, list(zip(bf16, fp32))
    assert sum(fp32[-5:]) < 0.7 * sum(fp32[:5]) and sum(bf16[-5:]) < 0.7 * sum(bf16[:5])
    # trainer.precision=pure holds the linear weights at the bf16 values autocast casts them to: the same steps
    # (measured 2026-12-05: all 20 equal; 5 here)
    assert losses["pure"] == bf16[:5]


def test_a_full_fine_tune_at_the_tiny_models_rate_diverges_and_the_guard_stops_it_naming_the_rate(real, tmp_path):
    """SmolLM2 fully fine-tuned at 2e-3 (the tiny model's rate): the loss goes 0.86, 0.86, 7.6, 8.7. The guard stops the
    run at the fourth step, without a checkpoint of the run-away weights, and the one-line error names the learning
    rate and the checkpoint before the rise; the real-model default (2e-5, trainer.learning_rate=null) trains."""
    run = tmp_path / "run"
    proc = run_train("model=smollm2_135m", "trainer.learning_rate=2e-3", "trainer.max_steps=8", "trainer.save_steps=2",
                     "trainer.eval_strategy=no", f"hydra.run.dir={run}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert "the loss diverged" in error and "too high for this model: trainer.learning_rate=0.002" in error, error
    assert f"resume={run / 'checkpoint-2'}" in error and "trainer.learning_rate=0.0002" in error
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]  # none of the run-away weights
