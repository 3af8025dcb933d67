"""A micro-batch's share of a step's loss, computed (`compute_terms`): its assistant tokens and the positions
predicting them (`select_targets`), each token's cross entropy by the chosen implementation, and the sums a
step, an evaluation and the logs need (`LossTerms`). The only loss module that imports torch when imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from sft.data.tokens.batch import IGNORE_INDEX, sample_index
from sft.loss.logits import LogitTransform


@dataclass
class Targets:
    """The assistant tokens of a micro-batch, flattened (N of them), in the order of the batch."""

    rows: torch.Tensor  # [N] row of the position whose output predicts the token (t - 1)
    cols: torch.Tensor  # [N] column of that position
    labels: torch.Tensor  # [N] token ids
    weights: torch.Tensor  # [N] each token's weight w_t (float32): the batch's `weights`
    sample: torch.Tensor  # [N] index of the token's sample: its row, or its sequence in a packed row
    num_samples: int

    def within(self, keep: torch.Tensor, start: int) -> "Targets":
        """The targets where `keep`, their positions counted from column `start` (a slice of the batch's positions)."""
        return Targets(self.rows[keep], self.cols[keep] - start, self.labels[keep], self.weights[keep],
                       self.sample[keep], self.num_samples)


def select_targets(labels: torch.Tensor, weights: torch.Tensor, position_ids: torch.Tensor | None = None,
                   given: tuple | None = None) -> Targets:
    """The assistant tokens and the positions that predict them (position t predicts label t+1).

    Without `position_ids` every row is one sample; with them (a packed batch) each packed sample is one
    (`sft.data.tokens.batch.sample_index`). `given`: the positions as the collator found them on the CPU
    (`sft.data.tokens.batch.trained_positions`: rows, columns, samples, number of samples), which spares the device a
    wait (a `nonzero` and a count); they are the same positions.
    """
    shifted = labels[:, 1:]
    if given is not None:
        rows, cols, sample, num_samples = given
        rows, cols, sample = (x.to(labels.device, non_blocking=True) for x in (rows, cols, sample))
    else:
        rows, cols = (shifted != IGNORE_INDEX).nonzero(as_tuple=True)
        if position_ids is None:
            sample, num_samples = rows, labels.size(0)
        else:
            index, num_samples = sample_index(position_ids)
            sample = index[:, 1:][rows, cols]
    return Targets(rows, cols, shifted[rows, cols], weights[:, 1:][rows, cols].float(), sample, int(num_samples))


@dataclass
class SecondOutputs:
    """A second model's outputs on a micro-batch (a teacher's, `WeightedTokenLoss.second_model`), computed without
    gradients: its `logits` `[rows, positions, V]`; or its final hidden states and output projection's weight, whose
    logits get its `transform`, projected a chunk of tokens at a time as the model's own are (`chunked`); or a cached
    teacher's k largest logits `top_logits` and their ids `top_ids` `[rows, positions, k]` (`sft.model.teacher_cache`),
    of an output layer `width` wide, the others -inf:

        top_ids [[1, 0]], top_logits [[2.0, 0.5]], width 3  ->  logits_of(0, 1) = [[0.5, 2.0, -inf]]
    """

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None
    transform: LogitTransform | None = None
    top_ids: torch.Tensor | None = None
    top_logits: torch.Tensor | None = None
    width: int = 0

    def at(self, t: Targets) -> "SecondOutputs":
        """Only the rows of the positions predicting the targets `t`, in their order; the output projection's weight in
        the hidden states' dtype (cast once here, not at every chunk and again in its backward's recomputation)."""
        if self.logits is not None:
            return SecondOutputs(logits=self.logits[t.rows, t.cols])
        if self.top_ids is not None:
            return SecondOutputs(top_ids=self.top_ids[t.rows, t.cols], top_logits=self.top_logits[t.rows, t.cols],
                                 width=self.width)
        hidden = self.hidden[t.rows, t.cols]
        return SecondOutputs(hidden=hidden, lm_head=self.lm_head.to(hidden.dtype), transform=self.transform)

    def logits_of(self, start: int, end: int) -> torch.Tensor:
        """The float32 logits of selected rows `start:end` (after `at`)."""
        if self.logits is not None:
            return self.logits[start:end].float()
        if self.top_ids is not None:
            ids = self.top_ids[start:end]
            full = torch.full((len(ids), self.width), -torch.inf, dtype=torch.float32, device=ids.device)
            return full.scatter_(1, ids.long(), self.top_logits[start:end].float())
        return (self.transform or LogitTransform())((self.hidden[start:end] @ self.lm_head.T).float())


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


def coefficients(normalize: str, t: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token numerator and denominator coefficients (c, d) of `loss.normalize` (`sft.loss.base`)."""
    if normalize == "weight":
        return t.weights, t.weights
    if normalize == "token":
        return t.weights, torch.ones_like(t.weights)
    # each sample's token count, its size known (a bincount finds its size on the device: a wait)
    tokens = torch.zeros(t.num_samples, dtype=t.weights.dtype, device=t.weights.device).index_add_(
        0, t.sample, torch.ones_like(t.weights)).clamp_min(1)
    per_sample = t.weights / tokens[t.sample]
    return per_sample, per_sample


def compute_terms(t: Targets, normalize: str, factor: Callable | None, *, logits=None, hidden=None, lm_head=None,
                  impl: str = "naive", accuracy: bool = False, transform: LogitTransform | None = None,
                  chunk_tokens: int = 1024, columns: tuple[int, int] | None = None, token_loss: Callable | None = None,
                  second: SecondOutputs | None = None) -> LossTerms:
    """`LossTerms` of a micro-batch's targets: each token's cross entropy from the logits (`naive`) or from the
    final hidden states and the output projection's weight (`chunked`, `cce`, `liger`; the logits get `transform`),
    times its coefficient and the loss's forward-dependent `factor(ce)` where it has one.

    `columns` `(start, end)`: the logits or hidden states are those of these positions only (a rank's slice under
    sequence parallelism); the terms are then those of the targets predicted there, with the coefficients of the
    whole batch (a sample's token count under `normalize=sample`), so the slices' terms sum to the batch's.

    `token_loss(logits, labels, second_logits) -> (loss, ce)`: each token's loss in place of its cross entropy, from
    its position's logits (`sft.loss.builtin.EAFTLoss`) and a second model's there, given its outputs `second`
    (`sft.loss.builtin.DistillLoss`), by `naive` or, with a lean `impl`, a chunk of tokens at a time
    (`token_loss_chunked`)."""
    coef, den = coefficients(normalize, t)
    if columns is not None:
        keep = (t.cols >= columns[0]) & (t.cols < columns[1])
        t, coef, den = t.within(keep, columns[0]), coef[keep], den[keep]
    if token_loss is not None:
        loss_sum, ce, values, correct = _token_loss_terms(t, coef, token_loss, second, logits=logits, hidden=hidden,
                                                          lm_head=lm_head, impl=impl, accuracy=accuracy,
                                                          transform=transform, chunk_tokens=chunk_tokens)
    else:
        loss_sum, ce, correct, coef = _cross_entropy_terms(t, coef, factor, logits=logits, hidden=hidden,
                                                           lm_head=lm_head, impl=impl, accuracy=accuracy,
                                                           transform=transform, chunk_tokens=chunk_tokens)
        values = ce

    def per_sample(values):
        return torch.zeros(t.num_samples, dtype=values.dtype, device=values.device).index_add_(0, t.sample, values)

    ce, coef, values = ce.detach(), coef.detach(), values.detach()
    return LossTerms(
        loss_sum=loss_sum,
        numerator=per_sample(coef * values),  # values: each token's loss (its cross entropy but with token_loss)
        denominator=per_sample(den),
        ce_sum=per_sample(ce),
        weight_sum=per_sample(t.weights),
        tokens=per_sample(torch.ones_like(t.labels)),
        correct=None if correct is None else per_sample(correct.long()),
    )


def _cross_entropy_terms(t: Targets, coef, factor, *, logits, hidden, lm_head, impl, accuracy, transform,
                         chunk_tokens):
    """`(sum_t c_t f_t ce_t, ce, correct or None, c_t f_t)`: each target's cross entropy by `impl`."""
    correct = None
    if impl in ("cce", "liger"):
        from sft.loss.kernels import kernel_dtype_problem

        if (problem := kernel_dtype_problem(impl, hidden.dtype, lm_head.dtype)) is not None:
            from sft.loss.kernels import warn_once

            warn_once(f"loss.impl={impl}: {problem}; using chunked (exact) for these tensors")
            impl = "chunked"
    if impl == "naive":
        selected = logits[t.rows, t.cols]
        ce = F.cross_entropy(selected.float(), t.labels, reduction="none")
        coef = coef if factor is None else coef * factor(ce.detach())
        loss_sum = (coef * ce).sum()
        if accuracy:
            correct = selected.argmax(-1) == t.labels
    elif impl == "chunked":
        from sft.loss.kernels import chunked_linear_cross_entropy

        loss_sum, ce, correct, coef = chunked_linear_cross_entropy(
            hidden[t.rows, t.cols], lm_head, t.labels, coef, chunk_tokens, accuracy, transform, factor)
    elif impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        transform = transform or LogitTransform()
        h = hidden[t.rows, t.cols]
        # filter_eps=None: every logit's gradient (its default, "auto", drops small ones: approximate)
        ce = linear_cross_entropy(h * transform.scale if transform.scale != 1.0 else h, lm_head, t.labels,
                                  softcap=transform.softcap, reduction="none", filter_eps=None).float()
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
    return loss_sum, ce, correct, coef


def _token_loss_terms(t: Targets, coef, token_loss: Callable, second: SecondOutputs | None, *, logits, hidden,
                      lm_head, impl, accuracy, transform, chunk_tokens):
    """`(sum_t c_t l_t, ce, l, correct or None)`: each target's loss `l_t` from its position's logits (and the second
    model's), all at once from the logits (`naive`), else a chunk of tokens at a time
    (`sft.loss.kernels.token_loss_chunked`; the fused kernels compute cross entropies only, and `choose_impl` picks
    neither for such a loss)."""
    from sft.loss.kernels import token_loss_chunked

    second = second.at(t) if second is not None else None
    if impl != "naive":
        return token_loss_chunked(hidden[t.rows, t.cols], lm_head, t.labels, coef, token_loss, second, chunk_tokens,
                                  accuracy, transform)
    selected = logits[t.rows, t.cols].float()
    values, ce = token_loss(selected, t.labels, second.logits_of(0, len(t.labels)) if second is not None else None)
    return (coef * values).sum(), ce, values, (selected.argmax(-1) == t.labels) if accuracy else None
