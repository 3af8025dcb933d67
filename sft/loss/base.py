"""Weighted token losses for causal LMs, normalised over the whole optimizer step: the interface
(`WeightedTokenLoss`, its knobs and hooks). Imports no torch (the config is composed with the losses' knobs
before anything is built); the arithmetic is `sft.loss.terms`'.

Every loss here is a ratio `sum_t c_t * ce_t / sum_t d_t` over the assistant tokens `t` of an optimizer
step: all its gradient-accumulation micro-batches on all data-parallel ranks. The trainer sums the
denominator over the step before the first forward (`normaliser`) and divides each micro-batch's
numerator by it, so gradient accumulation and the number of processes change neither the loss nor the
gradients. With `w_t` the token's weight (the batch's `weights`) and `n_i` the number of assistant tokens
of its sample:

- `weight`: c = w, d = w (weighted token mean; with equal weights exactly the token-mean CE);
- `token`:  c = w, d = 1 (weighted sum over the number of assistant tokens);
- `sample`: c = w / n_i, d = w / n_i (each sample's mean CE, averaged with the sample weights as
  weights, so long answers do not dominate).

A loss (built-in or yours) shapes this through three kinds of hooks:
- static weights, computed once at preprocessing: `sample_weight(row)` (any column of the row) times
  `token_weights(text, offsets, row)` (per token, from the rendered text) is `w_t`, in numerator and
  denominator alike, so the normalisation stays exact under accumulation and data parallelism;
- a forward-dependent factor `token_factor(ce)` `f_t` from the model's (detached) probability of the
  target: the numerator's `c_t` becomes `c_t * f_t`; the denominator, summed before any forward, keeps
  `d_t`, so the factor scales the loss and its gradient, it is not renormalised away;
- auxiliary terms (`aux`, `sft.loss.auxiliary.AuxTerm`) from the final hidden states and the batch, each
  `coef * sum of its numerators / sum of its denominators` over the step, added to the loss;
- a per-token loss read from the logits, `token_loss(logits, labels, second_logits)`, in place of the cross entropy
  where a loss needs more of a position's distribution than its target's probability (its entropy: `EAFTLoss`), or a
  second model's logits there too (`second_model`, a teacher: `DistillLoss`); still times `c_t` over `sum_t d_t`:
  per token, so exact under accumulation and data parallelism as the cross entropy is.

How the cross entropy is computed (`impl`) changes memory and speed, not values (`sft.loss.kernels`):
- `naive`: from the model's logits, as its own loss does: the whole micro-batch's logits exist at once
  (at Qwen's 152k vocabulary they, not the weights, dominate activation memory);
- `chunked`: from the final hidden states and the output projection, a chunk of assistant tokens at a
  time; the full logits never exist;
- `cce`: Apple's cut-cross-entropy kernel (GPU), which returns per-token losses we weight;
- `liger`: Liger's fused linear cross entropy with `reduction="none"` (liger-kernel 0.8.2 and later: per-token
  losses with a per-token gradient, which we weight), on a GPU; elsewhere, or with an older liger-kernel,
  `chunked` with the reason logged;
- `auto`: `liger` where usable on a GPU (cut-cross-entropy only on request: slower there, and its bf16 gradient
  further from fp32), else `chunked` on CPU or at vocabularies of 32k and more, else `naive`. `choose_impl` logs
  why a requested kernel is not used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Dict, Optional

import numpy as np
from omegaconf import MISSING

from sft.config.schema import Choice, ConfigError, Schema, knob, target_base


class Normalize(Choice):
    weight = "weight"
    token = "token"
    sample = "sample"


class Impl(Choice):
    auto = "auto"
    naive = "naive"
    chunked = "chunked"
    liger = "liger"
    cce = "cce"


@target_base("loss")
@dataclass(eq=False, kw_only=True)
class WeightedTokenLoss(Schema):
    """Base of every loss: per-token cross entropy with per-token weights and a step-global normaliser.

    Its knobs are the difficulty weight (`alpha`, `min_weight`, `max_weight`), `normalize` (`weight`, `token`,
    `sample`; see the module docstring), `impl`, `aux`. A loss of your own extends it and overrides the hooks
    it needs:

        @dataclass(eq=False, kw_only=True)
        class DomainLoss(WeightedTokenLoss):
            safety: float = 4.0
            def sample_weight(self, row):  # row: the row's columns, its difficulty weight included
                return super().sample_weight(row) * (self.safety if row.get("domain") == "safety" else 1.0)
    """

    _target_: str = MISSING
    alpha: float = knob(0.0, "difficulty weight w = clamp(difficulty_score ** alpha, min_weight, max_weight); "
                        "0: every sample 1")
    min_weight: float = knob(0.0, "the difficulty weight's floor")
    max_weight: float = knob(100.0, "the difficulty weight's ceiling")
    normalize: Normalize = knob(Normalize.weight, "weight: sum(w*ce)/sum(w) | token: sum(w*ce)/#tokens | sample: "
                                "the weighted mean of per-sample means")
    impl: Impl = knob(Impl.auto, "how the cross entropy is computed: auto | naive | chunked | liger | cce")
    chunk_tokens: int = knob(1024, "chunked: assistant tokens per chunk of logits")
    aux: Dict[str, Any] = knob(help="name -> an auxiliary term (`_target_` + its knobs, e.g. coef, "
                               "sft.loss.auxiliary.AuxTerm); logged as aux/<name>", factory=dict)

    # The second model whose logits `token_loss` reads, by its config section ("teacher"); None: none.
    second_model: ClassVar[Optional[str]] = None
    # True: the second model is read once, before training, to score the training split's tokens (`weights_of`,
    # `sft.model.reference_scores`), not at each micro-batch.
    scores_before_training: ClassVar[bool] = False

    def __post_init__(self):
        self.check()

    def check(self, cfg=None):
        if self.second_model is not None and not (self.reads_logits or self.scores_before_training):
            raise TypeError(f"{type(self).__name__} names a second model and must define token_loss or score the "
                            "data before training")
        if cfg is not None and self.loads_second_model and cfg.get(self.second_model) is None:
            raise ConfigError("", None, f"{type(self).__name__} reads a {self.second_model}'s logits and the config "
                              f"has none: add +{self.second_model}=<option> (sft/conf/{self.second_model}/), e.g. "
                              f"+{self.second_model}=path {self.second_model}.name_or_path=<its dir>")
        # (composition refuses other choices; a loss built in Python is checked here)
        self.require("impl", self.impl in Impl.values(), f"must be one of {', '.join(Impl.values())}")
        self.require("normalize", self.normalize in Normalize.values(),
                     f"must be one of {', '.join(Normalize.values())}")
        self.require("chunk_tokens", self.chunk_tokens >= 1, "must be >= 1")
        self.require("alpha", math.isfinite(self.alpha), "must be a finite number")
        self.require("min_weight", self.min_weight >= 0, "must be >= 0")
        self.require("max_weight", 0 < self.max_weight < math.inf, "must be finite and > 0")
        self.require("min_weight", self.min_weight <= self.max_weight,
                     f"must be <= loss.max_weight ({self.max_weight})")

    # --- what the data stage needs of the loss ---------------------------------------------------------------

    @property
    def reads_difficulty_score(self) -> bool:
        """Whether the sample weights read the rows' `difficulty_score` (a row without one is then refused)."""
        return self.alpha != 0

    # --- static weights: once per row at preprocessing, in numerator and denominator ------------------

    def sample_weight(self, row: Mapping) -> float:
        """The weight of a sequence's assistant tokens, from its row: `difficulty_score`, `assistant_tokens`
        (its trained tokens) and every other column of the data row. Default: the difficulty weight."""
        return self.difficulty_weight(row["difficulty_score"])

    def sample_weights(self, scores: np.ndarray, rows: Callable[[], list[Mapping]]) -> np.ndarray | list:
        """Every sequence's `sample_weight`: from the scores alone at once where the loss weighs by difficulty only
        (a million rows in a moment), else row by row (`rows()`: each sequence's columns)."""
        if type(self).sample_weight is WeightedTokenLoss.sample_weight:
            return self.difficulty_weights(scores)
        return [self.sample_weight(r) for r in rows()]

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
        adds to `WeightedTokenLoss`'s."""
        base = {f.name for f in fields(WeightedTokenLoss)}
        return {"loss": type(self).__qualname__, **{f.name: getattr(self, f.name) for f in fields(self)
                                                    if f.name not in base}}

    @property
    def has_token_weights(self) -> bool:
        return type(self).token_weights is not WeightedTokenLoss.token_weights

    # --- forward-dependent: scales the numerator only ----------------------------------------------------

    def token_factor(self, ce):
        """A factor per assistant token from its (detached) cross entropy `ce` = -log p(target) (a tensor);
        None: 1."""
        return None

    # --- a per-token loss read from the logits (and a second model's) -----------------------------------------------

    def token_loss(self, logits, labels, second_logits):
        """The per-token loss `[N]` (differentiable in `logits`) and the cross entropy `[N]`, from the model's float32
        `logits` `[N, V]` at the positions predicting `labels` `[N]`, and the second model's there (`second_model`;
        None without one). Not overridden: each token's cross entropy (times `token_factor`), by any `impl`."""
        raise NotImplementedError

    def weights_of(self, excess):
        """The static token weights a loss that scores the data before training (`scores_before_training`) makes of
        each trained token's score (a numpy array over the whole training split)."""
        raise NotImplementedError

    @property
    def reads_second_model_each_step(self) -> bool:
        """Whether the loss reads the second model's outputs on every micro-batch (the trainer holds the model, or
        a cache of its outputs: `loads_second_model`)."""
        return self.second_model is not None and not self.scores_before_training

    @property
    def loads_second_model(self) -> bool:
        """Whether the run loads the second model's weights (its config section then required); False where its
        outputs come from a cache (`DistillLoss.teacher_cache`)."""
        return self.second_model is not None

    @property
    def reads_logits(self) -> bool:
        """Whether the per-token loss is `token_loss`'s (from the logits) rather than the cross entropy."""
        return type(self).token_loss is not WeightedTokenLoss.token_loss

    # --- the step's numerator and denominator ------------------------------------------------------------

    def normaliser(self, labels, weights, position_ids=None, given=None):
        """This micro-batch's contribution to the step's denominator (needs no forward pass); `given`: its trained
        positions as the collator found them (`sft.loss.terms.select_targets`)."""
        from sft.loss.terms import coefficients, select_targets

        return coefficients(self.normalize, select_targets(labels, weights, position_ids, given))[1].sum()

    def terms(self, labels, weights, *, logits=None, hidden=None, lm_head=None, position_ids=None,
              impl: str = "naive", accuracy: bool = False, transform=None, columns=None, given=None, second=None):
        """Numerator and statistics of a micro-batch (`sft.loss.terms.LossTerms`), from the logits (`naive`) or from
        the final hidden states and the output projection's weight (`chunked`, `cce`), whose logits get `transform`
        (the model's own post-projection step, `LogitTransform.of(model.config)`); `columns`: the logits or hidden
        states are those of these positions only; `second`: the second model's outputs on the same batch
        (`sft.loss.terms.SecondOutputs`) where the loss names one (`sft.loss.terms.compute_terms`)."""
        from sft.loss.terms import compute_terms, select_targets

        factor = None if type(self).token_factor is WeightedTokenLoss.token_factor else self.token_factor
        if self.reads_second_model_each_step and second is None:
            raise ValueError(f"{type(self).__name__} reads the {self.second_model}'s outputs: pass second=")
        return compute_terms(select_targets(labels, weights, position_ids, given), self.normalize, factor, logits=logits,
                             hidden=hidden, lm_head=lm_head, impl=impl, accuracy=accuracy, transform=transform,
                             chunk_tokens=self.chunk_tokens, columns=columns,
                             token_loss=self.token_loss if self.reads_logits else None, second=second)

    def __call__(self, logits, labels, weights, position_ids=None, second_logits=None):
        """The loss of one self-contained batch (its own normaliser), e.g. for evaluation or tests; `second_logits`:
        the second model's on the same batch, where the loss reads one."""
        from sft.loss.terms import SecondOutputs

        second = SecondOutputs(logits=second_logits) if second_logits is not None else None
        terms = self.terms(labels, weights, logits=logits, position_ids=position_ids, second=second)
        return terms.loss_sum / terms.denominator.sum().clamp_min(1e-12)


def build_loss(node) -> WeightedTokenLoss:
    """The loss of a config's `loss` node, its lists and dicts plain Python ones (and its aux terms built)."""
    from hydra.utils import instantiate

    return instantiate(node, _convert_="all")
