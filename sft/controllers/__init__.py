"""Training controllers: Trainer callbacks with checkpointed state, built from the `controllers` node.

See `base.Controller` for the protocol and the README for adding your own.
"""

from sft.controllers.adaptive_eval import AdaptiveEvalInterval
from sft.controllers.base import Controller, StepVerdict, build_controllers
from sft.controllers.curriculum import Curriculum, CurriculumSampler
from sft.controllers.early_stopping import EarlyStopping
from sft.controllers.guard import TrainingGuard
from sft.controllers.lr_plateau import ReduceLROnPlateau
from sft.controllers.watchdog import HangWatchdog

__all__ = ["AdaptiveEvalInterval", "Controller", "Curriculum", "CurriculumSampler", "EarlyStopping",
           "HangWatchdog", "ReduceLROnPlateau", "StepVerdict", "TrainingGuard", "build_controllers"]
