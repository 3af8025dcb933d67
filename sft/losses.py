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

How the cross entropy is computed (`impl`) changes memory and speed, not values:
- `naive`: from the model's logits, as its own loss does: the whole micro-batch's logits exist at once
  (at Qwen's 152k vocabulary they, not the weights, dominate activation memory);
- `chunked`: from the final hidden states and the output projection, a chunk of assistant tokens at a
  time (`chunked_linear_cross_entropy`); the full logits never exist;
- `cce`: Apple's cut-cross-entropy kernel (GPU), which returns per-token losses we weight;
- `liger`: Liger's fused linear cross entropy; no released version takes per-token weights, so it falls
  back to `chunked` with the reason logged;
- `auto`: `cce` where usable on a GPU, else `chunked` on CPU or at vocabularies of 32k and
  more, else `naive`. `choose_impl` logs why a requested kernel is not used.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sft.batch import IGNORE_INDEX, sample_index
from sft.config import LOSS_IMPLS, ConfigError, CrossEntropyLossConfig, HardSampleLossConfig

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


class WeightedTokenLoss:
    """Base class: per-token cross entropy with per-token weights and a step-global normaliser.

    A loss's knobs, defaults and checks are its schema's (`sft.config.*LossConfig`), which each loss
    class extends; `normalize` is one of `weight`, `token`, `sample` (see the module docstring).
    """

    normalize = "weight"
    impl = "auto"
    chunk_tokens = 1024

    def __post_init__(self):
        self.check()

    def sample_weight(self, difficulty_score: float) -> float:
        """The loss weight of a sample's assistant tokens."""
        return 1.0

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
        correct = None
        if impl == "naive":
            selected = logits[t.rows, t.cols]
            ce = F.cross_entropy(selected.float(), t.labels, reduction="none")
            loss_sum = (coef * ce).sum()
            if accuracy:
                correct = selected.argmax(-1) == t.labels
        elif impl == "chunked":
            loss_sum, ce, correct = chunked_linear_cross_entropy(
                hidden[t.rows, t.cols], lm_head, t.labels, coef, self.chunk_tokens, accuracy, transform)
        elif impl == "cce":
            from cut_cross_entropy import linear_cross_entropy

            transform = transform or LogitTransform()
            h = hidden[t.rows, t.cols]
            ce = linear_cross_entropy(h * transform.scale if transform.scale != 1.0 else h, lm_head, t.labels,
                                      softcap=transform.softcap, reduction="none").float()
            loss_sum = (coef * ce).sum()
        else:
            raise ValueError(f"loss impl {impl!r}: terms() takes naive, chunked or cce (see choose_impl)")

        def per_sample(values):
            return torch.zeros(t.num_samples, dtype=values.dtype, device=values.device).index_add_(0, t.sample, values)

        ce = ce.detach()
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
    """Weights each sample's assistant tokens by `clamp(difficulty_score ** alpha, min_weight, max_weight)`.

        HardSampleLoss(alpha=2, max_weight=10).sample_weight(3.0)  ->  9.0   (and 10.0 for a score of 4)
    """

    def sample_weight(self, difficulty_score: float) -> float:
        try:
            w = float(difficulty_score) ** self.alpha
        except ZeroDivisionError:  # 0 ** negative alpha: infinitely easy, clamped below
            w = float("inf")
        return min(max(w, self.min_weight), self.max_weight)


# --- the memory-lean cross entropy -------------------------------------------------------------------


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t coef_t * CE(transform(hidden_t @ weight.T), label_t), a chunk of tokens at a time.

    The gradients are computed chunk by chunk in the forward pass, while each chunk's logits exist (as
    Liger's fused linear cross entropy does): the backward only scales them, so nothing is recomputed and
    at most one chunk of logits is ever held. The loss is linear in what the backward receives, so this is
    exact for any upstream gradient. Every chunk reuses one logits buffer and works on it in place: a new
    buffer per chunk would cost fresh pages from the OS each time on CPU.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, coef, chunk_tokens, accuracy, transform):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale, softcap = transform.scale, transform.softcap
        n = hidden.size(0)
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
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
            ctx.mark_non_differentiable(ce, correct)
        else:
            ctx.mark_non_differentiable(ce)
        return (coef * ce).sum(), ce, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 coef: torch.Tensor, chunk_tokens: int = 1024, accuracy: bool = False,
                                 transform: LogitTransform | None = None):
    """`(sum_t coef_t * ce_t, ce [N], correct [N] or None)` for hidden states [N, H] and a projection
    weight [V, H], the logits `transform(hidden @ weight.T)`, without ever holding more than
    `chunk_tokens` rows of logits."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, coef.float(), chunk_tokens, accuracy,
                                            transform or LogitTransform())


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
        log.warning("loss.impl=liger: %s; using %s", _liger_problem(), lean)
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


def _liger_problem() -> str:
    """Why Liger's fused linear cross entropy cannot take per-token weights (checked up to liger-kernel 0.6)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = f"liger-kernel {version('liger-kernel')}"
    except PackageNotFoundError:
        return "liger-kernel is not installed (and its fused linear cross entropy takes no per-token weights)"
    return (f"{found}: its fused linear cross entropy weights classes (ce_weight), not tokens, and scales the "
            "gradient it computes in the forward by one scalar, so per-token weights would get a wrong gradient")
