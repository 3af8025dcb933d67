"""Auxiliary terms of a loss (`loss.aux.<name>`): their interface and what they see of a micro-batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sft.config.schema import target_base


@dataclass
class AuxBatch:
    """What an auxiliary term sees of a micro-batch besides the hidden states (tensors): the labels and each token's
    weight, `position_ids` of a packed batch, and each sequence's `values` (its `AuxTerm.row_value`, [sequences])."""

    labels: Any
    weights: Any
    position_ids: Any
    values: Any

    @classmethod
    def of(cls, batch: dict, name: str) -> AuxBatch:
        """What the auxiliary term `name` sees of a collated micro-batch."""
        return cls(batch["labels"], batch["weights"], batch.get("position_ids"), batch[f"aux_{name}"])

    def targets(self):
        """The assistant tokens and the positions predicting them, with each one's sequence
        (`sft.loss.terms.Targets`)."""
        from sft.loss.terms import select_targets

        return select_targets(self.labels, self.weights, self.position_ids)


@target_base("loss.aux.*")
class AuxTerm:
    """An auxiliary term of a loss (`loss.aux.<name>`), added as `coef * sum of numerators / sum of
    denominators` over the optimizer step (all micro-batches, all ranks), as the main loss is; logged as
    `aux/<name>` without the coef. A term of your own overrides the three methods (see `examples/`).
    """

    coef: float = 1.0

    def row_value(self, row: Mapping) -> float:
        """A number per sequence computed at preprocessing from its row (e.g. a group id): `AuxBatch.values`."""
        return 0.0

    def denominator(self, batch: AuxBatch):
        """This micro-batch's share of the step's denominator (a tensor; before any forward pass)."""
        raise NotImplementedError

    def numerator(self, hidden, batch: AuxBatch):
        """This micro-batch's share of the step's numerator, differentiable, from the final hidden states
        [rows, positions, hidden]."""
        raise NotImplementedError
