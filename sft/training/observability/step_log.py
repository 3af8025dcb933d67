"""What a run prints as it trains, and the record it keeps of every log.

transformers prints a log as a Python dict of strings (`{'loss': '0.8978', 'grad_norm': '1.958', ...}`): twenty keys,
three wrapped lines in a terminal, every ten steps. Here each log is one short line a person reads at a glance
(`console=short`, the default), with fixed units and the numbers people watch:

    step 40/200  loss 0.8978  lr 1.00e-03  grad 1.96  3,120 tok/s
    eval @ 40 (vs step 0)  eval_loss 0.8123 (-0.4410)  eval_ce 0.8101 (-0.4402)  hardest 1.020 (-0.310)  acc 0.61 ...
    attention @ 60: the guard skipped a step (non-finite or spiking loss): 1 so far (nan_batches/ names its rows)

and every number of every log goes, as numbers, to `metrics.jsonl` in the run dir (`MetricsFile`), one JSON object per
log, beside TensorBoard's events. `console=json` prints each log as one JSON line of numbers instead
(`json_line`: for those who pipe the console into `jq`).

With a terminal the line goes above the progress bar (`tqdm.write`, as transformers writes its own); without one (a
file, CI, SLURM, nohup) there is no bar at all (`no_bars_without_a_terminal`: transformers', datasets' and the
hub's), and the line goes to the `sft` logger, so it is also in the run dir's `train.log`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from sft.files import own_path
from sft.ranks import is_rank_zero
from sft.training.observability.metrics_file import read_metrics

log = logging.getLogger("sft")
WIDTH = 120  # the widest console line (a terminal's usual width)


def json_line(step: int, logs: dict) -> str:
    """A log as one JSON line of numbers: `step` first, floats to 4 significant digits, non-finite ones as strings
    ("nan", "inf": JSON has no such numbers), `total_flos` left out (a running sum nobody reads per step)."""
    def number(value):
        if isinstance(value, float):
            return float(f"{value:.4g}") if math.isfinite(value) else str(value)
        return value

    return json.dumps({"step": step, **{k: number(v) for k, v in logs.items() if k != "total_flos"}})


class ShortLines:
    """The console's lines for a run's logs, one at a time (`lines`): a training log, an evaluation (each change
    since the run's first evaluation), and a line of its own for what needs attention (a step the guard skipped, a
    loss spike, clipping at every step)."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.first_eval: dict | None = None
        self.seen = {"guard/skipped_steps": 0, "guard/spikes": 0}
        self.clipping_said = False

    def lines(self, step: int, logs: dict) -> list[str]:
        if "loss" in logs:
            return [self.training(step, logs), *self.attention(step, logs)]
        if "eval_loss" in logs:
            return [self.evaluation(step, logs)]
        if "train_runtime" in logs:  # transformers' closing log: the summary says it better (sft.experiments.summary)
            return []
        shown = [f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                 for key, value in logs.items() if key not in ("epoch", "total_flos", "num_input_tokens_seen")]
        return [fit(f"step {step}: " + "  ".join(shown))] if shown else []

    def training(self, step: int, logs: dict) -> str:
        parts = [f"step {step}/{self.max_steps}", f"loss {logs['loss']:.4f}"]
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if "grad_norm" in logs:
            parts.append(f"grad {logs['grad_norm']:.3g}")
        if "tokens_per_second" in logs:
            parts.append(f"{logs['tokens_per_second']:,.0f} tok/s")
        return fit("  ".join(parts))

    def evaluation(self, step: int, logs: dict) -> str:
        first = self.first_eval
        if first is None:
            self.first_eval = first = {"step": step, **logs}
        since = first["step"] != step  # the changes since the run's first evaluation

        def shown(key: str, label: str, digits: int = 4) -> str | None:
            if not isinstance(logs.get(key), (int, float)):
                return None
            text = f"{label} {logs[key]:.{digits}f}"
            if since and isinstance(first.get(key), (int, float)):
                text += f" ({logs[key] - first[key]:+.{digits}f})"
            return text

        parts = [shown("eval_loss", "eval_loss"), shown("eval_ce", "eval_ce"),
                 shown("eval_loss_hardest_bucket", "hardest", 3), shown("eval_token_accuracy", "acc", 3)]
        head = f"eval @ {step}" + (f" (vs step {first['step']})" if since else "")
        return fit(f"{head}  " + "  ".join(p for p in parts if p))

    def attention(self, step: int, logs: dict) -> list[str]:
        out = []
        for key, what in (("guard/skipped_steps", "the guard skipped a step (non-finite or spiking loss): {n} so far "
                                                  "(nan_batches/ names its rows)"),
                          ("guard/spikes", "a loss spike: {n} so far (the guard's spike_factor)")):
            n = int(logs.get(key, 0))
            if n > self.seen[key]:
                out.append(fit(f"attention @ {step}: " + what.format(n=n)))
            self.seen[key] = n
        if logs.get("clip/clipped_fraction") == 1.0 and step >= 10 and not self.clipping_said:
            self.clipping_said = True
            out.append(fit(f"attention @ {step}: every step so far was clipped (clip/threshold "
                           f"{logs.get('clip/threshold', float('nan')):.3g}): a higher clip.max_norm or a lower "
                           "learning rate"))
        return out


