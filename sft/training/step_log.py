"""What a run prints as it trains: each log (a training step's, an evaluation's) as one line of JSON numbers, and no
progress bars where nobody watches them.

transformers prints a log as a Python dict of strings (`{'loss': '0.8978', 'grad_norm': '1.958'}`), which no tool
reads as numbers, and its progress bars write carriage returns that run together into one long line in a file. Here
a log is a line a program can parse and a person can read, its numbers rounded to 4 significant digits:

    {"step": 5, "epoch": 0.01, "loss": 0.8978, "grad_norm": 1.958, "learning_rate": 0.001, "tokens_per_second": 93.1}

With a terminal it goes above the progress bar (`tqdm.write`, as transformers writes its own); without one (a file,
CI, SLURM, nohup) there is no bar at all (`no_bars_without_a_terminal`: transformers', datasets' and the hub's), and
the line goes to the `sft` logger, so it is also in the run dir's `train.log`.
"""

from __future__ import annotations

import json
import logging
import math
import sys

from transformers.trainer_callback import PrinterCallback, ProgressCallback

log = logging.getLogger("sft")


def log_line(step: int, logs: dict) -> str:
    """A log as one JSON line of numbers: `step` first, floats to 4 significant digits, non-finite ones as strings
    ("nan", "inf": JSON has no such numbers), `total_flos` left out (a running sum nobody reads per step)."""
    def number(value):
        if isinstance(value, float):
            return float(f"{value:.4g}") if math.isfinite(value) else str(value)
        return value

    return json.dumps({"step": step, **{k: number(v) for k, v in logs.items() if k != "total_flos"}})


def has_terminal() -> bool:
    """Whether someone may be watching: stderr (where bars and logs go) is a terminal."""
    return sys.stderr.isatty()


def no_bars_without_a_terminal() -> None:
    """Turn off the progress bars of datasets, the hub and transformers' loading where stderr is no terminal."""
    if has_terminal():
        return
    import datasets
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    datasets.disable_progress_bars()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()


class StepLogBar(ProgressCallback):
    """transformers' progress bars, each log written above them as a line of numbers (`log_line`)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.write(log_line(state.global_step, logs or {}))


class StepLogPrinter(PrinterCallback):
    """No progress bars (`trainer.disable_tqdm`, or no terminal): each log a line of numbers in the `sft` log."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            log.info("%s", log_line(state.global_step, logs or {}))


def use_step_log(trainer) -> None:
    """Put `StepLogBar`/`StepLogPrinter` in place of the progress callback transformers gave `trainer`."""
    for theirs, ours in ((ProgressCallback, StepLogBar), (PrinterCallback, StepLogPrinter)):
        if trainer.pop_callback(theirs) is not None:
            trainer.add_callback(ours)
