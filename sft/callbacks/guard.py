"""Non-finite and spiking steps: skip the update, record the rows, stop after too many in a row.

The trainer judges each optimizer step once its global gradient norm is known (`judge`). A step whose
loss or gradient norm is not finite is skipped: gradients are dropped before the optimizer step, so
parameters and optimizer state stay bit-identical, and the scheduler does not advance. A step whose loss
exceeds `spike_factor` times the running EMA of step losses is a spike: recorded, and skipped too with
`skip_spikes`. After `max_consecutive` skipped steps in a row the run saves a checkpoint and stops.
"""

from __future__ import annotations

import math

from sft.callbacks.base import Controller, log


class TrainingGuard(Controller):
    name = "guard"

    def __init__(self, max_consecutive: int = 3, spike_factor: float = 0.0, spike_ema: float = 0.9,
                 spike_warmup: int = 10, skip_spikes: bool = False):
        self.max_consecutive, self.spike_factor, self.spike_ema = max_consecutive, spike_factor, spike_ema
        self.spike_warmup, self.skip_spikes = spike_warmup, skip_spikes
        self.consecutive = 0
        self.loss_ema: float | None = None
        self.good_steps = 0
        self.skipped_steps: list[int] = []
        self.spike_steps: list[int] = []
        self.stopped_at_step: int | None = None

    def judge(self, step: int, loss: float, grad_norm: float) -> str:
        """`ok`, `nonfinite` or `spike` for a finished step; updates the counters and the loss EMA."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            verdict = "nonfinite"
        elif (self.spike_factor > 0 and self.loss_ema is not None and self.good_steps >= self.spike_warmup
              and loss > self.spike_factor * self.loss_ema):
            verdict = "spike"
            self.spike_steps.append(step)
        else:
            verdict = "ok"
        if self.skips(verdict):
            self.consecutive += 1
            self.skipped_steps.append(step)
            return verdict
        self.consecutive = 0
        self.good_steps += 1
        self.loss_ema = loss if self.loss_ema is None else self.spike_ema * self.loss_ema + (1 - self.spike_ema) * loss
        return verdict

    def skips(self, verdict: str) -> bool:
        return verdict == "nonfinite" or (verdict == "spike" and self.skip_spikes)

    def on_train_begin(self, args, state, control, **kwargs):
        self.stopped_at_step = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.consecutive >= self.max_consecutive and self.stopped_at_step is None:
            self.stopped_at_step = state.global_step
            control.should_save = True  # a resumable checkpoint of the last good parameters
            control.should_training_stop = True
            log.error("guard: %d bad steps in a row (last: step %d): stopping with a checkpoint",
                      self.consecutive, state.global_step)

    def log_values(self) -> dict:
        return {"guard/skipped_steps": len(self.skipped_steps), "guard/spikes": len(self.spike_steps)}
