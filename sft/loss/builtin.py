"""The built-in losses, each a `WeightedTokenLoss` with its knobs (the schema of its `conf/loss/<name>.yaml`)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
import numpy as np
import torch
from sft.config import (CrossEntropyLossConfig, DFTLossConfig, FocalLossConfig, HardSampleLossConfig, KeywordLossConfig, LengthLossConfig)
from sft.loss.base import WeightedTokenLoss



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
