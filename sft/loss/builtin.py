"""The built-in losses: each one class, its knobs and hooks, and one YAML (`sft/conf/loss/<name>.yaml`, whose `defaults`
name `<name>_schema`). A new built-in loss is a class here, decorated with `config_schema("loss", <name>)`, and its
YAML."""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, List, Optional

import numpy as np

from sft.config.schema import Choice, ConfigError, config_schema, knob
from sft.loss.base import WeightedTokenLoss


@config_schema("loss", "ce")
@dataclass(eq=False, kw_only=True)
class CrossEntropyLoss(WeightedTokenLoss):
    """Token-mean cross entropy over assistant tokens: equal to the model's own loss.

        CrossEntropyLoss()(logits, labels, weights)  ==  model(input_ids, labels=labels).loss
    """

    _target_: str = "sft.loss.builtin.CrossEntropyLoss"


@config_schema("loss", "hard_sample")
@dataclass(eq=False, kw_only=True)
class HardSampleLoss(WeightedTokenLoss):
    """Weights each sample's assistant tokens by its difficulty weight, `clamp(difficulty_score ** alpha,
    min_weight, max_weight)` (alpha 1 by default).

        rows scored 1 and 3, alpha=1  ->  the second row's tokens weigh 3 times the first's
    """

    _target_: str = "sft.loss.builtin.HardSampleLoss"
    alpha: float = knob(1.0, "difficulty weight w = clamp(difficulty_score ** alpha, min_weight, max_weight)")


@config_schema("loss", "keywords")
@dataclass(eq=False, kw_only=True)
class KeywordLoss(WeightedTokenLoss):
    """Assistant tokens that overlap an occurrence of a phrase get weight x `factor`.

        phrases=["never"], factor=3:  "You should ⟦never⟧ do that"  ->  the token(s) of "never" weigh 3, the rest 1
    """

    _target_: str = "sft.loss.builtin.KeywordLoss"
    phrases: List[str] = knob(help="assistant tokens overlapping one get weight x factor", factory=list)
    phrases_file: Optional[str] = knob(None, "more phrases, one a line (blank lines and lines starting with # "
                                       "skipped)")
    factor: float = knob(3.0, "the weight of a phrase's tokens")
    case_fold: bool = knob(True, "match phrases whatever their case")
    whole_words: bool = knob(True, "a phrase matches only where it is not part of a longer word")
    regex: bool = knob(False, "phrases are Python regular expressions")

    def check(self, cfg=None):
        super().check(cfg)
        if self.regex:
            for phrase in self.phrases:
                try:
                    re.compile(phrase)
                except re.error as e:
                    raise ConfigError("phrases", phrase, f"not a regular expression ({e})") from None
        self.require("factor", math.isfinite(self.factor) and self.factor >= 0, "must be a finite number >= 0")
        self.require("phrases_file", self.phrases_file is None or os.path.isfile(self.phrases_file), "no such file")
        self.require("phrases", bool(self.phrases) or self.phrases_file is not None,
                     "no phrase: give loss.phrases=[...] or loss.phrases_file")
        self.require("phrases", all(isinstance(p, str) and p.strip() for p in self.phrases),
                     "every phrase must be a non-empty string")

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


@config_schema("loss", "focal")
@dataclass(eq=False, kw_only=True)
class FocalLoss(WeightedTokenLoss):
    """Each token's cross entropy times `(1 - p) ** gamma`, p = exp(-ce) the model's (detached) probability
    of the target.

        ce = [0.01, 2.3] (p = 0.99, 0.10), gamma=2  ->  factors [0.0001, 0.81]
    """

    _target_: str = "sft.loss.builtin.FocalLoss"
    gamma: float = knob(2.0, "the focusing exponent: each token's loss times (1 - p) ** gamma")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("gamma", math.isfinite(self.gamma) and self.gamma >= 0, "must be a finite number >= 0")

    def token_factor(self, ce):
        return (-(-ce).expm1()) ** self.gamma  # 1 - p, exact also where p is close to 1


@config_schema("loss", "dft")
@dataclass(eq=False, kw_only=True)
class DFTLoss(WeightedTokenLoss):
    """Dynamic Fine-Tuning: each token's cross entropy times p = exp(-ce), the model's (detached)
    probability of the target.

        ce = [0.01, 2.3]  ->  factors [0.99, 0.10]
    """

    _target_: str = "sft.loss.builtin.DFTLoss"

    def token_factor(self, ce):
        return (-ce).exp()


