"""How a run fits its step in memory (`sft.run.memory_plan`): the plan's choices on a step of known size, the bound
of a micro-batch from the data, and runs on this CPU under a `trainer.memory_limit_gib` that make the plan split
the step or checkpoint activations, to the losses and weights of the step as set."""

import logging

import pytest
import torch
from conftest import composed

from sft.model.memory import Footprint
from sft.run.memory_plan import MicroBatchBound, plan

# 1,000 bytes a token of activations; with checkpointing each of 4 layers keeps its input (10 x 4 bytes a token)
# and one layer is recomputed at a time: 160 + 250 = 410 bytes a token. Nothing else.
FOOTPRINT = Footprint(weights=0, gradients=0, optimizer=0, per_token=1000.0, per_square=0.0, layers=4, hidden=10,
                      activation_size=4, vocab=0, lean_loss=True, chunk_tokens=1024)
TEN_TOKEN_ROWS = MicroBatchBound((10,) * 16, packed=False)  # a micro-batch of r rows: 10 r tokens


@pytest.mark.parametrize("per_device, accumulation, limit, checkpointing, fit, chosen", [
    (16, 1, 160_000, None, True, (16, 1, False, True)),  # fits as set
    (16, 1, 45_000, None, True, (4, 4, False, True)),  # the most rows that fit without checkpointing
    (2, 8, 45_000, None, True, (4, 4, False, True)),  # filled toward the limit: more rows than set
    (16, 1, 8_300, None, True, (2, 8, True, True)),  # not one row without checkpointing: on, 2 rows fit with it
    (16, 1, 100_000, None, False, (16, 1, True, True)),  # the micro-batch as set: checkpointing where it needs it
    (16, 1, 45_000, False, True, (4, 4, False, True)),
    (16, 1, 5_000, False, True, (1, 16, False, False)),  # nothing fits: the smallest, said
    (16, 1, 3_000, None, True, (1, 16, True, False)),
    (16, 1, 160_000, True, True, (16, 1, True, True)),  # asked for: on though it would fit without
    (2, 8, None, None, True, (2, 8, False, True)),  # no limit (a CPU): as set
])
def test_the_plan_splits_the_steps_rows_into_the_largest_micro_batch_that_fits_checkpointing_last(
        per_device, accumulation, limit, checkpointing, fit, chosen):
    found = plan(FOOTPRINT, TEN_TOKEN_ROWS, per_device, accumulation, limit, checkpointing, fit)
    assert (found.rows, found.accumulation, found.checkpointing, found.fits) == chosen
    assert found.rows * found.accumulation == per_device * accumulation  # the step's rows never change
    per_token = 410 if found.checkpointing else 1000
    assert found.estimate.total == per_token * 10 * found.rows


# packed samples of 100, 90, 80 ... tokens: the step's 16 rows hold 100 + 90 + ... (at most) tokens
PACKED = MicroBatchBound(tuple(range(100, 0, -10)) + (10,) * 6, packed=True)


@pytest.mark.parametrize("limit, checkpointing, chosen", [
    (700_000, None, (16, 1, None, False, True)),  # the step's 16 rows, 610 tokens, fit whole
    (300_000, None, (16, 1, 300, False, True)),  # in pieces of as many tokens as fit: 300 x 1,000 bytes
    (90_000, None, (16, 1, 219, True, True)),  # not the longest sample without checkpointing: on, 219 x 410 fit
    (30_000, None, (16, 1, 100, True, False)),  # not one sample even with it: pieces of one sample, said
])
def test_packed_rows_in_one_process_are_fitted_in_tokens_the_step_in_one_micro_batch(limit, checkpointing, chosen):
    found = plan(FOOTPRINT, PACKED, 8, 2, limit, checkpointing, fit=True, by_tokens=True)
    assert (found.rows, found.accumulation, found.tokens, found.checkpointing, found.fits) == chosen
    per_token = 410 if found.checkpointing else 1000
    if found.tokens is not None and found.fits:  # the largest budget that fits: one token more would not
        assert found.estimate.total <= limit < per_token * (found.tokens + 1)
    # without by_tokens (padded, or several processes) the rows are split as before, sized for the longest samples
    rows = plan(FOOTPRINT, PACKED, 8, 2, 300_000, None, fit=True)
    assert (rows.rows, rows.accumulation, rows.tokens) == (2, 8, None)  # 4 rows: 100+90+80+70 = 340 tokens


