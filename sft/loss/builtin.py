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
from typing import List, Optional

import numpy as np

from sft.config.schema import ConfigError, config_schema, knob
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
