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

import torch
from torch.utils.data import Sampler

from sft.config import CurriculumConfig, restore_learned_state
from sft.training.controllers.base import Controller, MetricWatch, log, metric_value
from sft.data.split import column


@dataclass(eq=False, kw_only=True)
class Curriculum(CurriculumConfig, Controller):
    name = "curriculum"
    needs_difficulty_score = True  # it orders rows by difficulty

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

    def train_sampler(self, dataset, seed: int) -> CurriculumSampler:
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


class CurriculumSampler(Sampler[int]):
    """Draws `len(scores)` row indices per epoch with the curriculum's difficulty-tempered probabilities."""

    def __init__(self, scores: list[float], curriculum: Curriculum, seed: int):
        self.curriculum, self.seed = curriculum, seed
        s = torch.tensor(scores, dtype=torch.float64)
        std = s.std() if len(s) > 1 else torch.tensor(0.0, dtype=torch.float64)
        self.z = (s - s.mean()) / std if std > 0 else torch.zeros_like(s)

    def __len__(self) -> int:
        return len(self.z)

    def probabilities(self, temperature: float) -> torch.Tensor:
        return torch.softmax(self.z / temperature, dim=0)

    def __iter__(self):
        epoch, n, size = self.curriculum.epoch, len(self.z), self.curriculum.chunk_size
        for chunk in range(math.ceil(n / size)):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + chunk)
            p = self.probabilities(self.curriculum.temperature_for(epoch, chunk))
            yield from torch.multinomial(p, min(size, n - chunk * size), replacement=True,
                                         generator=generator).tolist()
