"""Loss values against hand computations."""

import math

import pytest
import torch

from sft.losses import CrossEntropyLoss, HardSampleLoss

# Two samples, 4 positions, vocabulary of 3. Position t's logits predict label t+1.
LOGITS = torch.tensor(
    [
        [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 2.0], [0.0, 0.0, 0.0]],
        [[1.0, 2.0, 3.0], [0.0, 0.0, 4.0], [1.0, 0.0, 0.0], [0.0, 3.0, 1.0]],
    ]
)
# Sample 0 trains on positions 2 and 3 (targets 1, 2); sample 1 on positions 1..3 (targets 2, 0, 1).
LABELS = torch.tensor([[-100, -100, 1, 2], [-100, 2, 0, 1]])
W0, W1 = 2.0, 0.5
WEIGHTS = torch.tensor([[0.0, 0.0, W0, W0], [0.0, W1, W1, W1]])


def ce(logits, target):
    return math.log(sum(math.exp(v) for v in logits)) - logits[target]


def hand_ce():
    rows = LOGITS.tolist()
    s0 = [ce(rows[0][1], 1), ce(rows[0][2], 2)]
    s1 = [ce(rows[1][0], 2), ce(rows[1][1], 0), ce(rows[1][2], 1)]
    return s0, s1


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


def test_ce_is_the_plain_token_mean():
    s0, s1 = hand_ce()
    ones = (LABELS != -100).float()
    assert CrossEntropyLoss()(LOGITS, LABELS, ones).item() == pytest.approx((sum(s0) + sum(s1)) / 5, rel=1e-6)


@pytest.mark.parametrize(
    "score, alpha, lo, hi, expected",
    [(2.5, 1.0, 0.0, 100.0, 2.5), (3.0, 2.0, 0.0, 100.0, 9.0), (3.0, 2.0, 0.0, 4.0, 4.0),
     (0.1, 1.0, 0.5, 100.0, 0.5), (0.0, -1.0, 0.0, 10.0, 10.0), (4.0, 0.0, 0.0, 100.0, 1.0)],
)
def test_hard_sample_weight_is_clamped_power_of_the_score(score, alpha, lo, hi, expected):
    loss = HardSampleLoss(alpha=alpha, min_weight=lo, max_weight=hi)
    assert loss.sample_weight(score) == pytest.approx(expected)


def test_ce_equals_the_models_own_loss(tokenizer):
    from sft.model import load_model

    torch.manual_seed(0)
    model = load_model("tiny")
    ids = torch.randint(10, len(tokenizer), (3, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 9:] = -100
    out = model(input_ids=ids, labels=labels)
    ours = CrossEntropyLoss()(out.logits, labels, (labels != -100).float())
    assert ours.item() == pytest.approx(out.loss.item(), rel=1e-5)
