"""The GPU pack: what only a CUDA GPU can check. Every test here is marked `gpu` and skipped without CUDA (or
without the kernel it checks); `sft gpu-pack` runs them with the `preset=gpu_7b` bench and writes the
figures (README: "The GPU pack").

- `cce` (cut-cross-entropy) and Liger's fused linear cross entropy with per-token losses, on weighted tokens: values
  and gradients against fp32, beside the chunked loss's own bf16 error (cut-cross-entropy's hidden-state gradient
  is the one far from it);
- flash attention's varlen kernel on a packed row equals each sample's logits alone (padded);
- QLoRA (4-bit NF4 base) trains, and its adapter merges into the base;
- bf16 training of the tiny model follows fp32's step losses;
- the memory estimate's activations (`sft.model.memory`) against what CUDA's allocator holds after a forward, and
  the memory plan's split step within its limit, padded and packed (`sft.run.memory_plan`);
- compiled decoder layers (`trainer.compile_layers`) and Liger's layer kernels (`trainer.use_liger_kernel`) train
  the eager, unfused layers' losses;
- a long row trains the same losses offloaded and with tiled MLPs, in less GPU memory;
- sequence parallelism over 2 GPUs with flash attention trains one GPU's losses (skipped with fewer GPUs)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, launch, run_train

CUDA = torch.cuda.is_available()


NO_CUDA = "needs a CUDA GPU"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=NO_CUDA)]


# A vocabulary and hidden size where the kernels tile as at full scale, small enough for any GPU.
VOCAB, HIDDEN, TOKENS = 32768, 256, 1536


def weighted_tokens(dtype=torch.bfloat16):
    """Hidden states, a projection, labels and per-token coefficients (distinct, so a kernel that weighs
    tokens wrongly shows), on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=g)
    coef = torch.rand(TOKENS, device="cuda", generator=g) * 3
    return hidden, weight, labels, coef


def chunked_reference(hidden, weight, labels, coef, dtype=torch.float32):
    """`sum_t coef_t * ce_t`, the per-token losses and the gradients through `sft`'s chunked loss (itself checked
    against the naive loss and autograd in test_losses.py), on the values upcast to `dtype`: fp32's are the exact
    answer a half-precision kernel is measured against."""
    from sft.loss.kernels import chunked_linear_cross_entropy

    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss_sum, ce, _, _ = chunked_linear_cross_entropy(h, w, labels, coef, 1024, False)
    loss_sum.backward()
    return loss_sum.detach().float(), ce.float(), h.grad.float(), w.grad.float()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


ERROR_NAMES = ("per-token cross entropy", "weighted sum", "gradient of the hidden states", "gradient of the projection")


