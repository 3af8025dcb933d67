"""The controller protocol: a Trainer callback whose decisions survive a crash, its knobs its fields.

A controller is an entry of the `controllers` config node (`sft/conf/controllers/<name>.yaml`, switched on
with `+controllers=<name>`), built by `build_controllers` and added to the Trainer's callbacks. Besides
Trainer's events (`on_evaluate`, `on_step_end` ...) the trainer and the recipe reach it only through:

- `state_dict` / `load_state_dict`: its whole state as a plain dict, written into each checkpoint's
  `sft_state.json` and restored on resume, so a resumed run takes the same decisions;
- `log_values`: its current setting, added to each training log;
- `judge_step`: an optional verdict on each optimizer step once its loss and gradient norm are known
  (`sft.training.step.control`): a `StepVerdict` can skip the update and asks for a report of the step's rows;
- `requests_stop` / `stop_agreed`: this rank asks the run to stop after the current step (preemption's signal);
  every rank learns whether any rank asked in the step's one all-reduce, and each controller that asks is told
  (`stop_agreed`, on every rank, before the optimizer step) so that all ranks stop at the same step;
- `train_sampler`: an optional sampler for the training rows (one controller at most provides one);
- `results`: values for `results.json`: `stopped_early`, or fields of its own (`sft.experiments.results`);
- `failure`: why the run must end as failed once training stopped (exit code 1), or None.

A controller is one class (a dataclass subclass of `Controller`, its knobs its fields, `knob(...)` with their help)
and one YAML file (`sft/conf/controllers/<name>.yaml`); a built-in one is also decorated with
`config_schema("controllers", <name>)`. See docs/control.md.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING

from sft.config.schema import Choice, ConfigError, Schema, knob, learned_state, restore_learned_state, target_base
from sft.training.callbacks import Callback

log = logging.getLogger("sft")


class Mode(Choice):
    min = "min"
    max = "max"


@dataclass(frozen=True)
class StepVerdict:
    """A controller's judgement of a finished optimizer step that is not ok."""

    kind: str  # what went wrong, e.g. "nonfinite" or "spike"
    skip: bool  # drop the step's update: parameters, optimizer state and schedule stay as they are
    folder: str  # the run dir's folder for the step's report, e.g. "nan_batches"
    summary: str  # for the log line, e.g. "non-finite loss or gradient"


@target_base("controllers.*")
@dataclass(eq=False, kw_only=True)
class Controller(Callback, Schema):
    """Base of every controller; each method below is a no-op unless a controller needs it."""

    _target_: str = MISSING
    name: ClassVar[str] = "controller"  # for log lines
    needs_difficulty_score: ClassVar[bool] = False  # True: every training row must have a difficulty_score
    needs_eval_data: ClassVar[bool] = False  # True: it acts on evaluation metrics

    def __post_init__(self):
        """Set up the state that is not a knob (the knobs are the fields)."""

    def check(self, cfg=None):
        if self.needs_eval_data and cfg is not None:
            self.require("", cfg.data.eval_file is not None or any(e.eval_file for e in cfg.data.mixture),
                         "needs evaluation data (data.eval_file)")
            self.require("", cfg.trainer.eval_strategy != "no", "needs evaluations: trainer.eval_strategy=no "
                         "turns them off")

    def state_dict(self) -> dict:
        """What a resume needs: the learned state, not the knobs (those come from the run's config)."""
        return learned_state(self)

    def load_state_dict(self, state: dict) -> None:
        restore_learned_state(self, state)

    def log_values(self) -> dict:
        return {}

    def judge_step(self, step: int, loss: float, grad_norm: float) -> StepVerdict | None:
        """A verdict on a finished step (mean loss over ranks, global pre-clip gradient norm); None: ok."""
        return None

    def requests_stop(self) -> bool:
        """Whether this rank asks every rank to stop after the current optimizer step."""
        return False

    def stop_agreed(self, step: int) -> None:
        """Some rank asked to stop after optimizer step `step` (called on every rank, before its optimizer step)."""

    def train_sampler(self, dataset, seed: int):
        """A `torch.utils.data.Sampler` over the training rows, or None to keep Trainer's."""
        return None

    def results(self) -> dict:
        """Fields of `results.json` this controller decides: `stopped_early`, or names of its own (JSON values)."""
        return {}

    def failure(self) -> str | None:
        """Why the run failed, once training has stopped (the message for the user), or None."""
        return None


def implements(controller: Controller, method: str) -> bool:
    """Whether a controller's class has its own `method` of the protocol (not the base's no-op)."""
    return getattr(type(controller), method) is not getattr(Controller, method)


def build_controllers(nodes) -> dict[str, Controller]:
    """Every non-null entry of the `controllers` node, built with `hydra.utils.instantiate`."""
    from hydra.utils import instantiate

    controllers = {}
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        controller = instantiate(node, _convert_="all")
        if not isinstance(controller, Controller):
            raise ConfigError(f"controllers.{name}._target_", node.get("_target_"),
                              "must build an sft.training.controllers.Controller (a Trainer callback with state)")
        controllers[name] = controller
    samplers = [name for name, c in controllers.items() if implements(c, "train_sampler")]
    if len(samplers) > 1:
        raise ConfigError("controllers", None, f"{' and '.join(samplers)} both choose the training rows; keep one")
    return controllers


@dataclass(eq=False, kw_only=True)
class MetricWatchController(Controller):
    """A controller that watches an eval metric for improvement: the knobs they share."""

    needs_eval_data: ClassVar[bool] = True
    metric: str = knob("eval_loss", "the eval metric watched")
    patience: int = knob(3, "evaluations without improvement it waits")
    min_delta: float = knob(0.0, "an improvement smaller than this is none")
    mode: Mode = knob(Mode.min, "min: lower is better | max")

    def check(self, cfg=None):
        super().check(cfg)
        self.require("patience", self.patience >= 1, "must be >= 1")
        if not (self.metric in EVAL_METRICS or self.metric.startswith(EVAL_METRIC_PREFIXES)
                or re.fullmatch(r"eval_loss_bucket_\d+", self.metric)):
            import difflib

            close = difflib.get_close_matches(self.metric, EVAL_METRICS, n=1, cutoff=0.6)
            raise ConfigError("metric", self.metric, "not a metric an evaluation reports (" + ", ".join(EVAL_METRICS)
                              + ", eval_loss_bucket_<k>, eval_loss_task_<task>, eval_ce_task_<task>, eval_gen/..., "
                              "eval_harness/...)" + (f"; did you mean {close[0]}?" if close else "") + ": it would "
                              "never be seen, and never act")


# What every evaluation reports (sft.training.trainer), and the prefixes of what some report (per task, generation
# samples, benchmarks): a watched metric must be one of them.
EVAL_METRICS = ("eval_loss", "eval_ce", "eval_token_accuracy", "eval_loss_hardest_bucket")
EVAL_METRIC_PREFIXES = ("eval_loss_task_", "eval_ce_task_", "eval_gen/", "eval_harness/")


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

    def state_dict(self) -> dict:  # mode and min_delta are knobs: the resumed run's config sets them
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad_evals = state["best"], state["bad_evals"]


def metric_value(metrics: dict | None, key: str, owner: str) -> float | None:
    """The watched metric from an evaluation, or None (with a warning) when it was not computed."""
    if not metrics or key not in metrics:
        log.warning("%s: metric %r not in this evaluation (%s)", owner, key, ", ".join(sorted(metrics or {})))
        return None
    return float(metrics[key])
