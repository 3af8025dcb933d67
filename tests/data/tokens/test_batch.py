"""What a batch holds (`sft.data.tokens.batch`): the samples of packed rows, read from their restarting positions,
against a plain Python reading of the same rows."""

import random

import torch

from sft.data.tokens.batch import input_tokens, packed_bounds, packed_slots, sample_index


def positions_of(lengths):
    return [p for n in lengths for p in range(n)]


def test_packed_rows_samples_are_where_the_positions_restart():
    rng = random.Random(0)
    rows = [[rng.randint(1, 6) for _ in range(rng.randint(1, 5))] for _ in range(20)]
    width = max(sum(r) for r in rows)
    for lengths in rows:  # one row: each sample's start, then the end
        bounds = packed_bounds(torch.tensor(positions_of(lengths)))
        assert bounds.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        # each token's slot when the samples are laid out one a row, padded to the longest
        longest = max(lengths)
        slots = packed_slots(bounds, sum(lengths), longest).tolist()
        assert slots == [i * longest + j for i, n in enumerate(lengths) for j in range(n)]
    # a batch of rows of equal width (each padded by a sample of its own), numbered over the whole batch
    padded = [lengths + ([width - sum(lengths)] if sum(lengths) < width else []) for lengths in rows]
    index, count = sample_index(torch.tensor([positions_of(lengths) for lengths in padded]))
    expected, n = [], 0
    for lengths in padded:
        expected.append([n + i for i, k in enumerate(lengths) for _ in range(k)])
        n += len(lengths)
    assert index.tolist() == expected and count == n


def test_a_micro_batchs_input_tokens_leave_padding_out():
    ids = torch.ones(2, 5, dtype=torch.long)
    assert int(input_tokens({"input_ids": ids, "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])})) == 7
    assert int(input_tokens({"input_ids": ids})) == 10  # packed: no padding


def test_the_trained_positions_the_collator_finds_are_those_the_loss_would_find():
    """`trained_positions` (the collator's, on the CPU) against the loss's own search on the device
    (`sft.loss.terms.select_targets` without them), padded and packed."""
    from sft.data.tokens.batch import trained_positions
    from sft.loss.terms import select_targets

    torch.manual_seed(0)
    labels = torch.randint(0, 50, (3, 12))
    labels[torch.rand(3, 12) < 0.4] = -100
    weights = torch.rand(3, 12)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]] * 3)
    for position_ids in (None, positions):
        found = trained_positions(labels, position_ids)
        given = tuple(found[key] for key in ("target_rows", "target_cols", "target_samples", "num_samples"))
        own, collated = select_targets(labels, weights, position_ids), select_targets(labels, weights, position_ids,
                                                                                      given)
        for field in ("rows", "cols", "labels", "weights", "sample"):
            assert torch.equal(getattr(own, field), getattr(collated, field)), field
        assert own.num_samples == collated.num_samples == (3 if position_ids is None else 9)