@config_schema("loss", "length")
@dataclass(eq=False, kw_only=True)
class LengthLoss(WeightedTokenLoss):
    """A sample's weight times `(assistant_tokens / length_ref) ** -length_beta`: long answers do not
    dominate the step (with length_beta=1, each sample's tokens weigh as much together as a
    length_ref-token answer's).

        length_ref=100, length_beta=0.5: an answer of 400 tokens  ->  each of its tokens weighs 0.5
    """

    _target_: str = "sft.loss.builtin.LengthLoss"
    length_ref: float = knob(256.0, "assistant tokens at which the length factor is 1")
    length_beta: float = knob(0.5, "0: off; 1: every sample's tokens weigh as much in total as a length_ref-long "
                              "one's")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("length_ref", math.isfinite(self.length_ref) and self.length_ref > 0, "must be > 0")
        self.require("length_beta", math.isfinite(self.length_beta) and self.length_beta >= 0,
                     "must be a finite number >= 0 (0 turns the length factor off)")

    def sample_weight(self, row):
        return super().sample_weight(row) * (row["assistant_tokens"] / self.length_ref) ** -self.length_beta


@config_schema("loss", "eaft")
@dataclass(eq=False, kw_only=True)
class EAFTLoss(WeightedTokenLoss):
    """Entropy-Adaptive Fine-Tuning (Wang et al., 2026, arXiv 2601.02151): each token's cross entropy times `H **
    entropy_power`, `H` the normalised entropy of the model's (detached) distribution over its `top_k` largest logits:
    their softmax's entropy over its largest, `log(top_k)`, so 0 <= H <= 1. A token the model predicts with confidence
    and gets wrong (low entropy: the answer conflicts with what it knows) weighs little; one it is unsure of (high
    entropy: something to learn) weighs more, which keeps fine-tuning from overwriting what the model knew.
    (LLaMA-Factory's port divides by 3.0, about log 20; axolotl's by nothing.)

        top-2 logits [0, 0] (entropy log 2) and [5, 0] (0.0402), entropy_power=1  ->  factors [1.0, 0.0580]
    """

    _target_: str = "sft.loss.builtin.EAFTLoss"
    top_k: int = knob(20, "the logits whose softmax's entropy weighs a token (the authors' 20)")
    entropy_power: float = knob(1.0, "each token's cross entropy times its normalised entropy ** entropy_power (the "
                                "paper's alpha)")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("top_k", self.top_k >= 2, "must be >= 2 (one logit has no entropy)")
        self.require("entropy_power", math.isfinite(self.entropy_power) and self.entropy_power >= 0,
                     "must be a finite number >= 0 (0: the cross entropy)")

    def token_loss(self, logits, labels, second_logits):
        import torch
        import torch.nn.functional as F

        ce = F.cross_entropy(logits, labels, reduction="none")
        with torch.no_grad():
            k = min(self.top_k, logits.size(-1))
            log_p = logits.topk(k, dim=-1).values.log_softmax(-1)
            entropy = -(log_p.exp() * log_p).sum(-1) / math.log(k)
        return entropy.pow(self.entropy_power) * ce, ce


class Divergence(Choice):
    """`loss.divergence` of `DistillLoss` (`sft.loss.divergence.token_divergence`)."""

    forward = "forward"
    reverse = "reverse"
    jsd = "jsd"


