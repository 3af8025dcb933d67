"""The trainer's loss is exact under gradient accumulation, and hard_sample reduces to ce."""

import pytest
import torch
from transformers import TrainingArguments

from conftest import chat, write_jsonl
from sft.data import WeightedDataCollator, load_sft_datasets
from sft.losses import CrossEntropyLoss, HardSampleLoss
from sft.model import load_model
from sft.trainer import WeightedLossTrainer

# Answers of very different lengths, so that a per-micro-batch mean would visibly differ from the step's.
ROWS = [
    chat("What is 1 + 1?", "2", 0.5),
    chat("What is 4969 + 5866? Show the sum.", "4969 + 5866 = 10835, carrying four times along the way", 4.0),
    chat("Add 7 and 8.", "15", 1.0),
    chat("Compute 123 + 456.", "123 + 456 = 579", 2.0),
    chat("What is 99 + 1?", "99 + 1 = 100, two carries", 3.0),
    chat("Add 3 and 4.", "7", 0.5),
    chat("Compute 250 + 250.", "250 + 250 = 500", 1.5),
    chat("What is 5005 + 995? Explain briefly.", "5005 + 995 = 6000; every column carries", 3.5),
]


def train_steps(tmp_path, tokenizer, loss, batch_size, accumulation, rows=ROWS, steps=2, packing=False):
    """Train the tiny model for `steps` SGD steps over `rows` in order; return step losses and parameters."""
    f = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = load_sft_datasets(tokenizer, loss.sample_weight, train_file=str(f), max_length=128)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out-{batch_size}x{accumulation}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        optim="sgd",  # Adam would hide a wrong gradient scale; SGD shows it
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = WeightedLossTrainer(
        model=load_model("tiny"), args=args, train_dataset=data.train,
        data_collator=WeightedDataCollator(tokenizer, packing=packing), processing_class=tokenizer, loss=loss,
    )
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return losses, params, trainer


@pytest.mark.parametrize("loss", [CrossEntropyLoss(), HardSampleLoss(alpha=1.0),
                                  HardSampleLoss(alpha=2.0, normalize="sample"),
                                  HardSampleLoss(alpha=1.0, normalize="token")],
                         ids=["ce", "hard_sample", "hard_sample-sample", "hard_sample-token"])
def test_gradient_accumulation_does_not_change_losses_or_parameters(tmp_path, tokenizer, loss):
    losses_a, params_a, _ = train_steps(tmp_path, tokenizer, loss, batch_size=4, accumulation=1)
    losses_b, params_b, _ = train_steps(tmp_path, tokenizer, loss, batch_size=1, accumulation=4)
    assert len(losses_a) == len(losses_b) == 2
    assert losses_a == pytest.approx(losses_b, abs=1e-5)
    torch.testing.assert_close(params_a, params_b, atol=1e-5, rtol=0)


def test_hard_sample_with_equal_weights_is_exactly_ce(tmp_path, tokenizer):
    equal = [{**r, "difficulty_score": 2.0} for r in ROWS]
    ce_losses, ce_params, _ = train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 2, 2, rows=equal)
    hs_losses, hs_params, _ = train_steps(tmp_path, tokenizer, HardSampleLoss(alpha=1.0), 2, 2, rows=equal)
    assert hs_losses == pytest.approx(ce_losses, abs=1e-6)
    torch.testing.assert_close(hs_params, ce_params, atol=1e-6, rtol=0)


def test_unequal_weights_do_change_the_update(tmp_path, tokenizer):
    _, ce_params, _ = train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 4, 1)
    _, hs_params, _ = train_steps(tmp_path, tokenizer, HardSampleLoss(alpha=1.0), 4, 1)
    assert (ce_params - hs_params).abs().max() > 1e-4


