"""Training controllers: each a Trainer callback with checkpointed state (see `base.Controller`)."""

from sft.callbacks.adaptive_eval import AdaptiveEvalInterval
from sft.callbacks.base import Controller
from sft.callbacks.curriculum import Curriculum, CurriculumSampler
from sft.callbacks.early_stopping import EarlyStopping
from sft.callbacks.guard import TrainingGuard
from sft.callbacks.lr_plateau import ReduceLROnPlateau
from sft.callbacks.throughput import ThroughputMeter
from sft.callbacks.watchdog import HangWatchdog

__all__ = ["AdaptiveEvalInterval", "Controller", "Curriculum", "CurriculumSampler", "EarlyStopping",
           "HangWatchdog", "ReduceLROnPlateau", "ThroughputMeter", "TrainingGuard"]