def test_a_budget_as_set_keeps_the_rows_split_and_checkpoints_only_where_its_pieces_need_it():
    found = plan(FOOTPRINT, PACKED, 8, 2, 100_000, None, fit=True, by_tokens=True, tokens=50)
    assert (found.rows, found.accumulation, found.tokens, found.checkpointing) == (8, 2, 50, False)
    assert found.estimate.tokens == 100  # a piece of at least the longest sample
    assert plan(FOOTPRINT, PACKED, 8, 2, 90_000, None, fit=True, by_tokens=True, tokens=500).checkpointing


def test_a_micro_batch_is_bounded_by_the_longest_samples_padded_or_packed():
    import datasets

    train = datasets.Dataset.from_dict({"input_ids": [[1] * 3, [1] * 9, [1] * 5, [1] * 2]})
    padded = MicroBatchBound.of(train, rows=2, max_length=64, packed=False, pad_to_multiple_of=None)
    assert padded.tokens(2) == (18, 2 * 81)  # both rows padded to the longest sample
    assert MicroBatchBound.of(train, 2, 64, False, pad_to_multiple_of=4).tokens(2) == (24, 2 * 144)
    packed = MicroBatchBound.of(train, rows=2, max_length=64, packed=True, pad_to_multiple_of=4)
    assert packed.tokens(2) == (14, 81 + 25) and packed.tokens(1) == (9, 81)  # each sample attends within itself
    stream = MicroBatchBound.of(train.to_iterable_dataset(), rows=2, max_length=64, packed=True,
                                pad_to_multiple_of=None)
    assert stream.tokens(2) == (128, 2 * 64 * 64)  # not known before it is read: data.max_length each


RUN = ["data.eval_file=null", "trainer.max_steps=3", "trainer.logging_steps=1", "trainer.report_to=[]",
       "trainer.per_device_train_batch_size=8", "loss=hard_sample", "trainer.lr_scheduler_type=constant",
       "trainer.save_strategy=no"]


def trained(tmp_path, name, *overrides):
    from sft.run.build import build

    recipe = build(composed(*RUN, *overrides), str(tmp_path / name))
    recipe.trainer.train()
    logged = [e[key] for e in recipe.trainer.state.log_history if "loss" in e for key in ("loss", "ce")]
    return recipe.trainer, logged


@pytest.fixture(scope="module")
def as_set(tmp_path_factory):
    """The run with the step as set (8 rows, one micro-batch, no checkpointing), and its footprint and bound."""
    from sft.model.memory import footprint

    trainer, logged = trained(tmp_path_factory.mktemp("as_set"), "as_set", "trainer.fit_micro_batch=false")
    found = footprint(trainer.model, optim=trainer.args.optim, chunk_tokens=trainer.loss.chunk_tokens)
    bound = MicroBatchBound.of(trainer.train_dataset, 8, 512, packed=False, pad_to_multiple_of=None)
    return trainer, logged, found, bound


