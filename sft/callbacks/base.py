"""What every training controller shares: a Trainer callback whose decisions survive a crash.

A controller's whole state is a plain dict (`state_dict`/`load_state_dict`), written into each
checkpoint's `sft_state.json` and restored on resume, so a resumed run takes the same decisions as an
uninterrupted one. `log_values` adds its current setting to each training log.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

log = logging.getLogger("sft")


class Controller(TrainerCallback):
    name = "controller"

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)

    def log_values(self) -> dict:
        return {}


class MetricWatch:
    """Best value of a metric and the number of evaluations since it last improved by `min_delta`."""

    def __init__(self, mode: str = "min", min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: must be min or max")
        self.mode, self.min_delta = mode, min_delta
        self.best: float | None = None
        self.bad_evals = 0

    def update(self, value: float) -> bool:
        """Record a value; True when it improves on the best by more than `min_delta`."""
        better = self.best is None or (
            value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        )
        if better:
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        return better

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


def metric_value(metrics: dict | None, key: str, owner: str) -> float | None:
    """The watched metric from an evaluation, or None (with a warning) when it was not computed."""
    if not metrics or key not in metrics:
        log.warning("%s: metric %r not in this evaluation (%s)", owner, key, ", ".join(sorted(metrics or {})))
        return None
    return float(metrics[key])
