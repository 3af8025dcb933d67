"""A training step's memory, known before it runs (`sft.model.memory`): the parameters of known shapes counted as
published (Qwen2.5-7B: 7,615,616,512; LoRA r=16 on every linear layer: 40,370,176 trained), and the activations of
a micro-batch as autograd keeps them, from two short rows; a teacher beside the model; the one line a run logs."""

import pytest
import torch
from conftest import composed, fast_loop, moved_tiny

from sft.model.memory import (GIB, MemoryEstimate, estimate, footprint, optimizer_bytes_per_parameter,
                              parameter_bytes, saved_bytes)
from sft.training.processes.precision import cpu_bf16_instructions

QWEN2_5_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def meta_model(**shape):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **shape))


def test_the_weights_gradients_and_adam_state_of_qwen2_5_7b_are_counted_as_published():
    model = meta_model(**QWEN2_5_7B)
    weights, gradients, trained = parameter_bytes(model)
    assert trained == 7_615_616_512  # Qwen2.5-7B's published parameter count
    assert weights == gradients == 4 * trained  # fp32
    assert optimizer_bytes_per_parameter("adamw_torch") * trained / GIB == pytest.approx(56.7, abs=0.05)
    from sft.training.step.master_weights import hold_linear_weights_in_bf16

    in_bf16 = hold_linear_weights_in_bf16(model)  # trainer.precision=pure
    weights, gradients, _ = parameter_bytes(model, pure=True)
    assert weights == 2 * in_bf16 + 4 * (trained - in_bf16)
    assert gradients == 8 * in_bf16 + 4 * (trained - in_bf16)  # a bf16 weight's fp32 copy and its gradient


def test_a_lora_adapter_on_a_bf16_base_counts_its_base_at_two_bytes_and_trains_only_the_adapters():
    from peft import LoraConfig, get_peft_model

    model = meta_model(**QWEN2_5_7B).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    weights, gradients, trained = parameter_bytes(model)
    assert trained == 40_370_176  # PEFT's own count for r=16 on every linear layer of Qwen2.5-7B
    assert gradients == trained * next(p for p in model.parameters() if p.requires_grad).element_size()
    assert weights == 2 * 7_615_616_512 + gradients  # the base in bf16, the adapters beside it


@pytest.mark.parametrize("optim, optim_args, per_parameter", [
    ("adamw_torch", None, 8), ("adamw_torch_fused", None, 8), ("adamw_bnb_8bit", None, 2), ("sgd", None, 0),
    ("sgd", "momentum=0.9", 4), ("adafactor", None, 0)])
def test_the_optimizer_state_a_parameter_holds(optim, optim_args, per_parameter):
    assert optimizer_bytes_per_parameter(optim, optim_args) == per_parameter


BF16 = cpu_bf16_instructions() is not None


@pytest.mark.parametrize("overrides, autocast", [([], False), (["lora=default"], False),
                                                 (["lora=default", "trainer.bf16=true"], True)],
                         ids=["full-fp32", "lora-fp32", "lora-bf16"])
def test_the_activations_of_a_micro_batch_are_what_autograd_keeps_for_its_backward(overrides, autocast):
    """Measured from three short rows, the activations of 4 rows of 512 tokens: within 3% of the bytes autograd
    keeps for them (what does not grow with the row, the rotary tables and the final norm's, is the difference)."""
    if autocast and not BF16:
        pytest.skip("needs a CPU with bf16 instructions")
    from sft.run.build import build_model

    model = build_model(composed(*overrides), activation_checkpointing=False)
    dtype = torch.bfloat16 if autocast else None
    found = estimate(model, 4, 512, optim="adamw_torch", autocast_dtype=dtype)
    assert found.activations == pytest.approx(kept_for_backward(model, 4, 512, dtype), rel=0.03)
    assert found.other_activations < found.activations / 2  # checkpointed: each layer's input, one layer recomputed


