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

A loss (`WeightedTokenLoss`, built-in or yours) shapes this through three kinds of hooks:
- static weights, computed once at preprocessing: `sample_weight(row)` (any column of the row) times
  `token_weights(text, offsets, row)` (per token, from the rendered text) is `w_t`, in numerator and
  denominator alike, so the normalisation stays exact under accumulation and data parallelism;
- a forward-dependent factor `token_factor(ce)` `f_t` from the model's (detached) probability of the
  target: the numerator's `c_t` becomes `c_t * f_t`; the denominator, summed before any forward, keeps
  `d_t`, so the factor scales the loss and its gradient, it is not renormalised away;
- auxiliary terms (`aux`, `AuxTerm`) from the final hidden states and the batch, each `coef * sum of its
  numerators / sum of its denominators` over the step, added to the loss.

How the cross entropy is computed (`impl`) changes memory and speed, not values:
- `naive`: from the model's logits, as its own loss does: the whole micro-batch's logits exist at once
  (at Qwen's 152k vocabulary they, not the weights, dominate activation memory);
- `chunked`: from the final hidden states and the output projection, a chunk of assistant tokens at a
  time (`chunked_linear_cross_entropy`); the full logits never exist;
- `cce`: Apple's cut-cross-entropy kernel (GPU), which returns per-token losses we weight;
- `liger`: Liger's fused linear cross entropy with `reduction="none"` (liger-kernel 0.8.2 and later: per-token
  losses with a per-token gradient, which we weight), on a GPU; elsewhere, or with an older liger-kernel,
  `chunked` with the reason logged;
- `auto`: `cce` where usable on a GPU, else `chunked` on CPU or at vocabularies of 32k and
  more, else `naive`. `choose_impl` logs why a requested kernel is not used.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from sft.batch import IGNORE_INDEX, sample_index
from sft.config import (LOSS_IMPLS, ConfigError, CrossEntropyLossConfig, DFTLossConfig, FocalLossConfig,
                        HardSampleLossConfig, KeywordLossConfig, LengthLossConfig, LossConfig)

LARGE_VOCAB = 32768  # from here on `auto` never materialises the logits