@config_schema("loss", "distill")
@dataclass(eq=False, kw_only=True)
class DistillLoss(WeightedTokenLoss):
    """Knowledge distillation: each assistant token's loss is `(1 - kd_ratio) * ce + kd_ratio * D(teacher, student)`,
    `D` a divergence between the two models' next-token distributions at its position (`sft.loss.divergence`: forward
    KL, reverse KL or the skewed Jensen-Shannon), the teacher a frozen model of the same vocabulary (`+teacher=...`),
    and the token weights and normalisation every loss has on top (hard samples distilled harder with `alpha`).

        one token, student logits [0, 0], teacher [log 3, 0], label 0, kd_ratio=0.5, forward
          ->  0.5 * ce (log 2 = 0.6931) + 0.5 * KL(teacher || student) (0.1308)  =  0.4120

    Where the two models' output layers differ in width over one vocabulary, the divergence is over their shared
    columns (`sft.loss.divergence`). With `teacher_cache` (a dir `sft distill cache` wrote) the teacher is its `top_k`
    largest logits a token, read from that dir instead of a model held beside the student: its distribution
    renormalised over them, 0 elsewhere (`sft.model.teacher_cache`).
    """

    _target_: str = "sft.loss.builtin.DistillLoss"
    second_model: ClassVar[Optional[str]] = "teacher"
    divergence: Divergence = knob(Divergence.forward, "forward: KL(teacher || student), mass-covering | reverse: "
                                  "KL(student || teacher), mode-seeking | jsd: beta KL(teacher || m) + (1 - beta) "
                                  "KL(student || m)")
    kd_ratio: float = knob(0.5, "each token's loss: (1 - kd_ratio) * ce + kd_ratio * divergence (1: distillation "
                           "alone, 0: ce alone)")
    temperature: float = knob(1.0, "both distributions softened as softmax(logits / T), the divergence times T ** 2")
    beta: float = knob(0.5, "jsd: the teacher's share of the mixture m (0 < beta < 1)")
    teacher_cache: Optional[str] = knob(None, "a dir sft distill cache wrote: the teacher's top_k logits a token read "
                                        "from it, no teacher held (null: the live +teacher)")
    top_k: int = knob(64, "the teacher's largest logits a token that sft distill cache keeps, and a run reads of "
                      "them (at most what its cache holds)")

    @property
    def loads_second_model(self) -> bool:
        return self.teacher_cache is None

    def check(self, cfg=None):
        super().check(cfg)
        self.require("top_k", self.top_k >= 1, "must be >= 1")
        if self.teacher_cache is not None:
            self.require("divergence", self.divergence != Divergence.reverse, "reverse KL is not defined on a cached "
                         "teacher (its probability of a token outside its top_k is unknown, and 0 would make it "
                         "infinite): forward or jsd, or the live teacher (loss.teacher_cache=null)")
            if cfg is not None and cfg.data.get("streaming"):
                raise ConfigError("teacher_cache", self.teacher_cache, "a cache holds a split's rows in order, a "
                                  "stream has none: data.streaming=false, or the live teacher")
            if cfg is not None and cfg.get("sp") is not None and int(cfg.sp.get("size", 1)) > 1:
                raise ConfigError("teacher_cache", self.teacher_cache, "not with sequence parallelism (its slices of "
                                  "the positions are not cut from the cached logits): sp=none")
        self.require("divergence", self.divergence in Divergence.values(),
                     f"must be one of {', '.join(Divergence.values())}")
        self.require("kd_ratio", 0 <= self.kd_ratio <= 1, "must be in [0, 1]")
        self.require("temperature", math.isfinite(self.temperature) and self.temperature > 0,
                     "must be a finite number > 0")
        self.require("beta", 0 < self.beta < 1, "must be in (0, 1) (its ends are forward and reverse KL)")

    def token_loss(self, logits, labels, second_logits):
        import torch.nn.functional as F

        from sft.loss.divergence import token_divergence

        ce = F.cross_entropy(logits, labels, reduction="none")
        if self.kd_ratio == 0:
            return ce, ce
        divergence = token_divergence(logits, second_logits, str(self.divergence), self.beta, self.temperature)
        return (1 - self.kd_ratio) * ce + self.kd_ratio * divergence, ce


@config_schema("loss", "asft")
@dataclass(eq=False, kw_only=True)
class ASFTLoss(WeightedTokenLoss):
    """Anchored Supervised Fine-Tuning (Zhu et al., ICLR 2026, arXiv 2509.23753): Dynamic Fine-Tuning's loss (each
    token's cross entropy times its detached probability p, `dft`) plus `kl_weight` times KL(reference || model) over
    the vocabulary at its position, the reference a frozen model (`+reference=model`: the trained model as it starts),
    whose anchor keeps DFT's reweighting from drifting away from what the model knew.

        one token, model logits [0, 0], reference [log 3, 0], label 0, kl_weight=0.05
          ->  p * ce = 0.5 * log 2 (0.3466)  +  0.05 * KL (0.1308)  =  0.3531
    """

    _target_: str = "sft.loss.builtin.ASFTLoss"
    second_model: ClassVar[Optional[str]] = "reference"
    kl_weight: float = knob(0.05, "each token's loss: p * ce + kl_weight * KL(reference || model) (the paper's 0.05; "
                            "LLaMA-Factory's default 0.1)")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("kl_weight", math.isfinite(self.kl_weight) and self.kl_weight >= 0,
                     "must be a finite number >= 0 (0: dft)")

    def token_loss(self, logits, labels, second_logits):
        import torch.nn.functional as F

        from sft.loss.divergence import token_divergence

        ce = F.cross_entropy(logits, labels, reduction="none")
        anchor = token_divergence(logits, second_logits, "forward")
        return (-ce.detach()).exp() * ce + self.kl_weight * anchor, ce