def test_logged_ce_and_weight_mean_describe_the_step(tmp_path, tokenizer):
    losses, _, trainer = train_steps(tmp_path, tokenizer, HardSampleLoss(alpha=1.0), 4, 1, steps=1)
    log = next(e for e in trainer.state.log_history if "loss" in e)
    # With one step on the first 4 rows the weight mean is the token-weighted mean of their scores.
    rows = trainer.train_dataset.select(range(4))
    tokens = [sum(label != -100 for label in r["labels"][1:]) for r in rows]
    expected = sum(t * r["difficulty_score"] for t, r in zip(tokens, rows)) / sum(tokens)
    assert log["weight_mean"] == pytest.approx(expected, rel=1e-5)
    assert log["ce"] > 0 and log["ce"] != pytest.approx(log["loss"], abs=1e-4)


@pytest.mark.parametrize("normalize", ["weight", "token", "sample"])
def test_chunked_loss_trains_exactly_as_the_naive_one(tmp_path, tokenizer, normalize):
    naive = HardSampleLoss(alpha=1.0, normalize=normalize, impl="naive")
    chunked = HardSampleLoss(alpha=1.0, normalize=normalize, impl="chunked", chunk_tokens=7)
    losses_n, params_n, trainer_n = train_steps(tmp_path, tokenizer, naive, 2, 2)
    losses_c, params_c, trainer_c = train_steps(tmp_path, tokenizer, chunked, 2, 2)
    assert (trainer_n.loss_impl, trainer_c.loss_impl) == ("naive", "chunked")
    assert losses_c == pytest.approx(losses_n, abs=1e-5)
    torch.testing.assert_close(params_c, params_n, atol=1e-5, rtol=0)


@pytest.mark.parametrize("normalize", ["weight", "sample"])
def test_packing_trains_exactly_as_padding(tmp_path, tokenizer, normalize):
    loss = HardSampleLoss(alpha=1.0, normalize=normalize)
    losses_pad, params_pad, _ = train_steps(tmp_path, tokenizer, loss, 4, 1)
    losses_pack, params_pack, trainer = train_steps(tmp_path, tokenizer, loss, 4, 1, packing=True)
    assert losses_pack == pytest.approx(losses_pad, abs=1e-5)
    torch.testing.assert_close(params_pack, params_pad, atol=1e-5, rtol=0)
    log = next(e for e in trainer.state.log_history if "loss" in e)
    assert log["padding_fraction"] == 0


def test_flops_per_token_is_6n_for_full_fine_tuning_4n_frozen_plus_attention():
    from sft.callbacks.throughput import flops_per_token

    model = load_model("tiny")
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # lm_head included
    attention = 6 * 4 * 128 * 50  # layers x heads * head_dim x mean sequence length
    assert flops_per_token(model, 50) == 6 * n + attention
    for p in model.parameters():
        p.requires_grad_(False)
    assert flops_per_token(model, 50) == 4 * n + attention


def test_throughput_values_are_logged(tmp_path, tokenizer, monkeypatch):
    from sft.callbacks import ThroughputMeter
    from sft.callbacks.throughput import flops_per_token

    meters = []
    real_init = WeightedLossTrainer.__init__

    def with_peak(self, *args, **kwargs):  # a CPU has no peak in the table: give one, to get an MFU
        meters.append(ThroughputMeter(peak_tflops=0.05))
        real_init(self, *args, throughput=meters[-1], **kwargs)

    monkeypatch.setattr(WeightedLossTrainer, "__init__", with_peak)
    _, _, trainer = train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 4, 1, steps=1)
    log = next(e for e in trainer.state.log_history if "loss" in e)
    rows = trainer.train_dataset.select(range(4))
    lengths = [len(r["input_ids"]) for r in rows]
    padded = max(lengths) * 4  # padded to the longest row
    assert log["padding_fraction"] == pytest.approx(1 - sum(lengths) / padded, abs=1e-4)
    assert log["tokens_per_second"] > 0 and log["trainable_tokens_per_second"] < log["tokens_per_second"]
    assert log["peak_memory_gb"] > 0.05
    expected = flops_per_token(trainer.model, sum(lengths) / 4) * log["tokens_per_second"] / 0.05e12
    assert log["mfu"] == pytest.approx(expected, rel=1e-2)
