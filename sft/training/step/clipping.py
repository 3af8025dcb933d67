"""Gradient clipping policies: static, AutoClip (percentile of history) and ZClip (EMA z-score).

A policy answers `threshold(norm)`: the value the global gradient norm is clipped to this step. `norm`
is the step's pre-clip norm where the trainer knows it before clipping (plain PyTorch/DDP), or None
under DeepSpeed, where the engine clips inside its own step and the threshold is set beforehand from the
history alone. After the step the trainer reports the pre-clip norm with `observe`. Every policy's
state is a plain dict, saved in each checkpoint's `sft_state.json` and restored on resume.

A policy is one class here, its knobs its fields, and one YAML (`sft/conf/clip/<name>.yaml`). A policy of your own
subclasses `GradClipPolicy` (see docs/control.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sft.config.schema import Schema, config_schema, knob, learned_state, restore_learned_state, target_base


@target_base("clip")
@config_schema("clip", "none")
@dataclass(eq=False, kw_only=True)
class GradClipPolicy(Schema):
    """No clipping; the pre-clip norm is still tracked for the logs."""

    _target_: str = "sft.training.step.clipping.GradClipPolicy"
    name = "none"

    def __post_init__(self):
        self.steps = 0
        self.clipped_steps = 0
        self.last_threshold = math.inf
        self.last_clipped = False

    def initial_threshold(self) -> float:
        """The threshold handed to TrainingArguments.max_grad_norm (and DeepSpeed's gradient_clipping): the
        first step's, or 0 where the policy does not clip."""
        first = self.threshold(None)
        return first if math.isfinite(first) else 0.0

    def threshold(self, norm: float | None = None) -> float:
        return math.inf

    def observe(self, norm: float, threshold: float) -> None:
        """Record a finished step's pre-clip norm and the threshold that was applied."""
        self.steps += 1
        # ZClip does not clip an ordinary step (inf); the logs show the boundary it would have clipped at.
        self.last_threshold = threshold if math.isfinite(threshold) else self.threshold(None)
        self.last_clipped = norm > threshold
        self.clipped_steps += int(self.last_clipped)
        self._update(norm, min(norm, threshold))

    def _update(self, norm: float, clipped_norm: float) -> None:
        """Update the statistics with a step's pre-clip norm and the norm after clipping."""

    def log_values(self) -> dict:
        if not self.steps or not math.isfinite(self.last_threshold):  # nothing is clipped: nothing to log
            return {}
        return {
            "clip/threshold": self.last_threshold,
            "clip/clipped": float(self.last_clipped),
            "clip/clipped_fraction": self.clipped_steps / self.steps,
        }

    def state_dict(self) -> dict:
        """What a resume needs: the statistics, not the knobs (those come from the run's config)."""
        return learned_state(self)

    def load_state_dict(self, state: dict) -> None:
        restore_learned_state(self, state)


@config_schema("clip", "static")
@dataclass(eq=False, kw_only=True)
class StaticClip(GradClipPolicy):
    """Clip to `max_norm` every step."""

    _target_: str = "sft.training.step.clipping.StaticClip"
    max_norm: float = knob(1.0, "the norm the gradient is clipped to; 0 turns clipping off")
    name = "static"

    def check(self, cfg=None):
        self.require("max_norm", self.max_norm >= 0, "must be >= 0 (0 turns clipping off)")

    def threshold(self, norm: float | None = None) -> float:
        return self.max_norm if self.max_norm > 0 else math.inf


@dataclass(eq=False, kw_only=True)
class WarmupClip(StaticClip):
    """An adaptive policy: `max_norm` for the first `warmup_steps` steps, while its statistics fill."""

    warmup_steps: int = knob(10, "steps clipped at max_norm while the statistics fill")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("warmup_steps", self.warmup_steps >= 1, "must be >= 1 (the statistics need a first norm)")


@config_schema("clip", "autoclip")
@dataclass(eq=False, kw_only=True)
class AutoClip(WarmupClip):
    """AutoClip: clip to the `percentile`-th percentile of the (clipped) norms seen so far.

    The history holds pre-clip norms, as in the AutoClip paper. The first `warmup_steps` steps clip at
    `max_norm` while it fills. `history_size` bounds it (0: unbounded).
    """

    _target_: str = "sft.training.step.clipping.AutoClip"
    percentile: float = knob(10.0, "the percentile of the norms seen so far that a norm is clipped to")
    history_size: int = knob(0, "norms kept (0: the whole history)")
    name = "autoclip"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("percentile", 0 < self.percentile <= 100, "must be in (0, 100]")
        self.require("history_size", self.history_size >= 0, "must be >= 0 (0: the whole history)")

    def __post_init__(self):
        super().__post_init__()
        self.history: list[float] = []

    def threshold(self, norm: float | None = None) -> float:
        if self.steps < self.warmup_steps or not self.history:
            return self.max_norm
        ordered = sorted(self.history)
        rank = (len(ordered) - 1) * self.percentile / 100.0  # linear interpolation, as numpy.percentile
        lo = math.floor(rank)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)

    def _update(self, norm: float, clipped_norm: float) -> None:
        self.history.append(norm)
        if self.history_size and len(self.history) > self.history_size:
            del self.history[0]


@config_schema("clip", "zclip")
@dataclass(eq=False, kw_only=True)
class ZClip(WarmupClip):
    """ZClip: EMA mean and variance of the norm; a norm whose z-score exceeds `z_threshold` is clipped.

    With the current norm known, the clip value is the paper's reciprocal one, `mean + z_threshold**2 / z
    * std` (bigger spikes are pulled back further toward the mean); under DeepSpeed, where it is not
    known before the engine's step, `mean + z_threshold * std`. The first `warmup_steps` steps clip at
    `max_norm`; the mean and variance of their pre-clip norms seed the statistics. After that a norm
    enters the EMAs as clipped, so a spike cannot inflate them.
    """

    _target_: str = "sft.training.step.clipping.ZClip"
    alpha: float = knob(0.97, "the EMAs' decay")
    z_threshold: float = knob(2.5, "a norm whose z-score exceeds it is clipped")
    name = "zclip"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("alpha", 0 < self.alpha < 1, "must be in (0, 1)")
        self.require("z_threshold", self.z_threshold > 0, "must be > 0")

    def __post_init__(self):
        super().__post_init__()
        self.mean: float | None = None
        self.var = 0.0
        self.warmup_norms: list[float] = []

    def threshold(self, norm: float | None = None) -> float:
        if self.steps < self.warmup_steps or self.mean is None:
            return self.max_norm
        std = math.sqrt(self.var)
        if norm is None:
            return self.mean + self.z_threshold * std
        z = (norm - self.mean) / std if std > 0 else (math.inf if norm > self.mean else 0.0)
        if z <= self.z_threshold:
            return math.inf
        return self.mean + (self.z_threshold ** 2 / z) * std

    def _update(self, norm: float, clipped_norm: float) -> None:
        if self.mean is None:
            self.warmup_norms.append(norm)
            if len(self.warmup_norms) >= self.warmup_steps:
                n = len(self.warmup_norms)
                self.mean = sum(self.warmup_norms) / n
                self.var = sum((x - self.mean) ** 2 for x in self.warmup_norms) / n
            return
        delta = clipped_norm - self.mean
        self.mean += (1 - self.alpha) * delta
        self.var = self.alpha * (self.var + (1 - self.alpha) * delta * delta)