class Selection(Choice):
    """`loss.select` of `ReferenceWeightedLoss`."""

    top = "top"
    soft = "soft"


@config_schema("loss", "reference_weighted")
@dataclass(eq=False, kw_only=True)
class ReferenceWeightedLoss(WeightedTokenLoss):
    """Reference-weighted tokens (RHO-1's selective language modelling, Lin et al., 2024, arXiv 2404.07965): each
    trained token's excess loss, its cross entropy under the model as training starts minus under a reference
    (`+reference=path`, a model fine-tuned on data you trust), scored once before training, without gradients
    (`sft.model.reference_scores`), makes its static weight: `select=top` trains the `top_ratio` of the split's
    tokens with the highest excess (weight 1, the rest 0), `select=soft` weighs each `exp(excess / temperature)`,
    normalised to a mean of 1 over the split. Static weights, so exact under accumulation and data parallelism as every
    token weight is, and shown by `sft inspect`.

        excess [2.0, -1.0, 0.5, 0.0], select=top, top_ratio=0.5  ->  weights [1, 0, 1, 0]
        excess [1.0, 0.0], select=soft, temperature=1             ->  weights [1.4621, 0.5379]   (e : 1, mean 1)

    RHO-1 compares the reference with the model as it trains and selects a batch's top tokens; here the model as it
    starts and the split's top tokens, so that the weights are exact, cached and visible (see docs/losses.md).
    """

    _target_: str = "sft.loss.builtin.ReferenceWeightedLoss"
    second_model: ClassVar[Optional[str]] = "reference"
    scores_before_training: ClassVar[bool] = True
    select: Selection = knob(Selection.top, "top: train the top_ratio of the tokens by excess loss (weight 1, the "
                             "rest 0) | soft: weight exp(excess / temperature), mean 1")
    top_ratio: float = knob(0.6, "select=top: the share of the training split's tokens trained (RHO-1's 60%)")
    temperature: float = knob(1.0, "select=soft: the weights' temperature in nats (large: all near 1)")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("select", self.select in Selection.values(), f"must be one of {', '.join(Selection.values())}")
        self.require("top_ratio", 0 < self.top_ratio <= 1, "must be in (0, 1]")
        self.require("temperature", math.isfinite(self.temperature) and self.temperature > 0,
                     "must be a finite number > 0")
        if cfg is not None and cfg.data.get("streaming"):
            raise ConfigError("", None, "ReferenceWeightedLoss scores the whole training split before training: not "
                              "with a stream (data.streaming=false)")

    def weights_of(self, excess):
        excess = np.asarray(excess, dtype=np.float64)
        if self.select == "top":
            weights = np.zeros(len(excess))
            kept = int(round(self.top_ratio * len(excess)))
            weights[np.argsort(-excess, kind="stable")[:kept]] = 1.0
            return weights
        z = np.exp((excess - excess.max(initial=0.0)) / self.temperature)
        return z / z.mean() if len(z) else z

    def describe_weights(self, excess) -> str:
        """What the weights made of `excess` are, in one line for the log."""
        excess = np.asarray(excess, dtype=np.float64)
        if not len(excess):
            return "reference weights: no trained token"
        weights = self.weights_of(excess)
        spread = f"excess loss mean {excess.mean():.3f} nats (5%: {np.quantile(excess, 0.05):.3f}, 95%: " \
                 f"{np.quantile(excess, 0.95):.3f})"
        if self.select == "top":
            kept = weights > 0
            return (f"reference weights: {int(kept.sum()):,} of {len(excess):,} trained tokens kept (top "
                    f"{self.top_ratio:.0%}: excess >= {excess[kept].min():.3f} nats); {spread}")
        return (f"reference weights: exp(excess / {self.temperature:g}), mean 1, from {weights.min():.3g} to "
                f"{weights.max():.3g} over {len(excess):,} trained tokens; {spread}")
