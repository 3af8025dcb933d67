"""A controller of your own, outside sft: stop once the training loss is below a target (see README.md)."""

from dataclasses import dataclass

from sft.config import knob
from sft.training.controllers import Controller


@dataclass(eq=False, kw_only=True)
class StopAtLoss(Controller):
    """Stops training once the logged training loss is below `target`; `results.json` gets the step."""

    _target_: str = "my_controllers.StopAtLoss"
    target: float = knob(1.0, "the training loss to reach")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("target", self.target > 0, "must be > 0")

    def __post_init__(self):
        self.reached_at = None  # learned state: saved in every checkpoint, restored on resume

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.reached_at is None and (logs or {}).get("loss", float("inf")) < self.target:
            self.reached_at = state.global_step
            control.should_training_stop = True

    def results(self):
        return {"reached_target_at": self.reached_at}