def kept_for_backward(model, rows: int, length: int, dtype=None) -> int:
    model.train()  # as it trains: LoRA's dropout keeps its masks and outputs
    return saved_bytes(model.get_decoder(), torch.randint(0, model.config.vocab_size, (rows, length)),
                       {p.untyped_storage().data_ptr() for p in model.parameters()}, dtype)


@pytest.mark.parametrize("arch", fast_loop(["llama", "gemma3_text", "qwen3_moe", "lfm2", "falcon_h1"],
                                           {"gemma3_text"}))
def test_the_activations_of_other_families_are_what_autograd_keeps_the_square_of_a_masked_row_too(arch):
    """Llama, a mixture of experts, two hybrids, and Gemma-3 under sdpa with its sliding window, whose mask is a
    T x T tensor a row: its square term measured from the three rows, 4 rows of 256 tokens within 3%."""
    from architectures import tiny

    model = tiny(arch, False, attn="sdpa")
    found = estimate(model, 4, 256, optim="adamw_torch")
    assert found.activations == pytest.approx(kept_for_backward(model, 4, 256), rel=0.03)


def test_a_run_logs_its_memory_in_one_line(caplog, tmp_path):
    import logging

    from sft.run.build import build

    with caplog.at_level(logging.INFO, logger="sft"):
        recipe = build(composed("data.eval_file=null", "trainer.max_steps=1", "trainer.report_to=[]",
                                "trainer.per_device_train_batch_size=4", "data.max_length=512"), str(tmp_path))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: "))
    longest = max(len(ids) for ids in recipe.data.train["input_ids"])  # 4 rows padded to the longest sample
    assert line.startswith("memory: about ") and f" for up to {4 * longest:,} tokens a micro-batch: weights " in line
    assert line.endswith("MiB)") and "(activation checkpointing off; on, about " in line


def test_the_line_says_the_device_memory_and_the_other_way_of_checkpointing():
    found = MemoryEstimate(weights=15 * GIB, gradients=GIB // 10, optimizer=GIB // 5, activations=40 * GIB,
                           loss=GIB // 2, tokens=32768, checkpointing=False, other_activations=4 * GIB)
    assert found.line("80.0 GiB") == (
        "memory: about 55.8 GiB of 80.0 GiB for up to 32,768 tokens a micro-batch: weights 15.0, gradients 0.1, "
        "optimizer 0.2, activations 40.0, loss 0.5 GiB (activation checkpointing off; on, about 19.8 GiB)")


def test_a_teacher_is_counted_beside_the_model_and_the_plan_fits_fewer_rows_with_it():
    from sft.model.loading import load_model
    from sft.run.memory_plan import MicroBatchBound, plan

    model, teacher = load_model("tiny"), moved_tiny()
    alone = footprint(model, optim="adamw_torch", chunk_tokens=256)
    both = footprint(model, optim="adamw_torch", chunk_tokens=256, second_model=teacher)
    config = teacher.config
    tokens = 4 * 100
    # its fp32 weights, its MLP's working set a token, a chunk of its logits projected twice
    expected = (sum(p.numel() for p in teacher.parameters()) * 4
                + tokens * (3 * config.hidden_size + 3 * config.intermediate_size) * 4 + 256 * config.vocab_size * 8)
    with_teacher, without = both.estimate(4, 100, False), alone.estimate(4, 100, False)
    assert with_teacher.second_model == expected and with_teacher.total - without.total == expected
    assert ", loss " in with_teacher.line() and f", second model {expected / 2**20:.0f} MiB (" in with_teacher.line()
    assert "second model" not in without.line()
    bound = MicroBatchBound(longest=(100,) * 8, packed=False)
    limit = alone.estimate(8, 100, False).total  # the step's 8 rows fit at once without the teacher
    assert plan(alone, bound, 8, 1, limit, False, True).rows == 8
    assert plan(both, bound, 8, 1, limit, False, True).rows < 8
