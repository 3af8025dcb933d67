"""Throughput in the training logs: tokens/s, padding, MFU (against its formula), peak memory."""

import pytest
import torch
from conftest import train_steps

from sft.loss.builtin import CrossEntropyLoss
from sft.model.loading import load_model
from sft.training.observability.throughput import ThroughputMeter, flops_per_token, model_flops_per_token


def test_flops_per_token_is_6n_for_full_fine_tuning_4n_frozen_plus_attention():
    model = load_model("tiny")
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # lm_head included
    attention = 6 * 4 * 128 * 50  # layers x heads * head_dim x mean sequence length
    assert flops_per_token(model, 50) == 6 * n + attention
    for p in model.parameters():
        p.requires_grad_(False)
    assert flops_per_token(model, 50) == 4 * n + attention


def test_executed_flops_count_the_logits_computed_and_model_flops_are_6n_whatever_trains():
    """A lean loss projects only the trained positions: the output layer's products scale with their share. The
    MFU convention's model FLOPs stay 6N (adapters not counted), full fine-tuning or LoRA."""
    from peft import LoraConfig, get_peft_model

    model = load_model("tiny")
    head = model.get_output_embeddings().weight.numel()
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = 6 * 4 * 128 * 50
    assert flops_per_token(model, 50, logit_fraction=0.25) == 6 * (n - head) + 6 * head * 0.25 + attention
    assert model_flops_per_token(model, 50) == 6 * n + attention
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for name, p in lora.named_parameters() if "lora_" in name)
    # frozen weights: forward and the activations' gradient (4n); the adapters: 6 per weight
    assert flops_per_token(lora, 50) == 4 * n + 6 * adapters + attention
    assert model_flops_per_token(lora, 50) == 6 * n + attention


def test_throughput_values_are_logged(tmp_path, tokenizer):
    from sft.training.parts import Display

    # a CPU has no peak in the table: give one, to get an MFU
    _, _, trainer = train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 4, 1, steps=1,
                                shows=Display(throughput=ThroughputMeter(peak_tflops=0.05)))
    log = next(e for e in trainer.state.log_history if "loss" in e)
    rows = trainer.train_dataset.select(range(4))
    lengths = [len(r["input_ids"]) for r in rows]
    padded = max(lengths) * 4  # padded to the longest row
    assert log["padding_fraction"] == pytest.approx(1 - sum(lengths) / padded, abs=1e-4)
    assert log["tokens_per_second"] > 0 and log["trainable_tokens_per_second"] < log["tokens_per_second"]
    assert log["peak_memory_gb"] > 0.05
    expected = flops_per_token(trainer.model, sum(lengths) / 4) * log["tokens_per_second"] / 0.05e12
    assert log["mfu"] == pytest.approx(expected, rel=1e-2)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0), ("NVIDIA L40S", 362.0),
                                        ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA A10G", 70.0),
                                        ("NVIDIA GeForce RTX 5090", None)])
def test_a_gpus_peak_is_read_from_its_name_the_more_specific_name_first(name, peak):
    """H100 PCIe and NVL are not the SXM part's 989 TFLOP/s, nor an L40S an L40: a name is matched to the first key it
    contains, the specific before the general; a GPU the table lacks has no peak, and the line says what to set."""
    from sft.training.observability.throughput import device_peak_tflops, unknown_peak

    assert device_peak_tflops(name) == peak
    if peak is None:
        assert unknown_peak(name) == ("throughput: no mfu: NVIDIA GeForce RTX 5090 is not in the table of peak bf16 "
                                      "rates (sft.training.observability.throughput.PEAK_TFLOPS); set "
                                      "throughput.peak_tflops=<its TFLOP/s>")
