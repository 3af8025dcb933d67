"""Stop training when an eval metric has not improved for `patience` evaluations."""

from __future__ import annotations

from dataclasses import dataclass

from sft.config.schema import config_schema
from sft.training.controllers.base import MetricWatch, MetricWatchController, log, metric_value


@config_schema("controllers", "early_stopping")
@dataclass(eq=False, kw_only=True)
class EarlyStopping(MetricWatchController):
    _target_: str = "sft.training.controllers.EarlyStopping"
    name = "early_stopping"

    def __post_init__(self):
        super().__post_init__()
        self.watch = MetricWatch(self.mode, self.min_delta)
        self.stopped_at_step: int | None = None

    def should_stop(self, value: float) -> bool:
        """Record an evaluation; True once `patience` evaluations in a row brought no improvement."""
        self.watch.update(value)
        return self.watch.bad_evals >= self.patience

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = metric_value(metrics, self.metric, self.name)
        if value is not None and self.should_stop(value):
            self.stopped_at_step = state.global_step
            control.should_training_stop = True
            log.info("early stopping at step %d: %s has not improved on %.6g for %d evaluations",
                     state.global_step, self.metric, self.watch.best, self.patience)

    def results(self) -> dict:
        return {"stopped_early": bool(self.stopped_at_step)}

    def state_dict(self) -> dict:
        return {"watch": self.watch.state_dict(), "stopped_at_step": self.stopped_at_step}

    def load_state_dict(self, state: dict) -> None:
        self.watch.load_state_dict(state["watch"])
        self.stopped_at_step = state["stopped_at_step"]
