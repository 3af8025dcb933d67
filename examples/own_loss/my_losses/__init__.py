"""A loss plugin for sft, outside sft: a static weight from a column of the data, and an auxiliary term."""

from my_losses.losses import DomainWeightedLoss, GroupContrastive

__all__ = ["DomainWeightedLoss", "GroupContrastive"]
