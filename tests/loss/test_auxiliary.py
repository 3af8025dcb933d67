"""Auxiliary terms (`sft.loss.auxiliary`): summed over the optimizer step as the main loss is, exactly under
accumulation."""

import pytest
import torch
from conftest import group_rows, train_steps

from sft.data.tokens.collator import WeightedDataCollator
from sft.loss.builtin import CrossEntropyLoss


def test_an_auxiliary_term_is_summed_over_the_step_as_the_main_loss_is(tmp_path, tokenizer, my_losses):
    from sft.model.loading import load_model
    from sft.loss.auxiliary import AuxBatch

    term = my_losses.GroupContrastive(coef=0.5)
    loss = CrossEntropyLoss(aux={"contrastive": term})
    rows = group_rows(8)
    losses, params, trainer = train_steps(tmp_path / "a", tokenizer, loss, 4, 2, rows=rows, steps=1)
    logged = next(e for e in trainer.state.log_history if "loss" in e)

    # Independently: the initial model's decoder on each micro-batch, the term's numerators over its anchors.
    torch.manual_seed(0)
    model, collate = load_model("tiny"), WeightedDataCollator(tokenizer)
    numerators, denominators = [], []
    with torch.no_grad():
        for part in (trainer.train_dataset.select(range(0, 4)), trainer.train_dataset.select(range(4, 8))):
            batch = collate(list(part))
            hidden = model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
            numerators.append(term.numerator(hidden, AuxBatch.of(batch, "contrastive")).item())
            denominators.append(term.denominator(AuxBatch.of(batch, "contrastive")).item())
    assert min(denominators) > 0
    assert logged["aux/contrastive"] == pytest.approx(sum(numerators) / sum(denominators), rel=1e-5)
    ce_losses, _, _ = train_steps(tmp_path / "b", tokenizer, CrossEntropyLoss(), 4, 2, rows=rows, steps=1)
    assert losses[0] == pytest.approx(ce_losses[0] + 0.5 * logged["aux/contrastive"], abs=1e-5)

    # A step of one micro-batch twice is that micro-batch's step: the term is a mean over the step's anchors.
    once_losses, once, _ = train_steps(tmp_path / "c", tokenizer, loss, 4, 1, rows=rows[:4], steps=1)
    twice_losses, twice, _ = train_steps(tmp_path / "d", tokenizer, loss, 4, 2, rows=rows[:4] * 2, steps=1)
    assert twice_losses == pytest.approx(once_losses, abs=1e-5)
    torch.testing.assert_close(twice, once, atol=1e-5, rtol=0)
