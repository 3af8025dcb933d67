"""LOSS_BASE_DOC"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
import numpy as np
import torch
import torch.nn.functional as F
from sft.data.batch import IGNORE_INDEX, sample_index
from sft.config import LossConfig
from sft.loss.kernels import chunked_linear_cross_entropy
from sft.loss.logits import LogitTransform



@dataclass
class Targets:
    """The assistant tokens of a micro-batch, flattened (N of them), in the order of the batch."""

    rows: torch.Tensor  # [N] row of the position whose output predicts the token (t - 1)
    cols: torch.Tensor  # [N] column of that position
    labels: torch.Tensor  # [N] token ids
    weights: torch.Tensor  # [N] loss weight w_t (float32)
    sample: torch.Tensor  # [N] index of the token's sample: its row, or its sequence in a packed row
    num_samples: int


def select_targets(labels: torch.Tensor, loss_weights: torch.Tensor,
                   position_ids: torch.Tensor | None = None) -> Targets:
    """The assistant tokens and the positions that predict them (position t predicts label t+1).

    Without `position_ids` every row is one sample; with them (a packed batch) each packed sample is one
    (`sft.data.batch.sample_index`).
    """
    shifted = labels[:, 1:]
    rows, cols = (shifted != IGNORE_INDEX).nonzero(as_tuple=True)
    if position_ids is None:
        sample, num_samples = rows, labels.size(0)
    else:
        index, num_samples = sample_index(position_ids)
        sample = index[:, 1:][rows, cols]
    return Targets(rows, cols, shifted[rows, cols], loss_weights[:, 1:][rows, cols].float(), sample, num_samples)


@dataclass
class LossTerms:
    """One micro-batch's share of a step's loss, plus per-sample sums for evaluation and the logs."""

    loss_sum: torch.Tensor  # sum of c_t * ce_t over the micro-batch (differentiable)
    numerator: torch.Tensor  # [samples] sum of c_t * ce_t (detached)
    denominator: torch.Tensor  # [samples] sum of d_t
    ce_sum: torch.Tensor  # [samples] sum of unweighted ce over assistant tokens (detached)
    weight_sum: torch.Tensor  # [samples] sum of w_t over assistant tokens
    tokens: torch.Tensor  # [samples] number of assistant tokens
    correct: torch.Tensor | None  # [samples] assistant tokens whose argmax is the label (when asked for)


@dataclass(eq=False, kw_only=True)
class WeightedTokenLoss(LossConfig):
    """Base of every loss: per-token cross entropy with per-token weights and a step-global normaliser.

    Its knobs and their checks are its schema's (`sft.config.LossConfig` and the subclass a loss extends):
    the difficulty weight (`alpha`, `min_weight`, `max_weight`), `normalize` (`weight`, `token`, `sample`;
    see the module docstring), `impl`, `aux`. A loss of your own extends it and overrides the hooks it needs:

        @dataclass(eq=False, kw_only=True)
        class DomainLoss(WeightedTokenLoss):
            safety: float = 4.0
            def sample_weight(self, row):  # row: the row's columns, its difficulty weight included
                return super().sample_weight(row) * (self.safety if row.get("domain") == "safety" else 1.0)
    """

    def __post_init__(self):
        self.check()

    # --- static weights: once per row at preprocessing, in numerator and denominator ------------------

    def sample_weight(self, row: Mapping) -> float:
        """The weight of a sequence's assistant tokens, from its row: `difficulty_score`, `assistant_tokens`
        (its trained tokens) and every other column of the data row. Default: the difficulty weight."""
        return self.difficulty_weight(row["difficulty_score"])

    def difficulty_weight(self, score: float) -> float:
        """`clamp(score ** alpha, min_weight, max_weight)`; 1 for every score when `alpha` is 0.

            HardSampleLoss(alpha=2, max_weight=10).difficulty_weight(3.0)  ->  9.0   (and 10.0 for a score of 4)
        """
        try:
            w = float(score) ** self.alpha
        except (ZeroDivisionError, OverflowError):  # 0 ** negative alpha, or 1e300 ** 2: clamped below
            w = float("inf")
        return min(max(w, self.min_weight), self.max_weight)

    def difficulty_weights(self, scores: np.ndarray) -> np.ndarray:
        """`difficulty_weight` of many scores at once (a split's: preprocessing a million rows).

            HardSampleLoss(alpha=2, max_weight=10).difficulty_weights(np.array([3.0, 4.0]))  ->  [9.0, 10.0]
        """
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            weights = np.power(np.asarray(scores, dtype=np.float64), self.alpha)
        return np.clip(weights, self.min_weight, self.max_weight)

    def token_weights(self, text: str, offsets: np.ndarray, row: Mapping) -> np.ndarray | None:
        """Per-token factors of the static weight, for a sequence's rendered `text` and its tokens'
        character `offsets` ([tokens, 2], start and end); None: all 1. Only trained tokens' factors count."""
        return None

    def token_weight_identity(self) -> dict:
        """What `token_weights` depends on besides the text: part of the data hash and the preprocessing
        cache key, so that changing it re-tokenises and a resume refuses it. Default: every knob the loss
        adds to `LossConfig`."""
        base = {f.name for f in fields(LossConfig)}
        return {"loss": type(self).__qualname__, **{f.name: getattr(self, f.name) for f in fields(self)
                                                    if f.name not in base}}

    @property
    def has_token_weights(self) -> bool:
        return type(self).token_weights is not WeightedTokenLoss.token_weights

    # --- forward-dependent: scales the numerator only ----------------------------------------------------

    def token_factor(self, ce: torch.Tensor) -> torch.Tensor | None:
        """A factor per assistant token from its (detached) cross entropy `ce` = -log p(target); None: 1."""
        return None

    # --- the step's numerator and denominator ------------------------------------------------------------

    def _coefficients(self, t: Targets) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token numerator and denominator coefficients (c, d)."""
        if self.normalize == "weight":
            return t.weights, t.weights
        if self.normalize == "token":
            return t.weights, torch.ones_like(t.weights)
        tokens = torch.bincount(t.sample, minlength=t.num_samples).clamp_min(1)
        per_sample = t.weights / tokens[t.sample]
        return per_sample, per_sample

    def normaliser(self, labels: torch.Tensor, loss_weights: torch.Tensor,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """This micro-batch's contribution to the step's denominator (needs no forward pass)."""
        return self._coefficients(select_targets(labels, loss_weights, position_ids))[1].sum()

    def terms(self, labels: torch.Tensor, loss_weights: torch.Tensor, *, logits: torch.Tensor | None = None,
              hidden: torch.Tensor | None = None, lm_head: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, impl: str = "naive", accuracy: bool = False,
              transform: LogitTransform | None = None) -> LossTerms:
        """Numerator and statistics of a micro-batch, from the logits (`naive`) or from the final hidden
        states and the output projection's weight (`chunked`, `cce`), whose logits get `transform` (the
        model's own post-projection step, `LogitTransform.of(model.config)`)."""
        t = select_targets(labels, loss_weights, position_ids)
        coef, den = self._coefficients(t)
        factor = None if type(self).token_factor is WeightedTokenLoss.token_factor else self.token_factor
        correct = None
        if impl == "naive":
            selected = logits[t.rows, t.cols]
            ce = F.cross_entropy(selected.float(), t.labels, reduction="none")
            coef = coef if factor is None else coef * factor(ce.detach())
            loss_sum = (coef * ce).sum()
            if accuracy:
                correct = selected.argmax(-1) == t.labels
        elif impl == "chunked":
            loss_sum, ce, correct, coef = chunked_linear_cross_entropy(
                hidden[t.rows, t.cols], lm_head, t.labels, coef, self.chunk_tokens, accuracy, transform, factor)
        elif impl == "cce":
            from cut_cross_entropy import linear_cross_entropy

            transform = transform or LogitTransform()
            h = hidden[t.rows, t.cols]
            ce = linear_cross_entropy(h * transform.scale if transform.scale != 1.0 else h, lm_head, t.labels,
                                      softcap=transform.softcap, reduction="none").float()
            coef = coef if factor is None else coef * factor(ce.detach())
            loss_sum = (coef * ce).sum()
        elif impl == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            transform = transform or LogitTransform()
            h = hidden[t.rows, t.cols]
            ce = liger_fused_linear_cross_entropy(h * transform.scale if transform.scale != 1.0 else h, lm_head,
                                                  t.labels, reduction="none", softcap=transform.softcap)
            ce = (ce[0] if isinstance(ce, tuple) else ce).float()  # some versions return (loss, z_loss)
            coef = coef if factor is None else coef * factor(ce.detach())
            loss_sum = (coef * ce).sum()
        else:
            raise ValueError(f"loss impl {impl!r}: terms() takes naive, chunked, cce or liger (see choose_impl)")

        def per_sample(values):
            return torch.zeros(t.num_samples, dtype=values.dtype, device=values.device).index_add_(0, t.sample, values)

        ce, coef = ce.detach(), coef.detach()
        return LossTerms(
            loss_sum=loss_sum,
            numerator=per_sample(coef * ce),
            denominator=per_sample(den),
            ce_sum=per_sample(ce),
            weight_sum=per_sample(t.weights),
            tokens=per_sample(torch.ones_like(t.labels)),
            correct=None if correct is None else per_sample(correct.long()),
        )

    def __call__(self, logits, labels, loss_weights, position_ids=None) -> torch.Tensor:
        """The loss of one self-contained batch (its own normaliser), e.g. for evaluation or tests."""
        terms = self.terms(labels, loss_weights, logits=logits, position_ids=position_ids)
        return terms.loss_sum / terms.denominator.sum().clamp_min(1e-12)


def build_loss(node) -> WeightedTokenLoss:
    """The loss of a config's `loss` node, its lists and dicts plain Python ones (and its aux terms built)."""
    from hydra.utils import instantiate

    return instantiate(node, _convert_="all")