def test_under_a_memory_limit_the_step_is_split_into_micro_batches_to_the_same_losses_and_weights(
        tmp_path, caplog, as_set):
    whole, expected, found, bound = as_set
    four, eight = (found.estimate_tokens(*bound.tokens(rows), False).total for rows in (4, 8))
    limit = (four + eight) / 2 / 2**30  # 4 rows fit, 8 do not
    with caplog.at_level(logging.INFO, logger="sft"):
        split, logged = trained(tmp_path, "split", f"trainer.memory_limit_gib={limit}")
    assert (split.args.per_device_train_batch_size, split.args.gradient_accumulation_steps) == (4, 2)
    assert not split.args.activation_checkpointing
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: "))
    assert f" of {limit * 1024:.0f} MiB (trainer.memory_limit_gib) for up to {4 * bound.longest[0]:,} tokens" in line
    assert line.endswith("; 4 rows a micro-batch x 2 accumulated: the step's 8 rows (set: 8 x 1)")
    assert logged == pytest.approx(expected, rel=1e-6)  # the step's rows, loss and update as set
    # Adam divides by the root of a gradient's square: an embedding row whose gradient is near 0 turns the sums' other
    # order (two micro-batches) into a few 1e-6 of an update of up to 2e-3 a step
    for ours, theirs in zip(split.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_where_no_micro_batch_fits_without_it_activations_are_checkpointed_to_the_same_losses(
        tmp_path, caplog, as_set):
    whole, expected, found, bound = as_set

    def total(rows, checkpointing):
        return found.estimate_tokens(*bound.tokens(rows), checkpointing).total

    limit = (total(1, True) + total(1, False)) / 2  # not one row without checkpointing, one with it
    rows = max(r for r in (1, 2, 4, 8) if total(r, True) <= limit)
    with caplog.at_level(logging.INFO, logger="sft"):
        trainer, logged = trained(tmp_path, "checkpointed", f"trainer.memory_limit_gib={limit / 2**30}")
    assert trainer.args.activation_checkpointing and trainer.model.is_gradient_checkpointing
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (rows, 8 // rows)
    assert "(activation checkpointing on; off, about " in caplog.text
    assert logged == pytest.approx(expected, rel=1e-6)  # recomputed, not changed


def test_packed_under_a_memory_limit_the_steps_rows_train_in_pieces_of_tokens_to_the_same_losses(tmp_path, caplog):
    """A packed step of 8 rows set as 4 x 2 that does not fit whole: one micro-batch of the 8 rows, trained in pieces
    of as many tokens as the limit holds, logs the losses of the step as set."""
    from sft.model.memory import footprint

    packed = ["data.packing=true", "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2"]
    as_set, expected = trained(tmp_path, "as_set", *packed, "trainer.fit_micro_batch=false")
    found = footprint(as_set.model, optim=as_set.args.optim, chunk_tokens=as_set.loss.chunk_tokens)
    bound = MicroBatchBound.of(as_set.train_dataset, 8, 512, packed=True, pad_to_multiple_of=None)
    whole = bound.tokens(8)[0]
    budget = max(bound.longest[0], whole // 2)
    limit = found.estimate_tokens(*bound.piece(budget), False).total / 2**30  # half the whole step fits, no more
    with caplog.at_level(logging.INFO, logger="sft"):
        cut, logged = trained(tmp_path, "cut", *packed, f"trainer.memory_limit_gib={limit}")
    assert (cut.args.per_device_train_batch_size, cut.args.gradient_accumulation_steps) == (8, 1)
    assert cut.micro_batches.tokens == budget and not cut.args.activation_checkpointing
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: "))
    assert line.endswith(f"; the step's 8 rows in one packed micro-batch (set: 4 x 2), trained in pieces of at most "
                         f"{budget:,} tokens")
    batches = [b for _, b in zip(range(3), cut.get_train_dataloader())]  # the run's three steps, in its order
    assert any(len(cut.micro_batches.split(b)) > 1 for b in batches), [b["input_ids"].shape[1] for b in batches]
    assert logged == pytest.approx(expected, rel=1e-6)
    for ours, theirs in zip(cut.model.parameters(), as_set.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_where_the_probe_fails_the_run_goes_on_as_set_saying_so(tmp_path, caplog, monkeypatch):
    import sft.model.memory
    from sft.run.build import build

    def fails(*args, **kwargs):
        raise RuntimeError("this model's forward needs more than input_ids")

    monkeypatch.setattr(sft.model.memory, "activation_bytes", fails)
    with caplog.at_level(logging.INFO, logger="sft"):
        trainer = build(composed(*RUN, "trainer.memory_limit_gib=0.001"), str(tmp_path)).trainer
    assert (f"memory: not estimated (the probe's forward of {type(trainer.model).__name__} failed: this model's "
            "forward needs more than input_ids); activation checkpointing off") in caplog.text
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 1)
