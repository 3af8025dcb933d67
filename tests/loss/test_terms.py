"""The loss's arithmetic (`sft.loss.terms`): each normalisation against a hand computation, a forward factor on the
numerator only, packed samples counted on their own."""

import pytest
import torch
from loss_math import LABELS, LOGITS, hand_ce

from sft.loss.builtin import CrossEntropyLoss, HardSampleLoss

W0, W1 = 2.0, 0.5


WEIGHTS = torch.tensor([[0.0, 0.0, W0, W0], [0.0, W1, W1, W1]])


def hard_sample(normalize):
    loss = HardSampleLoss(alpha=1.0, normalize=normalize)
    return loss(LOGITS, LABELS, WEIGHTS)


def test_weight_normalisation_matches_hand_computation():
    s0, s1 = hand_ce()
    expected = (W0 * sum(s0) + W1 * sum(s1)) / (W0 * len(s0) + W1 * len(s1))
    assert hard_sample("weight").item() == pytest.approx(expected, rel=1e-6)


def test_token_normalisation_matches_hand_computation():
    s0, s1 = hand_ce()
    expected = (W0 * sum(s0) + W1 * sum(s1)) / (len(s0) + len(s1))
    assert hard_sample("token").item() == pytest.approx(expected, rel=1e-6)


def test_sample_normalisation_matches_hand_computation():
    s0, s1 = hand_ce()
    expected = (W0 * sum(s0) / len(s0) + W1 * sum(s1) / len(s1)) / (W0 + W1)
    assert hard_sample("sample").item() == pytest.approx(expected, rel=1e-6)


def test_modes_differ_so_the_tests_above_discriminate():
    values = {m: hard_sample(m).item() for m in ("weight", "token", "sample")}
    assert len({round(v, 6) for v in values.values()}) == 3


def test_a_forward_factor_scales_the_numerator_only():
    # Halving every factor halves the loss: the denominator (summed before any forward) does not follow it.
    class Half(CrossEntropyLoss):
        def token_factor(self, ce):
            return torch.full_like(ce, 0.5)

    ones = (LABELS != -100).float()
    assert Half()(LOGITS, LABELS, ones).item() == pytest.approx(0.5 * CrossEntropyLoss()(LOGITS, LABELS, ones).item())


def test_packed_sample_normalisation_counts_each_sample_on_its_own():
    # The padded batch of LOGITS as one packed row: the same per-sample means, hence the same loss.
    packed_logits = LOGITS.reshape(1, 8, 3)
    packed_labels = LABELS.reshape(1, 8).clone()
    packed_labels[0, 4] = -100  # a sample's first token is never a target (DataCollatorWithFlattening)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    loss = HardSampleLoss(alpha=1.0, normalize="sample")
    packed = loss(packed_logits, packed_labels, WEIGHTS.reshape(1, 8), position_ids=position_ids)
    assert packed.item() == pytest.approx(hard_sample("sample").item(), rel=1e-6)
