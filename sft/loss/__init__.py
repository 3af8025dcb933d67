"""The loss stage: weighted token losses normalised over the whole optimizer step (`base`), the built-ins
(`builtin`), the arithmetic (`terms`), the cross-entropy kernels (`kernels`), what a model does to its logits
(`logits`), auxiliary terms (`auxiliary`) and the divergences between two models' distributions (`divergence`). A
loss of your own extends `WeightedTokenLoss`:

    from sft.loss import WeightedTokenLoss
"""

from sft.loss.auxiliary import AuxBatch, AuxTerm
from sft.loss.base import WeightedTokenLoss, build_loss
from sft.loss.builtin import (ASFTLoss, CrossEntropyLoss, DFTLoss, DistillLoss, EAFTLoss, FocalLoss, HardSampleLoss,
                              KeywordLoss, LengthLoss)

__all__ = ["ASFTLoss", "AuxBatch", "AuxTerm", "CrossEntropyLoss", "DFTLoss", "DistillLoss", "EAFTLoss", "FocalLoss",
           "HardSampleLoss", "KeywordLoss", "LengthLoss", "WeightedTokenLoss", "build_loss"]
