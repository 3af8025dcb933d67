"""What a run says when it ends (`summary_text`): whether the model got better and by how much, the best evaluation,
how long and how fast, where the model or adapter is, and the commands that come next, with this run's paths. Read
from the run's record of every log (`metrics.jsonl`, `sft.training.observability.step_log.MetricsFile`); printed and
written to `summary.txt` in the run dir (`write_summary`), also when a signal stops the run.

    run finished: 30 steps in 1m34s, 161 tokens/s
    eval_loss 3.2600 -> 0.0330 (-3.2270), best 0.0330 at step 30
    eval_ce 3.2550 -> 0.0329; hardest bucket 3.310 -> 0.041
    adapter: outputs/run/model (LoRA; base model: smollm2_135m)
    next:
      sft compare run=outputs/run rows=data/eval.jsonl
      sft merge checkpoint=outputs/run output=outputs/run/merged
      sft recipe outputs/run -o recipe.yaml
      sft plot outputs/run [<other run dirs>]   (this run's picture: outputs/run/curves.png)
"""

from __future__ import annotations

from pathlib import Path

from sft.files import own_path, write_text


def duration(seconds: float) -> str:
    """`94` -> `1m34s`, `3725` -> `1h02m05s`, `12.3` -> `12.3s`."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def change(metrics: list[dict], key: str, digits: int = 4) -> str | None:
    """`key`'s first and last value among the logs: "1.2500 -> 0.8123 (-0.4377)", or None where it was never logged."""
    values = [m[key] for m in metrics if isinstance(m.get(key), (int, float))]
    if not values:
        return None
    first, last = values[0], values[-1]
    return f"{first:.{digits}f} -> {last:.{digits}f}" + (f" ({last - first:+.{digits}f})" if len(values) > 1 else "")


def summary_text(run_dir: str | Path, metrics: list[dict], status: str, steps: int, wall_time_s: float | None, *,
                 tokens_per_second: float | None = None, adapter: bool = False, model_name: str = "",
                 eval_rows: str | None = None, continue_with: str | None = None) -> str:
    """The summary's lines (see the module docstring). `status`: finished, or preempted (then `continue_with` is the
    command that goes on)."""
    run = str(run_dir)
    speed = f", {tokens_per_second:,.0f} tokens/s" if tokens_per_second else ""
    took = f" in {duration(wall_time_s)}" if wall_time_s is not None else ""
    lines = [f"run {status}: {steps} steps{took}{speed}"]
    evals = [m for m in metrics if isinstance(m.get("eval_loss"), (int, float))]
    if evals:
        best = min(evals, key=lambda m: m["eval_loss"])
        lines.append(f"eval_loss {change(evals, 'eval_loss')}, best {best['eval_loss']:.4f} at step {best['step']}")
        more = [f"{label} {text}" for key, label, digits in (("eval_ce", "eval_ce", 4),
                                                              ("eval_loss_hardest_bucket", "hardest bucket", 3),
                                                              ("eval_exact_match_hardest", "exact match (hardest)", 3))
                if (text := change(evals, key, digits)) is not None]
        if more:
            lines.append("; ".join(more))
    else:
        losses = [m for m in metrics if isinstance(m.get("loss"), (int, float))]
        if losses:
            lines.append(f"train loss {change(losses, 'loss')} (no evaluation in this run)")
    if status == "preempted":
        lines.append(f"continue with: {continue_with}" if continue_with else "no checkpoint was saved yet")
        return "\n".join(lines) + "\n"
    model = Path(run, "model")
    lines.append(f"adapter: {model} (LoRA; base model: {model_name})" if adapter else f"model: {model}")
    rows = eval_rows or "<your eval chats.jsonl>"
    lines.append("next:")
    lines.append(f"  sft compare run={run} rows={rows}")
    if adapter:
        lines.append(f"  sft merge checkpoint={run} output={run}/merged")
    lines.append(f"  sft recipe {run} -o recipe.yaml")
    lines.append(f"  sft plot {run} [<other run dirs>]   (this run's picture: {run}/curves.png)")
    return "\n".join(lines) + "\n"


def write_summary(run_dir: str | Path, text: str) -> Path:
    """`summary.txt` in the run dir (never through a link planted there)."""
    path = own_path(Path(run_dir, "summary.txt"))
    write_text(path, text)
    return path
