"""Evaluate more often while an eval metric moves fast, less often while it is flat, within bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sft.config.schema import config_schema, knob
from sft.training.controllers.base import Controller, log, metric_value


@config_schema("controllers", "adaptive_eval")
@dataclass(eq=False, kw_only=True)
class AdaptiveEvalInterval(Controller):
    """After each evaluation: relative change above `fast` halves the interval, below `slow` doubles it."""

    _target_: str = "sft.training.controllers.AdaptiveEvalInterval"
    needs_eval_data: ClassVar[bool] = True
    metric: str = knob("eval_loss", "the eval metric watched")
    min_steps: int = knob(25, "the shortest interval, in steps")
    max_steps: int = knob(800, "the longest interval, in steps")
    fast: float = knob(0.05, "a relative change above it halves the interval")
    slow: float = knob(0.005, "a relative change below it doubles the interval")
    name = "adaptive_eval"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("min_steps", 1 <= self.min_steps <= self.max_steps, "must be >= 1 and <= max_steps")
        self.require("slow", 0 <= self.slow < self.fast, "must be >= 0 and < adaptive_eval.fast")

    def __post_init__(self):
        super().__post_init__()
        self.interval: int | None = None
        self.next_eval: int | None = None
        self.last_value: float | None = None
        self.schedule: list[dict] = []

    def next_interval(self, value: float) -> int:
        """Record an evaluation and return the number of steps until the next one."""
        if self.last_value is not None and self.last_value != 0:
            change = abs(value - self.last_value) / abs(self.last_value)
            if change > self.fast:
                self.interval = max(self.min_steps, self.interval // 2)
            elif change < self.slow:
                self.interval = min(self.max_steps, self.interval * 2)
        self.last_value = value
        return self.interval

    def on_train_begin(self, args, state, control, **kwargs):
        if self.interval is None:  # not restored from a checkpoint
            self.interval = min(max(int(args.eval_steps or self.min_steps), self.min_steps), self.max_steps)
            self.next_eval = state.global_step + self.interval

    def on_step_end(self, args, state, control, **kwargs):
        # Runs after Trainer's own flow callback: this schedule replaces `eval_steps`.
        control.should_evaluate = state.global_step >= self.next_eval

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = metric_value(metrics, self.metric, self.name)
        if value is None or self.interval is None:
            return
        before = self.interval
        self.next_eval = state.global_step + self.next_interval(value)
        self.schedule.append({"step": state.global_step, "interval": self.interval})
        if self.interval != before:
            log.info("adaptive eval: %s=%.6g, next evaluations every %d steps", self.metric, value, self.interval)

    def log_values(self) -> dict:
        return {"eval_interval": self.interval} if self.interval else {}
