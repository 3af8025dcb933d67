"""Weighted token losses for causal LMs, normalised over the whole optimizer step.

Every loss here is a ratio `sum_t c_t * ce_t / sum_t d_t` over the assistant tokens `t` of an optimizer
step: all its gradient-accumulation micro-batches on all data-parallel ranks. The trainer sums the
denominator over the step before the first forward (`normaliser`) and divides each micro-batch's
numerator by it, so gradient accumulation and the number of processes change neither the loss nor the
gradients. With `w_t` the token's loss weight and `n_i` the number of assistant tokens of its sample:

- `weight`: c = w, d = w (weighted token mean; with equal weights exactly the token-mean CE);
- `token`:  c = w, d = 1 (weighted sum over the number of assistant tokens);
- `sample`: c = w / n_i, d = w / n_i (each sample's mean CE, averaged with the sample weights as
  weights, so long answers do not dominate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class LossTerms:
    """Per-sample sums of one micro-batch: its share of a step's loss, plus statistics for the logs."""

    numerator: torch.Tensor  # [batch] sum of c_t * ce_t (differentiable)
    denominator: torch.Tensor  # [batch] sum of d_t
    ce_sum: torch.Tensor  # [batch] sum of unweighted ce over assistant tokens (detached)
    weight_sum: torch.Tensor  # [batch] sum of w_t over assistant tokens
    tokens: torch.Tensor  # [batch] number of assistant tokens


def shift(labels: torch.Tensor, loss_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and weights aligned with the logits that predict them (position t predicts t+1)."""
    labels = labels[:, 1:]
    weights = torch.where(labels == IGNORE_INDEX, 0.0, loss_weights[:, 1:].float())
    return labels, weights


class WeightedTokenLoss:
    """Base class: per-token cross entropy with per-token weights and a step-global normaliser."""

    normalize: str = "weight"

    def sample_weight(self, difficulty_score: float) -> float:
        """The loss weight of a sample's assistant tokens."""
        return 1.0

    def _coefficients(self, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token numerator and denominator coefficients (c, d) on shifted labels and weights."""
        mask = labels != IGNORE_INDEX
        if self.normalize == "weight":
            return weights, weights
        if self.normalize == "token":
            return weights, mask.float()
        if self.normalize == "sample":
            per_sample = weights / mask.sum(dim=1, keepdim=True).clamp_min(1)
            return per_sample, per_sample
        raise ValueError(f"loss.normalize={self.normalize!r}: must be one of weight, token, sample")

    def normaliser(self, labels: torch.Tensor, loss_weights: torch.Tensor) -> torch.Tensor:
        """This micro-batch's contribution to the step's denominator (needs no forward pass)."""
        labels, weights = shift(labels, loss_weights)
        return self._coefficients(labels, weights)[1].sum()

    def terms(self, logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor) -> LossTerms:
        """Numerator and statistics of a micro-batch from the model's logits."""
        labels, weights = shift(labels, loss_weights)
        logits = logits[:, :-1, :]
        ce = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX,
            reduction="none",
        ).view(labels.shape)
        coef, denominator = self._coefficients(labels, weights)
        return LossTerms(
            numerator=(coef * ce).sum(dim=1),
            denominator=denominator.sum(dim=1),
            ce_sum=ce.detach().sum(dim=1),
            weight_sum=weights.sum(dim=1),
            tokens=(labels != IGNORE_INDEX).sum(dim=1),
        )

    def __call__(self, logits, labels, loss_weights) -> torch.Tensor:
        """The loss of one self-contained batch (its own normaliser), e.g. for evaluation or tests."""
        terms = self.terms(logits, labels, loss_weights)
        return terms.numerator.sum() / terms.denominator.sum().clamp_min(1e-12)


class CrossEntropyLoss(WeightedTokenLoss):
    """Token-mean cross entropy over assistant tokens: equal to the model's own loss."""

    normalize = "weight"


class HardSampleLoss(WeightedTokenLoss):
    """Weights each sample's assistant tokens by `clamp(difficulty_score ** alpha, min_weight, max_weight)`."""

    def __init__(self, alpha: float = 1.0, min_weight: float = 0.0, max_weight: float = 100.0,
                 normalize: str = "weight"):
        self.alpha, self.min_weight, self.max_weight, self.normalize = alpha, min_weight, max_weight, normalize

    def sample_weight(self, difficulty_score: float) -> float:
        try:
            w = float(difficulty_score) ** self.alpha
        except ZeroDivisionError:  # 0 ** negative alpha: infinitely easy, clamped below
            w = float("inf")
        return min(max(w, self.min_weight), self.max_weight)
