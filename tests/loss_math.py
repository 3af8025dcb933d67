"""Hand-built logits, labels and weights for the loss tests, and the losses computed by hand."""

import math

import torch

# Two samples, 4 positions, vocabulary of 3. Position t's logits predict label t+1.
LOGITS = torch.tensor(
    [
        [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 2.0], [0.0, 0.0, 0.0]],
        [[1.0, 2.0, 3.0], [0.0, 0.0, 4.0], [1.0, 0.0, 0.0], [0.0, 3.0, 1.0]],
    ]
)


# Sample 0 trains on positions 2 and 3 (targets 1, 2); sample 1 on positions 1..3 (targets 2, 0, 1).
LABELS = torch.tensor([[-100, -100, 1, 2], [-100, 2, 0, 1]])


def ce(logits, target):
    return math.log(sum(math.exp(v) for v in logits)) - logits[target]


def hand_ce():
    rows = LOGITS.tolist()
    s0 = [ce(rows[0][1], 1), ce(rows[0][2], 2)]
    s1 = [ce(rows[1][0], 2), ce(rows[1][1], 0), ce(rows[1][2], 1)]
    return s0, s1