log = logging.getLogger("sft")


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its logits after the output projection, which a loss from the hidden states
    must repeat: `z * scale`, then, with a `softcap` c, `c * tanh(z / c)`.

        LogitTransform.of(Gemma2Config())    ->  LogitTransform(scale=1.0, softcap=30.0)  (final_logit_softcapping)
        LogitTransform.of(CohereConfig())    ->  LogitTransform(scale=0.0625, softcap=None)  (logit_scale)
        LogitTransform.of(GraniteConfig(logits_scaling=8.0))  ->  LogitTransform(scale=0.125, softcap=None)
    """

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> LogitTransform:
        """The transform a transformers config asks for (the attributes its modelling code applies)."""
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        if getattr(config, "logits_scaling", None):
            scale /= float(config.logits_scaling)
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(scale, float(softcap) if softcap else None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def router_aux_loss_coef(config) -> float:
    """The weight of a mixture of experts' router load-balancing loss in the model's own objective; 0 when
    its config does not ask for the loss (`output_router_logits`).

    The model computes the loss (`outputs.aux_loss`) on every forward with `output_router_logits`, but adds
    it to its own loss only when given `labels`, which a weighted loss does not pass: the trainer adds it.

        router_aux_loss_coef(Qwen3MoeConfig(output_router_logits=True))  ->  0.001
        router_aux_loss_coef(Qwen3MoeConfig())                           ->  0.0
    """
    if not getattr(config, "output_router_logits", False):
        return 0.0
    for name in ("router_aux_loss_coef", "aux_loss_coef"):  # JetMoE names it aux_loss_coef
        if getattr(config, name, None) is not None:
            return float(getattr(config, name))
    raise ConfigError("model.config_overrides.output_router_logits", True,
                      f"{type(config).__name__} has no router_aux_loss_coef: the router loss's weight is unknown")


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
    (`sft.batch.sample_index`).
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


@dataclass(eq=False, kw_only=True)
class CrossEntropyLoss(CrossEntropyLossConfig, WeightedTokenLoss):
    """Token-mean cross entropy over assistant tokens: equal to the model's own loss.

        CrossEntropyLoss()(logits, labels, loss_weights)  ==  model(input_ids, labels=labels).loss
    """


@dataclass(eq=False, kw_only=True)
class HardSampleLoss(HardSampleLossConfig, WeightedTokenLoss):
    """Weights each sample's assistant tokens by its difficulty weight, `clamp(difficulty_score ** alpha,
    min_weight, max_weight)` (alpha 1 by default).

        rows scored 1 and 3, alpha=1  ->  the second row's tokens weigh 3 times the first's
    """


@dataclass(eq=False, kw_only=True)
class KeywordLoss(KeywordLossConfig, WeightedTokenLoss):
    """Assistant tokens that overlap an occurrence of a phrase get weight x `factor`.

        phrases=["never"], factor=3:  "You should ⟦never⟧ do that"  ->  the token(s) of "never" weigh 3, the rest 1
    """

    def __post_init__(self):
        super().__post_init__()
        phrases = list(self.phrases)
        if self.phrases_file is not None:
            lines = Path(self.phrases_file).read_text(encoding="utf-8").splitlines()
            phrases += [p.strip() for p in lines if p.strip() and not p.lstrip().startswith("#")]
        patterns = sorted((p if self.regex else re.escape(p) for p in phrases), key=len, reverse=True)
        edge = (r"(?<!\w)", r"(?!\w)") if self.whole_words else ("", "")
        self._pattern = re.compile("|".join(f"{edge[0]}(?:{p}){edge[1]}" for p in patterns),
                                   re.IGNORECASE if self.case_fold else 0)
        self._phrase_count = len(phrases)

    def token_weights(self, text, offsets, row):
        weights = np.ones(len(offsets), dtype=np.float32)
        starts, ends = offsets[:, 0], offsets[:, 1]
        for match in self._pattern.finditer(text):
            if match.end() > match.start():
                weights[(starts < match.end()) & (ends > match.start())] = self.factor
        return weights

    def token_weight_identity(self) -> dict:
        """The phrases as matched (the file's content, not its path), the factor and the matching rules."""
        identity = super().token_weight_identity()
        identity.pop("phrases_file")
        identity["pattern"] = hashlib.sha256(self._pattern.pattern.encode()).hexdigest()[:16]
        return identity


@dataclass(eq=False, kw_only=True)
class FocalLoss(FocalLossConfig, WeightedTokenLoss):
    """Each token's cross entropy times `(1 - p) ** gamma`, p = exp(-ce) the model's (detached) probability
    of the target.

        ce = [0.01, 2.3] (p = 0.99, 0.10), gamma=2  ->  factors [0.0001, 0.81]
    """

    def token_factor(self, ce):
        return (-torch.expm1(-ce)) ** self.gamma  # 1 - p, exact also where p is close to 1


@dataclass(eq=False, kw_only=True)
class DFTLoss(DFTLossConfig, WeightedTokenLoss):
    """Dynamic Fine-Tuning: each token's cross entropy times p = exp(-ce), the model's (detached)
    probability of the target.

        ce = [0.01, 2.3]  ->  factors [0.99, 0.10]
    """

    def token_factor(self, ce):
        return torch.exp(-ce)


@dataclass(eq=False, kw_only=True)
class LengthLoss(LengthLossConfig, WeightedTokenLoss):
    """A sample's weight times `(assistant_tokens / length_ref) ** -length_beta`: long answers do not
    dominate the step (with length_beta=1, each sample's tokens weigh as much together as a
    length_ref-token answer's).

        length_ref=100, length_beta=0.5: an answer of 400 tokens  ->  each of its tokens weighs 0.5
    """

    def sample_weight(self, row):
        return super().sample_weight(row) * (row["assistant_tokens"] / self.length_ref) ** -self.length_beta


def build_loss(node) -> WeightedTokenLoss:
    """The loss of a config's `loss` node, its lists and dicts plain Python ones (and its aux terms built)."""
    from hydra.utils import instantiate

    return instantiate(node, _convert_="all")


@dataclass
class AuxBatch:
    """What an auxiliary term sees of a micro-batch besides the hidden states: the labels and loss weights,
    `position_ids` of a packed batch, and each sequence's `values` (its `AuxTerm.row_value`, [sequences])."""

    labels: torch.Tensor
    loss_weights: torch.Tensor
    position_ids: torch.Tensor | None
    values: torch.Tensor

    def targets(self) -> Targets:
        """The assistant tokens and the positions predicting them, with each one's sequence (`Targets`)."""
        return select_targets(self.labels, self.loss_weights, self.position_ids)


class AuxTerm:
    """An auxiliary term of a loss (`loss.aux.<name>`), added as `coef * sum of numerators / sum of
    denominators` over the optimizer step (all micro-batches, all ranks), as the main loss is; logged as
    `aux/<name>` without the coef. A term of your own overrides the three methods (see `examples/`).
    """

    coef: float = 1.0

    def row_value(self, row: Mapping) -> float:
        """A number per sequence computed at preprocessing from its row (e.g. a group id): `AuxBatch.values`."""
        return 0.0

    def denominator(self, batch: AuxBatch) -> torch.Tensor:
        """This micro-batch's share of the step's denominator (before any forward pass)."""
        raise NotImplementedError

    def numerator(self, hidden: torch.Tensor, batch: AuxBatch) -> torch.Tensor:
        """This micro-batch's share of the step's numerator, differentiable, from the final hidden states
        [rows, positions, hidden]."""
        raise NotImplementedError


# --- the memory-lean cross entropy -------------------------------------------------------------------


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t coef_t * f_t * CE(transform(hidden_t @ weight.T), label_t), a chunk of tokens at a time, with
    f_t = factor(ce_t) a detached per-token factor (1 without one).

    The gradients are computed chunk by chunk in the forward pass, while each chunk's logits exist (as
    Liger's fused linear cross entropy does): the backward only scales them, so nothing is recomputed and
    at most one chunk of logits is ever held. The loss is linear in what the backward receives, so this is
    exact for any upstream gradient. Every chunk reuses one logits buffer and works on it in place: a new
    buffer per chunk would cost fresh pages from the OS each time on CPU.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, coef, chunk_tokens, accuracy, transform, factor):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale, softcap = transform.scale, transform.softcap
        n = hidden.size(0)
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        coef = coef.clone() if factor is not None else coef  # becomes coef * factor, chunk by chunk
        correct = torch.empty(n, dtype=torch.bool, device=hidden.device) if accuracy else None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        # Project in the hidden states' dtype, as autocast would (bf16 activations over fp32 master weights).
        weight_in = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        rows = min(chunk_tokens, n)
        buffer = torch.empty(rows, weight.size(0), dtype=hidden.dtype, device=hidden.device)
        buffer32 = buffer if hidden.dtype == torch.float32 else torch.empty_like(buffer, dtype=torch.float32)
        capped = torch.empty_like(buffer32) if softcap and (need_hidden or need_weight) else None
        autocast_off = torch.autocast(hidden.device.type, enabled=False)
        autocast_off.__enter__()
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            h, y = hidden[start:end], labels[start:end]
            logits = torch.mm(h, weight_in.T, out=buffer[: end - start])
            if logits.dtype != torch.float32:
                logits = buffer32[: end - start].copy_(logits)
            if scale != 1.0:
                logits.mul_(scale)
            if softcap:  # t = c * tanh(z / c), whose derivative 1 - tanh^2 the gradient needs below
                logits.div_(softcap).tanh_()
                if capped is not None:
                    capped[: end - start].copy_(logits)
                logits.mul_(softcap)
            if accuracy:
                correct[start:end] = logits.argmax(-1) == y
            target = logits.gather(1, y[:, None]).squeeze(1)
            top = logits.amax(-1)
            probs = logits.sub_(top[:, None]).exp_()  # in place: the logits become unnormalised probabilities
            total = probs.sum(-1)
            ce[start:end] = top + total.log() - target
            if factor is not None:
                coef[start:end] *= factor(ce[start:end])
            if need_hidden or need_weight:
                probs.mul_((coef[start:end] / total)[:, None])  # coef * softmax
                probs[torch.arange(end - start, device=y.device), y] -= coef[start:end]  # minus coef * one-hot
                if capped is not None:  # back through the softcap, then the scale
                    probs.mul_(capped[: end - start].square_().neg_().add_(1.0))
                if scale != 1.0:
                    probs.mul_(scale)
                grad_logits = probs if hidden.dtype == torch.float32 else buffer[: end - start].copy_(probs)
                if need_hidden:
                    torch.mm(grad_logits, weight_in, out=grad_hidden[start:end])
                if need_weight:
                    grad_weight.addmm_(probs.T, h.float())
        autocast_off.__exit__(None, None, None)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        if accuracy:
            ctx.mark_non_differentiable(ce, correct, coef)
        else:
            ctx.mark_non_differentiable(ce, coef)
        return (coef * ce).sum(), ce, correct, coef

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct, _grad_coef):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 coef: torch.Tensor, chunk_tokens: int = 1024, accuracy: bool = False,
                                 transform: LogitTransform | None = None, factor: Callable | None = None):
    """`(sum_t c_t * ce_t, ce [N], correct [N] or None, c [N])` for hidden states [N, H] and a projection
    weight [V, H], the logits `transform(hidden @ weight.T)`, without ever holding more than
    `chunk_tokens` rows of logits; `c = coef * factor(ce)` (detached), or `coef` without a factor."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, coef.float(), chunk_tokens, accuracy,
                                            transform or LogitTransform(), factor)


def choose_impl(requested: str, *, vocab_size: int, on_gpu: bool, zero3_trainable_head: bool = False) -> str:
    """The implementation to run for `loss.impl=requested`, logging why a requested one is not used."""
    if requested not in LOSS_IMPLS:
        raise ConfigError("loss.impl", requested, f"must be one of {', '.join(LOSS_IMPLS)}")
    # DeepSpeed ZeRO-3 updates a sharded lm_head only through its module's own forward and backward.
    lean = "naive" if zero3_trainable_head else "chunked"
    if requested == "cce" or (requested == "auto" and on_gpu):
        problem = ("needs a CUDA GPU" if not on_gpu else "the lm_head is trainable and sharded by ZeRO-3"
                   if zero3_trainable_head else _cce_problem())
        if problem is None:
            return "cce"
        if requested == "cce":
            log.warning("loss.impl=cce: %s; using %s", problem, lean)
            return lean
    if requested == "liger":
        problem = ("needs a CUDA GPU" if not on_gpu else "the lm_head is trainable and sharded by ZeRO-3"
                   if zero3_trainable_head else _liger_problem())
        if problem is None:
            return "liger"
        log.warning("loss.impl=liger: %s; using %s", problem, lean)
        return lean
    if requested == "chunked" and zero3_trainable_head:
        log.warning("loss.impl=chunked: the lm_head is trainable and sharded by ZeRO-3, which updates it only "
                    "through its module's own forward; using naive (with LoRA the lm_head is frozen and chunked works)")
    if requested == "auto":
        return lean if not on_gpu or vocab_size >= LARGE_VOCAB else "naive"
    return lean if requested == "chunked" else requested


def _cce_problem() -> str | None:
    """Why cut-cross-entropy cannot give per-token losses here, or None if it can."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as e:  # not installed, or it fails to import (no triton ...)
        return f"cut-cross-entropy is not usable ({type(e).__name__}: {e})"
    if "reduction" not in inspect.signature(linear_cross_entropy).parameters:
        return "this cut-cross-entropy has no reduction='none' (per-token losses), which the weights need"
    return None


LIGER_PER_TOKEN = (0, 8, 2)  # the first liger-kernel whose reduction="none" has a per-token gradient


def _liger_problem() -> str | None:
    """Why Liger's fused linear cross entropy cannot give weighted per-token losses here, or None if it can.
    Before 0.8.2 its backward scaled a gradient computed in the forward by one scalar, which per-token
    weights would make wrong."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("liger-kernel")
    except PackageNotFoundError:
        return "liger-kernel is not installed (pip install 'liger-kernel>=0.8.2')"
    numbers = tuple(int(part) for part in re.findall(r"\d+", found)[:3])
    if numbers < LIGER_PER_TOKEN:
        return (f"liger-kernel {found} scales the gradient it computes in the forward by one scalar, so per-token "
                "weights would get a wrong gradient (0.8.2 and later compute a per-token one)")
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as e:  # it fails to import (no triton ...)
        return f"liger-kernel {found} is not usable ({type(e).__name__}: {e})"
    if "reduction" not in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        return f"liger-kernel {found} has no reduction='none' (per-token losses)"
    return None