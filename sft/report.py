"""Sweep report: one row per job of a multirun, as CSV, Markdown and a plot.

    python -m sft.report <sweep dir>      # rebuild from disk (also for an interrupted sweep)

At the end of `python -m sft.train -m ...` the Hydra callback `SweepReport` writes the same files into
the sweep dir: `sweep_summary.csv`, `sweep_summary.md` and `sweep_summary.png` (eval-loss curves of all
jobs on one plot, and the final metric against each swept parameter).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback

from sft.results import BUCKET, RunResults

# Overrides that only place or shape the run: never a swept parameter worth a column.
_NOT_PARAMETERS = ("hydra.", "trainer.output_dir", "trainer.report_to", "trainer.run_name")


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job dirs of a sweep (Hydra numbers them), in job order."""
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def job_overrides(job: Path) -> dict[str, str]:
    saved = job / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(saved.read_text()) if saved.is_file() else []
    pairs = (item.split("=", 1) for item in items or [] if "=" in item)
    return {k.lstrip("+~"): v for k, v in pairs if not k.lstrip("+~").startswith(_NOT_PARAMETERS)}


def job_row(job: Path) -> dict:
    """A job's summary: its results, or `interrupted` when it never wrote any."""
    results = RunResults.read(job) or RunResults(status="interrupted")
    losses = [h["eval_loss"] for h in results.eval_history if h.get("eval_loss") is not None]
    return {
        "job": int(job.name),
        "status": results.status,
        "eval_loss": results.eval_loss,
        "best_eval_loss": min(losses) if losses else results.eval_loss,
        "eval_ce": results.eval_ce,
        **{f"{BUCKET}{k}": v for k, v in results.eval_loss_buckets.items()},
        "train_loss": results.train_loss,
        "global_step": results.global_step,
        "train_tokens_per_second": results.train_tokens_per_second,
        "wall_time_s": results.wall_time_s,
        "exact_match_hardest": results.eval_exact_match_hardest,
        "error": results.error or "",
    }


def _parameters(row: dict) -> list[str]:
    """The swept parameters of a summary row: the leading columns before the job's results."""
    keys = list(row)
    return keys[1:keys.index("status")]


def summarize(sweep_dir: str | Path) -> list[dict]:
    """Rows of the sweep with the overrides that vary between jobs as leading columns."""
    sweep_dir = Path(sweep_dir)
    jobs = job_dirs(sweep_dir)
    overrides = {job: job_overrides(job) for job in jobs}
    keys = sorted({k for o in overrides.values() for k in o})
    varying = [k for k in keys if len({o.get(k) for o in overrides.values()}) > 1]
    rows = []
    for job in jobs:
        row = job_row(job)
        rows.append({"job": row.pop("job"), **{k: overrides[job].get(k, "") for k in varying}, **row})
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_report(sweep_dir: str | Path) -> list[dict]:
    """Write `sweep_summary.{csv,md,png}` into the sweep dir; return the rows."""
    sweep_dir = Path(sweep_dir)
    rows = summarize(sweep_dir)
    if not rows:
        return rows
    columns = list(dict.fromkeys(k for row in rows for k in row))
    columns = [c for c in columns if any(row.get(c) not in (None, "") for row in rows)]
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({c: row.get(c) for c in columns} for row in rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)).replace("|", "/") for c in columns) + " |" for row in rows]
    (sweep_dir / "sweep_summary.md").write_text(f"# Sweep {sweep_dir}\n\n" + "\n".join(lines) + "\n")
    plot(sweep_dir, rows)
    return rows


def plot(sweep_dir: Path, rows: list[dict]) -> None:
    """Eval-loss curves of every job, and final eval loss against each swept parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = _parameters(rows[0])
    fig, axes = plt.subplots(1, 1 + max(len(params), 1), figsize=(6 + 4 * max(len(params), 1), 4.5), squeeze=False)
    curves = axes[0][0]
    for row in rows:
        results = RunResults.read(sweep_dir / str(row["job"]))
        history = results.eval_history if results else []
        points = [(h["step"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
        if points:
            label = " ".join(f"{k}={row[k]}" for k in params) or f"job {row['job']}"
            curves.plot(*zip(*points), marker="o", markersize=3, label=label)
    curves.set(xlabel="step", ylabel="eval_loss", title="eval loss per job")
    if curves.lines:
        curves.legend(fontsize=7)
    for ax, key in zip(axes[0][1:], params):
        ok = [r for r in rows if r["status"] == "ok" and r.get("eval_ce") is not None]
        try:
            xs = [float(r[key]) for r in ok]
        except ValueError:
            xs = [str(r[key]) for r in ok]
        others = [k for k in params if k != key]
        groups: dict[str, list] = {}
        for x, r in zip(xs, ok):
            groups.setdefault(" ".join(f"{k}={r[k]}" for k in others), []).append((x, r["eval_ce"]))
        for label, points in groups.items():
            points.sort(key=lambda p: (isinstance(p[0], str), p[0]))
            ax.plot(*zip(*points), marker="o", label=label or None)
        ax.set(xlabel=key, ylabel="final eval_ce", title=f"final eval_ce vs {key}")
        if len(groups) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sweep_dir / "sweep_summary.png", dpi=110)
    plt.close(fig)


class SweepReport(Callback):
    """Hydra callback: write the sweep report when a multirun ends."""

    def on_multirun_end(self, config, **kwargs) -> None:
        rows = write_report(config.hydra.sweep.dir)
        if rows:
            print((Path(config.hydra.sweep.dir) / "sweep_summary.md").read_text())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m sft.report <sweep dir>", file=sys.stderr)
        sys.exit(2)
    rows = write_report(argv[0])
    if not rows:
        print(f"error: no job dirs in {argv[0]}", file=sys.stderr)
        sys.exit(2)
    print((Path(argv[0]) / "sweep_summary.md").read_text())


if __name__ == "__main__":
    main()