def fit(line: str) -> str:
    """A line cut to the console's width, saying where the rest is."""
    return line if len(line) <= WIDTH else line[:WIDTH - 20].rstrip() + " ... (metrics.jsonl)"


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


class _Lines:
    """The lines of a log in the chosen style (`console`: short or json)."""

    def __init__(self, console: str):
        self.console, self.short = console, None

    def __call__(self, state, logs: dict) -> list[str]:
        if self.console == "json":
            return [json_line(state.global_step, logs)]
        if self.short is None:
            self.short = ShortLines(state.max_steps)
        return self.short.lines(state.global_step, logs)


class StepLogBar(ProgressCallback):
    """transformers' progress bars, each log written above them as its lines (`console`)."""

    def __init__(self, console: str = "short"):
        super().__init__()
        self.lines = _Lines(console)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            for line in self.lines(state, logs or {}):
                self.training_bar.write(line)


class StepLogPrinter(PrinterCallback):
    """No progress bars (`trainer.disable_tqdm`, or no terminal): each log's lines in the `sft` log."""

    def __init__(self, console: str = "short"):
        super().__init__()
        self.lines = _Lines(console)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            for line in self.lines(state, logs or {}):
                log.info("%s", line)


def use_step_log(trainer, console: str = "short") -> None:
    """Put `StepLogBar`/`StepLogPrinter` in place of the progress callback transformers gave `trainer`."""
    for theirs, ours in ((ProgressCallback, StepLogBar), (PrinterCallback, StepLogPrinter)):
        if trainer.pop_callback(theirs) is not None:
            trainer.add_callback(ours(console))


class MetricsFile(TrainerCallback):
    """Every log, whole, as one JSON object a line in `path` (rank 0): `step` first, numbers as numbers (a
    non-finite one as null: JSON has no NaN). A resume from step S keeps the lines up to S and goes on after them
    (the steps a killed run logged past its checkpoint are trained again).

        {"step": 10, "loss": 0.8978132, "grad_norm": 1.9581, "learning_rate": 0.001, "tokens_per_second": 3120.4, ...}
    """

    def __init__(self, path: str | Path, resumed_step: int | None = None):
        self.path = own_path(path)  # never through a link planted there
        if resumed_step is not None and self.path.is_file() and is_rank_zero():
            kept = [record for record in read_metrics(self.path) if record.get("step", 0) <= resumed_step]
            self.path.write_text("".join(json.dumps(record) + "\n" for record in kept))
        elif resumed_step is None and is_rank_zero():
            self.path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        record = {"step": state.global_step}
        for key, value in (logs or {}).items():
            record[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

