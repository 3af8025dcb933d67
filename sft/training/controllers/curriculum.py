"""Difficulty curriculum: a sampler that favours hard rows through a temperature moved by eval metrics.

Rows are drawn (with replacement) with probability proportional to `exp(z / temperature)`, `z` the
row's standardised difficulty score: a high temperature is uniform sampling, a low one favours hard rows.
After each evaluation the temperature goes down by `factor` (harder share up) while `metric` (by default
the hardest difficulty bucket's eval loss) still improves by `min_delta`, and back up when it stalls.

The sampler draws in chunks of `chunk_size` rows, each from its own generator seeded by (seed, epoch,
chunk) with the temperature in force when the chunk began; those temperatures are part of the state,
so a resumed run replays exactly the rows the interrupted one drew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from sft.config.schema import config_schema, knob, restore_learned_state
from sft.training.controllers.base import Controller, MetricWatch, log, metric_value


@config_schema("controllers", "curriculum")
@dataclass(eq=False, kw_only=True)
class Curriculum(Controller):
    _target_: str = "sft.training.controllers.Curriculum"
    needs_eval_data: ClassVar[bool] = True
    needs_difficulty_score: ClassVar[bool] = True  # it orders rows by difficulty
    temperature: float = knob(4.0, "where the temperature starts: high is uniform sampling, low favours hard rows")
    min_temperature: float = knob(0.25, "the lowest temperature")
    max_temperature: float = knob(16.0, "the highest temperature")
    factor: float = knob(0.7, "the temperature times it while the metric improves, divided by it when it stalls")
    metric: str = knob("eval_loss_hardest_bucket", "the eval metric watched")
    min_delta: float = knob(0.0, "an improvement smaller than this is none")
    chunk_size: int = knob(256, "rows drawn per chunk, each chunk at the temperature in force when it began")
    name = "curriculum"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("factor", 0 < self.factor < 1, "must be in (0, 1)")
        self.require("min_temperature", 0 < self.min_temperature <= self.temperature <= self.max_temperature,
                     "must satisfy 0 < min_temperature <= temperature <= max_temperature")
        self.require("chunk_size", self.chunk_size >= 1, "must be >= 1")

    def __post_init__(self):
        super().__post_init__()
        self.watch = MetricWatch("min", self.min_delta)
        self.current_temperature = self.temperature  # `temperature` is the knob: where the schedule starts
        self.epoch = 0
        self.chunk_temperatures: dict[str, float] = {}
        self.schedule: list[dict] = []

    def temperature_for(self, epoch: int, chunk: int) -> float:
        """The temperature of a chunk: the recorded one, or the current one, recorded from now on."""
        return self.chunk_temperatures.setdefault(f"{epoch}:{chunk}", self.current_temperature)

    def move(self, value: float) -> float:
        """Record an evaluation of the watched metric and return the new temperature."""
        if self.watch.update(value):
            self.current_temperature = max(self.current_temperature * self.factor, self.min_temperature)
        else:
            self.current_temperature = min(self.current_temperature / self.factor, self.max_temperature)
        return self.current_temperature

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch = math.floor(state.epoch or 0)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = metric_value(metrics, self.metric, self.name)
        if value is None:
            return
        before = self.current_temperature
        after = self.move(value)
        self.schedule.append({"step": state.global_step, "temperature": after})
        if after != before:
            log.info("curriculum: %s=%.6g, temperature %.3g -> %.3g", self.metric, value, before, after)

    def log_values(self) -> dict:
        return {"curriculum/temperature": self.current_temperature}

    def train_sampler(self, dataset, seed: int):
        from sft.data.tokens.columns import column
        from sft.training.controllers.sampling import CurriculumSampler

        return CurriculumSampler(column(dataset, "difficulty_score"), self, seed)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["watch"] = self.watch.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.watch.load_state_dict(state.pop("watch"))
        if "current_temperature" not in state and "temperature" in state:  # saved when the two were one field
            state["current_temperature"] = state["temperature"]
        restore_learned_state(self, state)