def errors_from_fp32(name: str, result, exact) -> dict:
    """Each of a bf16 computation's (sum, per-token losses, both gradients) relative distances from fp32's,
    printed (pytest -rA shows it: the figures' precision of each kernel)."""
    order = (1, 0, 2, 3)  # ERROR_NAMES' order in (sum, ce, grad_h, grad_w)
    errors = {what: relative_error(result[i], exact[i]) for what, i in zip(ERROR_NAMES, order)}
    print(f"{name} in bf16, relative error from fp32: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    return errors


def test_cce_per_token_losses_weighted_equal_the_chunked_loss_values_and_gradients():
    """cut-cross-entropy's per-token losses and gradients on weighted tokens, each measured against fp32 beside the
    chunked loss's own bf16 error. Its backward adds the hidden states' gradient up over the vocabulary's tiles in
    bf16 (`de = zeros_like(e)` in 25.1.1), so that gradient is the one far from fp32: 2.8e-2 here (the chunked loss
    2.4e-3; H200, 2026-12-04), 1.2e-2 at Qwen2.5-7B's output layer. Why `loss.impl=auto` does not pick it."""
    pytest.importorskip("cut_cross_entropy", reason="cut-cross-entropy is not installed (pip install -e '.[gpu]')")
    from sft.loss.builtin import HardSampleLoss
    from sft.loss.kernels import _cce_problem

    assert _cce_problem() is None, _cce_problem()
    hidden, weight, labels, coef = weighted_tokens()
    exact = chunked_reference(hidden, weight, labels, coef)
    chunked = errors_from_fp32("chunked", chunked_reference(hidden, weight, labels, coef, torch.bfloat16), exact)
    from cut_cross_entropy import linear_cross_entropy

    ce = linear_cross_entropy(hidden, weight, labels, reduction="none", filter_eps=None).float()  # exact gradients
    (coef * ce).sum().backward()
    cce = errors_from_fp32("cce", ((coef * ce).sum().detach(), ce.detach(), hidden.grad, weight.grad), exact)
    for what in ERROR_NAMES:  # the hidden states' gradient: within what was measured, with room
        bound = 5e-2 if what == "gradient of the hidden states" else max(2e-2, 2 * chunked[what])
        assert cce[what] < bound, (what, cce, chunked)

    # And through the loss interface the trainer calls (`impl="cce"`), on a padded batch of weighted rows.
    loss = HardSampleLoss(alpha=1.0)
    ids = labels[:1024].view(4, 256)
    rows_weight = torch.tensor([0.5, 1.0, 2.0, 4.0], device="cuda").repeat_interleave(256).view(4, 256)
    h = hidden.detach()[:1024].view(4, 256, HIDDEN)
    terms = {impl: loss.terms(ids, rows_weight, hidden=h, lm_head=weight.detach(), impl=impl)
             for impl in ("cce", "chunked")}
    assert relative_error(terms["cce"].loss_sum, terms["chunked"].loss_sum) < 1e-2
    assert relative_error(terms["cce"].numerator, terms["chunked"].numerator) < 1e-2


def test_liger_per_token_losses_weighted_equal_the_chunked_loss_values_and_gradients():
    """Liger's fused linear cross entropy with `reduction="none"`: per-token losses and a per-token gradient.
    liger-kernel 0.8.2 and later computes them, and `loss.impl=liger` uses it; older versions scale the gradient
    by one scalar in the forward, which this test shows as a gradient mismatch."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install -e '.[gpu]')")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if "reduction" not in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        pytest.skip("this liger-kernel has no reduction argument")
    hidden, weight, labels, coef = weighted_tokens()
    exact = chunked_reference(hidden, weight, labels, coef)
    chunked = errors_from_fp32("chunked", chunked_reference(hidden, weight, labels, coef, torch.bfloat16), exact)
    ce = liger_fused_linear_cross_entropy(hidden, weight, labels, reduction="none")
    ce = (ce[0] if isinstance(ce, tuple) else ce).float()
    (coef * ce).sum().backward()
    liger = errors_from_fp32("liger", ((coef * ce).sum().detach(), ce.detach(), hidden.grad, weight.grad), exact)
    for what in ERROR_NAMES:
        assert liger[what] < max(2e-2, 2 * chunked[what]), (what, liger, chunked)

    # And `loss.impl=liger` as the trainer runs it, where this liger-kernel passes choose_impl's checks.
    from sft.loss.builtin import HardSampleLoss
    from sft.loss.kernels import choose_impl

    if choose_impl("liger", vocab_size=VOCAB, on_gpu=True) != "liger":
        pytest.skip("this liger-kernel is older than 0.8.2: loss.impl=liger falls back to chunked")
    loss = HardSampleLoss(alpha=1.0)
    ids = labels[:1024].view(4, 256)
    rows_weight = torch.tensor([0.5, 1.0, 2.0, 4.0], device="cuda").repeat_interleave(256).view(4, 256)
    grads = {}
    for impl in ("liger", "chunked"):
        h = hidden.detach()[:1024].view(4, 256, HIDDEN).clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        terms = loss.terms(ids, rows_weight, hidden=h, lm_head=w, impl=impl)
        terms.loss_sum.backward()
        grads[impl] = (terms.loss_sum.detach(), terms.numerator, h.grad, w.grad)
    for what, a, b in zip(("loss_sum", "per-row numerators", "hidden grad", "lm_head grad"), grads["liger"],
                          grads["chunked"]):
        assert relative_error(a, b) < 2e-2, f"loss.terms(impl=liger): {what}"


def test_flash_attention_varlen_packing_gives_each_sample_its_own_logits(tokenizer):
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (pip install flash-attn)")
    from sft.data.tokens.collator import WeightedDataCollator
    from sft.model.loading import load_model

    flash = load_model("tiny", dtype="bfloat16", attn_implementation="flash_attention_2").cuda().eval()
    torch.manual_seed(0)
    samples = [torch.randint(10, 300, (n,)).tolist() for n in (37, 5, 64, 19)]
    feats = [{"input_ids": s, "labels": s, "sample_weight": 1.0, "source_line": i} for i, s in enumerate(samples)]
    packed = WeightedDataCollator(tokenizer, packing=True)(feats)
    padded = WeightedDataCollator(tokenizer)(feats)
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    with torch.no_grad():
        varlen = flash(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in packed.items() if k in keys},
                       use_cache=False).logits[0].float()
        batch = flash(input_ids=padded["input_ids"].cuda(), attention_mask=padded["attention_mask"].cuda(),
                      use_cache=False).logits.float()
    start = 0
    for i, s in enumerate(samples):
        n = len(s)
        # tokenizer pads on the right or left; the sample's tokens are where its attention mask is 1
        own = batch[i][padded["attention_mask"][i].bool().cuda()]
        torch.testing.assert_close(varlen[start:start + n], own, atol=3e-2, rtol=3e-2)
        start += n
    assert start == varlen.shape[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3_text"])  # grouped-query heads; sliding windows
def test_torchs_varlen_kernel_gives_a_packed_row_the_logits_and_gradients_of_sdpas_slots(arch):
    """`sdpa_varlen` on a GPU in bf16 runs PyTorch's varlen flash kernel (torch 2.10+); `sdpa_slots`, the padded slots
    the CPU runs: the same logits and weight gradients within bf16's rounding, the windowed layers included."""
    from torch.nn.attention import varlen  # noqa: F401  (the kernel is there: torch 2.10+)

    from sft.data.tokens.collator import WeightedDataCollator
    from sft.model.attention import register
    from architectures import tiny

    register()
    results = {}
    torch.manual_seed(0)
    samples = [torch.randint(3, 128, (n,)).tolist() for n in (37, 5, 300, 19)]  # one past Gemma-3's tiny window
    feats = [{"input_ids": s, "labels": s, "sample_weight": 1.0, "source_line": i} for i, s in enumerate(samples)]
    packed = WeightedDataCollator(tokenizer=None, packing=True)(feats)
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    inputs = {k: packed[k].cuda() if torch.is_tensor(packed[k]) else packed[k] for k in keys}
    for attn in ("sdpa_varlen", "sdpa_slots"):
        model = tiny(arch, tie=False, attn=attn).to(device="cuda", dtype=torch.bfloat16)
        logits = model(**inputs, use_cache=False).logits.float()
        logits.logsumexp(-1).sum().backward()
        results[attn] = (logits.detach(), torch.cat([p.grad.flatten().float() for p in model.parameters()]))
    assert relative_error(results["sdpa_varlen"][0], results["sdpa_slots"][0]) < 2e-2
    assert relative_error(results["sdpa_varlen"][1], results["sdpa_slots"][1]) < 5e-2


def test_a_packed_step_on_a_gpu_synchronises_at_most_twice(tmp_path):
    """CUDA's own count (`torch.cuda.set_sync_debug_mode`): a packed step of two micro-batches waits for the device at
    most twice (the CPU test counts the host reads that cause them: tests/training/test_trainer.py)."""
    import warnings

    from transformers import TrainerCallback

    from conftest import composed
    from sft.run.build import build

    class Window(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step in (2, 3):
                torch.cuda.set_sync_debug_mode("warn")

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.set_sync_debug_mode("default")

    cfg = composed("trainer.max_steps=5", "trainer.logging_steps=100", "trainer.eval_strategy=no",
                   "trainer.save_strategy=no", "trainer.report_to=[]", "data.eval_file=null", "data.packing=true",
                   "trainer.gradient_accumulation_steps=2", "trainer.bf16=true")
    trainer = build(cfg, str(tmp_path)).trainer
    trainer.add_callback(Window())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    print(f"synchronising operations in 2 packed steps: {len(syncs)}")
    assert len(syncs) <= 4, syncs


def test_qlora_trains_on_a_4bit_base_and_its_adapter_merges(tmp_path):
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (pip install bitsandbytes)")
    run = tmp_path / "run"
    proc = run_train("lora=qlora", "model.dtype=bfloat16", "trainer.bf16=true", "trainer.max_steps=6",
                     "trainer.learning_rate=5e-3", "trainer.logging_steps=1", "trainer.eval_steps=100",
                     "trainer.save_steps=100", "trainer.report_to=[]", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(run / "model").peft_type.value == "LORA"
    history = json.loads((run / "results.json").read_text())
    assert history["global_step"] == 6
    merged = subprocess.run([sys.executable, "-m", "sft", "merge", f"checkpoint={run}", f"output={tmp_path / 'merged'}",
                             "dtype=float32"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr[-3000:]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model

    ids = torch.tensor([[11, 42, 97, 5, 260, 31]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(ids).logits
        b = PeftModel.from_pretrained(load_model("tiny"), run / "model").eval()(ids).logits
        base = load_model("tiny").eval()(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # merged into the full-precision base, as deployed
    assert (b - base).abs().max() > 1e-3, "the adapter changed nothing: the test would not see a failed merge"


def test_fsdp_offload_on_one_gpu_equals_fsdp_without_offload(tmp_path):
    """FSDP2 with CPU offload (which needs a GPU: torch pins the offloaded memory) on one process: the same
    step losses and a whole adapter as FSDP without offload."""
    from safetensors.torch import load_file

    losses = {}
    for group in ("full_shard", "full_shard_offload"):
        run = tmp_path / group
        proc = run_train(f"fsdp={group}", "lora=default", "trainer.max_steps=4", "trainer.logging_steps=1",
                         "trainer.eval_steps=100", "trainer.save_steps=100", "trainer.report_to=[]",
                         "trainer.train_sampling_strategy=sequential", f"hydra.run.dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
        losses[group] = [e["loss"] for e in state["log_history"] if "loss" in e]
        adapter = load_file(run / "model" / "adapter_model.safetensors")
        assert adapter["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (64, 16)
    assert losses["full_shard_offload"] == pytest.approx(losses["full_shard"], abs=1e-4)


def test_bf16_training_follows_fp32_step_losses(tmp_path):
    losses = {}
    for precision, extra in (("fp32", []), ("bf16", ["trainer.bf16=true"])):
        run = tmp_path / precision
        proc = run_train("trainer.max_steps=8", "trainer.logging_steps=1", "trainer.eval_steps=100",
                         "trainer.save_steps=8", "trainer.report_to=[]", *extra, f"hydra.run.dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        state = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())
        losses[precision] = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert len(losses["bf16"]) == 8
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=3e-2)
    assert losses["fp32"][-1] < losses["fp32"][0]  # it trained: the comparison is of a moving curve


def test_the_memory_estimate_of_a_step_is_within_a_quarter_of_what_cuda_allocates():
    """`sft.model.memory.estimate`'s activations against the CUDA allocator's peak over a forward and backward of
    the tiny model in bf16 (8 rows of 1,024 tokens), weights, gradients and loss aside."""
    from sft.model.loading import load_model
    from sft.model.memory import estimate

    model = load_model("tiny").cuda().train()
    rows, length = 8, 1024
    found = estimate(model, rows, length, optim="adamw_torch", autocast_dtype=torch.bfloat16, lean_loss=False)
    ids = torch.randint(0, model.config.vocab_size, (rows, length), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    held = torch.cuda.memory_allocated() - before - hidden.numel() * hidden.element_size()
    hidden.float().pow(2).mean().backward()
    print(f"activations: estimated {found.activations / 2**20:.0f} MiB, held after the forward {held / 2**20:.0f} MiB")
    assert found.activations == pytest.approx(held, rel=0.25)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_memory_plan_trains_within_its_limit_and_the_steps_losses(tmp_path, packing):
    """`sft.run.memory_plan` on a GPU: under a `trainer.memory_limit_gib` that 16 rows of the tiny model in bf16 do not
    fit, the step is split (packed: trained in pieces of tokens); CUDA's allocator peak stays within the limit, and
    the step losses are those of the step as set (bf16: within 1%)."""
    from conftest import composed

    from sft.run.build import build

    def trained(name, *overrides):
        torch.cuda.reset_peak_memory_stats()
        trainer = build(composed("data.eval_file=null", "trainer.max_steps=3", "trainer.logging_steps=1",
                                 "trainer.report_to=[]", "trainer.save_strategy=no", "trainer.bf16=true",
                                 "trainer.per_device_train_batch_size=16", "data.max_length=1024",
                                 f"data.packing={str(packing).lower()}", *overrides),
                        str(tmp_path / name)).trainer
        trainer.train()
        return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e], torch.cuda.max_memory_allocated()

    whole, expected, peak = trained("whole", "trainer.fit_micro_batch=false")
    limit = peak * 0.6 / 2**30
    split, losses, split_peak = trained("split", f"trainer.memory_limit_gib={limit}")
    print(f"memory plan: as set {peak / 2**20:.0f} MiB; under {limit * 1024:.0f} MiB: "
          f"{split.args.per_device_train_batch_size} x {split.args.gradient_accumulation_steps}, "
          f"pieces of {split.micro_batches.tokens} tokens, "
          f"{'checkpointed' if split.args.activation_checkpointing else 'not checkpointed'}, "
          f"peak {split_peak / 2**20:.0f} MiB")
    assert split.args.per_device_train_batch_size * split.args.gradient_accumulation_steps == 16
    assert split_peak <= limit * 2**30
    assert losses == pytest.approx(expected, rel=1e-2)


def test_compiled_layers_train_the_eager_layers_losses_on_a_gpu(tmp_path):
    """`trainer.compile_layers=true` on CUDA (inductor's Triton kernels, bf16, packed rows, LoRA): the eager run's
    step losses (within 1%)."""
    from conftest import composed

    from sft.run.build import build

    def trained(name, *overrides):
        trainer = build(composed("data.eval_file=null", "trainer.max_steps=4", "trainer.logging_steps=1",
                                 "trainer.report_to=[]", "trainer.save_strategy=no", "trainer.bf16=true",
                                 "data.packing=true", "lora=default", *overrides), str(tmp_path / name)).trainer
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    assert trained("compiled", "trainer.compile_layers=true") == pytest.approx(trained("eager"), rel=1e-2)


@pytest.mark.skipif(CUDA and importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
def test_liger_layer_kernels_train_the_unfused_layers_losses(tmp_path):
    """`trainer.use_liger_kernel=true` (Liger's RMSNorm, RoPE and SwiGLU, sft.model.liger) on the tiny Qwen2 in bf16,
    packed: the unfused run's step losses (within 1%), with the norms replaced by Liger's."""
    from conftest import composed

    from sft.run.build import build

    def trained(name, *overrides):
        trainer = build(composed("data.eval_file=null", "trainer.max_steps=4", "trainer.logging_steps=1",
                                 "trainer.report_to=[]", "trainer.save_strategy=no", "trainer.bf16=true",
                                 "data.packing=true", *overrides), str(tmp_path / name)).trainer
        trainer.train()
        return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e]

    fused, losses = trained("fused", "trainer.use_liger_kernel=true")
    assert "Liger" in type(fused.model.get_decoder().norm).__name__
    assert losses == pytest.approx(trained("unfused")[1], rel=1e-2)


def test_long_rows_offloaded_and_tiled_train_the_same_losses_in_less_gpu_memory(tmp_path):
    # One 8k-token row a step (the bench's long_rows case, lengths 8192, with the bf16 autocast replayed in the
    # tiles' backward): each variant the plain checkpointed run's losses, in less GPU memory than the one before it.
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "sft.bench", "--out", str(out), "bench.cases=[long_rows]",
                           "bench.long_row_lengths=[8192]", "bench.long_row_steps=2", "bench.long_row_tile_tokens=1024",
                           "trainer.bf16=true"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {variant: r["8192"] for variant, r in json.loads(out.read_text())["cases"]["long_rows"].items()}
    assert list(runs) == ["plain", "checkpointed", "tiled", "offloaded"]
    for variant in ("tiled", "offloaded"):
        assert runs[variant]["losses"] == pytest.approx(runs["checkpointed"]["losses"], rel=1e-2), variant
    memory = [runs[v]["memory_gb"] for v in ("plain", "checkpointed", "tiled", "offloaded")]
    assert memory == sorted(memory, reverse=True), memory


@pytest.mark.skipif(CUDA and (torch.cuda.device_count() < 2 or importlib.util.find_spec("flash_attn") is None),
                    reason="needs 2 CUDA GPUs and flash-attn")
def test_sequence_parallel_over_two_gpus_with_flash_attention_trains_one_gpus_losses(tmp_path):
    """Packed rows split over 2 GPUs (`sp=ulysses`, NCCL), flash attention's varlen kernel on the gathered sequence:
    the step losses of the same micro-batches on one GPU (bf16: within 1%)."""
    common = ["data.packing=true", "model.attn_implementation=flash_attention_2", "trainer.bf16=true",
              "trainer.max_steps=4", "trainer.logging_steps=1", "trainer.eval_steps=100", "trainer.save_steps=4",
              "trainer.report_to=[]", "trainer.train_sampling_strategy=sequential",
              "trainer.per_device_train_batch_size=8"]
    losses = {}
    for name, proc in (("one", lambda run: run_train(*common, f"hydra.run.dir={run}")),
                       ("two", lambda run: launch("--nproc", "2", "sp=ulysses", *common, f"hydra.run.dir={run}"))):
        run = tmp_path / name
        done = proc(run)
        assert done.returncode == 0, done.stderr[-3000:]
        state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
        losses[name] = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert len(losses["two"]) == 4 and losses["two"] == pytest.approx(losses["one"], rel=1e-2)
