"""Training controllers: Trainer callbacks with checkpointed state, built from the `controllers` node.

See `base.Controller` for the protocol and docs/control.md for adding your own. The built-ins: the guard (NaN,
spikes, divergence), the hang watchdog, early stopping, LR on plateau, a curriculum and its sampler, an adaptive
evaluation interval.

May import: `config base`, `sft.data`, `sft.loss`, `sft.model`, `sft.eval`, `training base`,
`sft.training.processes`, `sft.training.checkpoints`, `sft.training.observability`.
"""

from sft.training.controllers.adaptive_eval import AdaptiveEvalInterval
from sft.training.controllers.base import Controller, StepVerdict, build_controllers
from sft.training.controllers.curriculum import Curriculum
from sft.training.controllers.early_stopping import EarlyStopping
from sft.training.controllers.guard import TrainingGuard
from sft.training.controllers.lr_plateau import ReduceLROnPlateau
from sft.training.controllers.watchdog import HangWatchdog

__all__ = ["AdaptiveEvalInterval", "Controller", "Curriculum", "EarlyStopping", "HangWatchdog", "ReduceLROnPlateau",
           "StepVerdict", "TrainingGuard", "build_controllers"]
