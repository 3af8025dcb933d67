"""Reduce the learning rate when an eval metric plateaus, on top of the configured scheduler.

The scheduler keeps its shape (warmup, cosine ...); each reduction multiplies its base learning rates,
and the optimizer's current ones, by `factor`, never below `min_lr`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sft.config.schema import config_schema, knob
from sft.training.controllers.base import MetricWatch, MetricWatchController, log, metric_value


@config_schema("controllers", "lr_plateau")
@dataclass(eq=False, kw_only=True)
class ReduceLROnPlateau(MetricWatchController):
    _target_: str = "sft.training.controllers.ReduceLROnPlateau"
    patience: int = knob(2, "evaluations without improvement before a reduction")
    factor: float = knob(0.5, "each reduction multiplies the learning rates by it")
    min_lr: float = knob(0.0, "the learning rate is never reduced below it")
    name = "lr_plateau"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("factor", 0 < self.factor < 1, "must be in (0, 1)")

    def __post_init__(self):
        super().__post_init__()
        self.watch = MetricWatch(self.mode, self.min_delta)
        self.scale = 1.0
        self.reductions: list[dict] = []

    def should_reduce(self, value: float) -> bool:
        """Record an evaluation; True when `patience` evaluations in a row brought no improvement."""
        self.watch.update(value)
        if self.watch.bad_evals >= self.patience:
            self.watch.bad_evals = 0
            return True
        return False

    def on_evaluate(self, args, state, control, metrics=None, lr_scheduler=None, optimizer=None, **kwargs):
        value = metric_value(metrics, self.metric, self.name)
        if value is None or not self.should_reduce(value):
            return
        if lr_scheduler is not None and hasattr(lr_scheduler, "base_lrs"):
            lr_scheduler.base_lrs = [max(lr * self.factor, self.min_lr) for lr in lr_scheduler.base_lrs]
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["lr"] = max(group["lr"] * self.factor, self.min_lr)
        self.scale *= self.factor
        self.reductions.append({"step": state.global_step, "metric": value, "scale": self.scale})
        log.info("lr plateau at step %d: %s=%.6g, no improvement for %d evaluations: learning rate x%g (now x%g)",
                 state.global_step, self.metric, value, self.patience, self.factor, self.scale)

    def log_values(self) -> dict:
        return {"lr_plateau/scale": self.scale}

    def state_dict(self) -> dict:
        return {"watch": self.watch.state_dict(), "scale": self.scale, "reductions": self.reductions}

    def load_state_dict(self, state: dict) -> None:
        self.watch.load_state_dict(state["watch"])
        self.scale, self.reductions = state["scale"], state["reductions"]
