"""Two extensions of sft's loss, written as a user would write them (see docs/losses.md).

- `DomainWeightedLoss`: a static weight from the row's own `domain` column (safety rows weigh more), on top
  of the difficulty weight;
- `GroupContrastive`: an auxiliary term, in-batch InfoNCE between the answers of rows that share a `group`
  column, from the final hidden states.

Train with them (PYTHONPATH holding this folder):

    python -m sft.train hydra.searchpath=[file://examples/own_loss/conf] loss=domain_weighted \
        data.train_file=my_rows.jsonl
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Dict

import torch
import torch.nn.functional as F

from sft.loss.auxiliary import AuxBatch, AuxTerm
from sft.loss.base import WeightedTokenLoss


@dataclass(eq=False, kw_only=True)
class DomainWeightedLoss(WeightedTokenLoss):
    """The difficulty weight times `domain_weights[row["domain"]]` (1 for a domain not listed).

        domain_weights={"safety": 4}:  a row {"domain": "safety", "difficulty_score": 2, ...} with alpha=1  ->  8
    """

    _target_: str = "my_losses.DomainWeightedLoss"
    domain_weights: Dict[str, float] = field(default_factory=dict)

    def check(self, cfg=None):
        super().check(cfg)
        self.require("domain_weights", all(float(w) >= 0 for w in self.domain_weights.values()),
                     "every weight must be >= 0")

    def sample_weight(self, row):
        return super().sample_weight(row) * float(self.domain_weights.get(row.get("domain"), 1.0))


@dataclass
class GroupContrastive(AuxTerm):
    """InfoNCE between answers of one group: each sequence's answer (the mean of the final hidden states
    that predict its assistant tokens) should be closer, in cosine similarity over `temperature`, to the
    other answers of its group in the micro-batch than to the rest of the micro-batch.

    numerator = sum over anchors a of -log( sum_{p in group(a), p != a} softmax_{j != a}(sim(a, j))_p );
    denominator = the number of anchors: sequences with a group and another of that group in their
    micro-batch. The step's value is their ratio over all micro-batches and ranks (the negatives are
    in-batch, so it depends on how the step is split, as any in-batch contrastive loss does).

        groups [7, 7, 3, -1] in a micro-batch  ->  2 anchors (the two of group 7); 3 and -1 are negatives only
    """

    coef: float = 0.1
    temperature: float = 0.1
    column: str = "group"

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0")

    def row_value(self, row):
        """The group as a number (crc32 of its text); -1 for a row without one."""
        group = row.get(self.column)
        return -1.0 if group is None else float(zlib.crc32(str(group).encode()))

    def _anchors(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        same = (groups[:, None] == groups[None, :]) & (groups[:, None] >= 0)
        same.fill_diagonal_(False)
        return same, same.any(1)

    def denominator(self, batch: AuxBatch) -> torch.Tensor:
        return self._anchors(batch.values)[1].sum().double()

    def numerator(self, hidden: torch.Tensor, batch: AuxBatch) -> torch.Tensor:
        t = batch.targets()
        states = hidden[t.rows, t.cols].float()
        counts = torch.bincount(t.sample, minlength=t.num_samples).clamp_min(1)
        pooled = torch.zeros(t.num_samples, states.size(-1), device=states.device).index_add(0, t.sample, states)
        z = F.normalize(pooled / counts[:, None], dim=-1)
        positives, anchors = self._anchors(batch.values.to(states.device))
        # Anchor rows only: each has another sequence and a positive, so nothing below is -inf everywhere
        # (a row that is would make NaN gradients, even multiplied by 0).
        similarity = (z[anchors] @ z.T / self.temperature).masked_fill(torch.eye(len(z), dtype=torch.bool,
                                                                                 device=z.device)[anchors], -torch.inf)
        log_p = similarity.log_softmax(-1).masked_fill(~positives[anchors], -torch.inf)
        return -torch.logsumexp(log_p, dim=-1).sum()
