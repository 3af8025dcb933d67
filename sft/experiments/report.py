"""Sweep report: settings compared over seeds, with 95% intervals and paired differences, and one row
per job. As CSV, Markdown and a plot.

    sft report <sweep dir> [--baseline "loss.alpha=0"]   # rebuild from disk (also mid-sweep)

Jobs that differ only in `trainer.seed`/`trainer.data_seed` are one *setting*. Per setting: its seeds
(`3/3`: ok of all; a failed or interrupted seed is never averaged in silently), and for each metric the
mean with its 95% interval (`sft.experiments.stats`: Student's t over seeds; with one seed, a bootstrap over the eval
rows) and the paired difference to the baseline setting (`sweep.baseline` or `--baseline`, an override
string naming it; default the first setting): over the seeds both have, or with one seed, over the same
eval rows. `*` marks a difference whose interval excludes 0.

At the end of `python -m sft.train -m ...` the Hydra callback `SweepReport` writes the same files into
the sweep dir: `sweep_summary.csv` (a setting per row, every figure), `sweep_summary.md` (the verdict: a sentence
per setting naming the comparable metrics it is better or worse on or leaves unresolved, and a warning where seeds
are too few; then settings, then jobs), `sweep_jobs.csv` (a job per row) and `sweep_summary.png` (eval_ce curves of
all jobs, the paired differences to the baseline with their intervals, and eval_ce's mean and interval against each
swept parameter).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
import yaml
from hydra.experimental.callback import Callback

from sft.experiments.results import BUCKET, EVAL_EXTRA, TASK_METRICS, RunResults, read_eval_rows
from sft.experiments.stats import EvalRows, Interval, bootstrap_interval, paired_bootstrap, t_interval
from sft.experiments.pages import PAGE, job_curves, page, write_sweep_page
from sft.experiments.verdict import (FIXED, comparable, failed_lines, higher_is_better, resolved, seed_count,
                                    verdict_lines)
from sft.files import own_path, write_text

# Overrides that only place or shape the run: never a swept parameter worth a column.
_NOT_PARAMETERS = ("hydra.", "trainer.output_dir", "trainer.report_to", "trainer.run_name", "sweep.")
SEED_KEYS = ("trainer.seed", "trainer.data_seed")  # jobs differing only in these are one setting


class ReportError(ValueError):
    """A report that cannot be built as asked (e.g. a baseline that names no setting)."""


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job dirs of a sweep (Hydra numbers them), in job order."""
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


# A sweep in which a job failed (or never wrote its results) exits with this code, after writing its report: a
# script or a scheduler that runs the sweep sees it did not all go well (a signal's stop is 75: PREEMPTED_EXIT_CODE)
SWEEP_FAILED_EXIT_CODE = 3


def failed_jobs(sweep_dir: str | Path) -> list[str]:
    """The jobs of a finished sweep that did not finish well, each as `#<n> (<status>: <error>)`: a failed one, and
    one that wrote no results (killed, lost)."""
    failed = []
    for job in job_dirs(Path(sweep_dir)):
        results = RunResults.read(job)
        if results is None:
            failed.append(f"#{job.name} (no results.json: the job was killed or lost)")
        elif results.status == "failed":
            failed.append(f"#{job.name} (failed: {(results.error or '').splitlines()[0][:200]})")
    return failed


def exit_if_a_job_failed(sweep_dir: str | Path) -> None:
    """After the report: one line naming the sweep's failed jobs and exit `SWEEP_FAILED_EXIT_CODE`; nothing where every
    job finished."""
    if failed := failed_jobs(sweep_dir):
        print(f"error: {len(failed)} job(s) of the sweep in {sweep_dir} did not finish: {'; '.join(failed)} (exit "
              f"code {SWEEP_FAILED_EXIT_CODE}; the report holds the others)", file=sys.stderr)
        sys.exit(SWEEP_FAILED_EXIT_CODE)


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
        **results.eval_tasks,
        **results.eval_extra,
        "eval_token_accuracy": results.eval_token_accuracy,
        "train_loss": results.train_loss,
        "global_step": results.global_step,
        "train_tokens_per_second": results.train_tokens_per_second,
        "wall_time_s": results.wall_time_s,
        "exact_match_hardest": results.eval_exact_match_hardest,
        "error": results.error or "",
        **({"slurm_job": results.slurm_job} if results.slurm_job else {}),
    }


def _parameters(row: dict) -> list[str]:
    """The swept parameters of a summary row: the leading columns before the job's results."""
    keys = list(row)
    return keys[1:keys.index("status")]


def summarize(sweep_dir: str | Path) -> list[dict]:
    """Rows of the sweep, a job each, with the overrides that vary between jobs as leading columns."""
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


# --- settings: jobs grouped over seeds ------------------------------------------------------------------


def _eval_rows(sweep_dir: Path, job: int) -> EvalRows | None:
    """A job's final evaluation row by row, with the bucket edges its run used."""
    rows = read_eval_rows(sweep_dir / str(job))
    if rows is None:
        return None
    saved = sweep_dir / str(job) / ".hydra" / "config.yaml"
    config = yaml.safe_load(saved.read_text()) if saved.is_file() else {}
    return EvalRows(rows, config.get("eval_buckets") or [])


def _metrics(jobs: list[dict]) -> list[str]:
    """The metrics a report compares: the numeric result columns of the jobs."""
    results = dict.fromkeys(k for row in jobs for k in list(row)[list(row).index("status"):])
    return [k for k in results if k not in ("status", "error", "global_step")
            and any(isinstance(row.get(k), (int, float)) and not isinstance(row.get(k), bool) for row in jobs)]


def _matches(setting: dict, baseline: str) -> bool:
    wanted = dict(item.split("=", 1) for item in baseline.split())
    return all(setting.get(k.lstrip("+~")) == v for k, v in wanted.items())


def settings(sweep_dir: str | Path, jobs: list[dict], baseline: str | None = None) -> list[dict]:
    """One row per setting (jobs equal but for their seeds): seeds, and per metric the mean, its interval
    and the paired difference to the baseline setting (see the module docstring)."""
    sweep_dir = Path(sweep_dir)
    if not jobs:
        return []
    params = [k for k in _parameters(jobs[0]) if k not in SEED_KEYS]
    groups: dict[tuple, list[dict]] = {}
    for row in jobs:
        groups.setdefault(tuple(row[k] for k in params), []).append(row)
    keys = list(groups)
    base_key = keys[0]
    if baseline:
        found = [k for k in keys if _matches(dict(zip(params, k)), baseline)]
        if not found:
            named = "; ".join(" ".join(f"{p}={v}" for p, v in zip(params, k)) or "(one setting)" for k in keys)
            raise ReportError(f"sweep.baseline={baseline!r} names no setting of this sweep; its settings: {named}")
        base_key = found[0]
    metrics = _metrics(jobs)
    rows_of = {row["job"]: _eval_rows(sweep_dir, row["job"]) for row in jobs if row["status"] == "ok"}
    out = []
    for key in keys:
        members, ok = groups[key], [r for r in groups[key] if r["status"] == "ok"]
        row = {**dict(zip(params, key)), "seeds": f"{len(ok)}/{len(members)}",
               "baseline": key == base_key}
        for metric in metrics:
            values = [r[metric] for r in ok if isinstance(r.get(metric), (int, float))]
            if not values:
                continue
            interval = t_interval(values)
            if len(values) == 1 and rows_of.get(ok[0]["job"]) is not None:
                interval = bootstrap_interval(rows_of[ok[0]["job"]], metric) or interval
            row[metric] = interval
            if len(values) > 1:
                row[f"{metric}_std"] = float(np.std(values, ddof=1))  # over the seeds
            if key != base_key:
                diff = _paired_difference(ok, [r for r in groups[base_key] if r["status"] == "ok"], metric,
                                          rows_of)
                if diff is not None:
                    row[f"diff_{metric}"] = diff
        out.append(row)
    return out


def _seed(row: dict) -> tuple:
    return tuple(row.get(k, "") for k in SEED_KEYS)


def _paired_difference(jobs: list[dict], baseline: list[dict], metric: str, rows_of: dict) -> Interval | None:
    """`jobs - baseline` for a metric, paired by seed (over two or more shared seeds), else over the eval
    rows of the one shared seed."""
    base = {_seed(r): r for r in baseline}
    pairs = [(r, base[_seed(r)]) for r in jobs if _seed(r) in base
             and isinstance(r.get(metric), (int, float)) and isinstance(base[_seed(r)].get(metric), (int, float))]
    if len(pairs) >= 2:
        return t_interval([a[metric] - b[metric] for a, b in pairs])
    if len(pairs) == 1:
        a, b = pairs[0]
        if rows_of.get(a["job"]) is not None and rows_of.get(b["job"]) is not None:
            diff = paired_bootstrap(rows_of[a["job"]], rows_of[b["job"]], metric)
            if diff is not None:
                return diff
        return Interval(a[metric] - b[metric])
    return None


# --- files ----------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if isinstance(v, Interval):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _markdown(rows: list[dict], columns: list[str]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return lines + ["| " + " | ".join(_fmt(row.get(c)).replace("|", "/") for c in columns) + " |" for row in rows]


def _write_csv(path: Path, rows: list[dict]) -> None:
    """Rows as CSV; a column of intervals becomes three: the value, `<column>_low`, `<column>_high`."""
    columns = [c for c in dict.fromkeys(k for row in rows for k in row)
               if any(row.get(c) not in (None, "") for row in rows)]
    spread = {c for c in columns if any(isinstance(row.get(c), Interval) for row in rows)}
    with open(own_path(path), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([h for c in columns for h in ((c, f"{c}_low", f"{c}_high") if c in spread else (c,))])
        for row in rows:
            line = []
            for c in columns:
                v = row.get(c)
                if c in spread:
                    line += [v.mean, v.low, v.high] if isinstance(v, Interval) else ["", "", ""]
                else:
                    line.append("" if v is None else v)
            writer.writerow(line)


def settings_markdown(rows: list[dict]) -> list[str]:
    """The settings table: parameters, seeds, then per shown metric its mean [interval] and difference."""
    if not rows:
        return []
    params = list(rows[0])[:list(rows[0]).index("seeds")]
    shown = [m for m in dict.fromkeys(k for r in rows for k in r)
             if (m in FIXED or m.startswith((BUCKET, *TASK_METRICS, *EVAL_EXTRA))) and not m.startswith("diff_")
             and not m.endswith("_std")]
    columns = params + ["seeds"]
    for metric in shown:
        columns.append(metric)
        if any(f"diff_{metric}" in r for r in rows):
            columns.append(f"diff_{metric}")
    table = []
    for row in rows:
        cells = dict(row)
        for c in columns:
            if c.startswith("diff_"):
                diff = row.get(c)
                cells[c] = "baseline" if row["baseline"] else (f"{diff}{' *' if diff.excludes_zero else ''}"
                                                               if diff is not None else "")
        table.append(cells)
    return _markdown(table, columns)


def write_report(sweep_dir: str | Path, baseline: str | None = None) -> list[dict]:
    """Write `sweep_summary.{csv,md,png}` and `sweep_jobs.csv` into the sweep dir; return the job rows."""
    sweep_dir = Path(sweep_dir)
    jobs = summarize(sweep_dir)
    if not jobs:
        return jobs
    grouped = settings(sweep_dir, jobs, baseline)
    _write_csv(sweep_dir / "sweep_jobs.csv", jobs)
    _write_csv(sweep_dir / "sweep_summary.csv", grouped)
    job_columns = [c for c in dict.fromkeys(k for row in jobs for k in row)
                   if any(row.get(c) not in (None, "") for row in jobs)]
    text = [f"# Sweep {sweep_dir}", "", "## Verdict", "", *verdict_lines(grouped), "", *failed_lines(jobs),
            "## Settings (mean [95% interval]; diff_: paired difference to the baseline, * where its interval "
            "excludes 0)", "", *settings_markdown(grouped), "", "## Jobs", "", *_markdown(jobs, job_columns)]
    write_text(own_path(sweep_dir / "sweep_summary.md"), "\n".join(text) + "\n")
    plot(sweep_dir, jobs, grouped)
    write_sweep_page(sweep_dir, sweep_page_data(sweep_dir, jobs, grouped))  # report.html beside the summary
    return jobs


def sweep_page_data(sweep_dir: Path, jobs: list[dict], grouped: list[dict]) -> dict:
    """What a sweep's page shows (`sft.experiments.pages`): the verdict and failed jobs as `sweep_summary.md` words
    them, the settings (intervals as {mean, low, high}) with each comparable metric's verdict, the jobs, each job's
    curves, and the link to each job's page."""
    def plain(row: dict) -> dict:
        return {k: ({"mean": v.mean, "low": v.low, "high": v.high} if isinstance(v, Interval) else v)
                for k, v in row.items()}

    def judged(row: dict) -> dict:
        out = {}
        for key, diff in row.items():
            metric = key.removeprefix("diff_")
            if key.startswith("diff_") and isinstance(diff, Interval) and comparable(metric):
                out[metric] = ("not resolved" if not resolved(diff, seed_count(row)) else
                               "better" if (diff.mean > 0) == higher_is_better(metric) else "worse")
        return out

    return {"sweep_dir": str(sweep_dir), "verdict": [line[2:] for line in verdict_lines(grouped)],
            "failed": [line[2:] for line in failed_lines(jobs) if line.startswith("- ")],
            "settings": [{**plain(r), "judged": judged(r)} for r in grouped], "jobs": [plain(r) for r in jobs],
            "parameters": list(grouped[0])[:list(grouped[0]).index("seeds")] if grouped else [],
            "curves": job_curves(sweep_dir, jobs),
            "pages": {str(r["job"]): f"{r['job']}/{PAGE}" for r in jobs
                      if (sweep_dir / str(r["job"]) / PAGE).is_file()}}


def sweep_page(sweep_dir: str | Path, baseline: str | None = None) -> str:
    """The sweep's page (`sft board`), made from its dir now."""
    sweep_dir = Path(sweep_dir)
    jobs = summarize(sweep_dir)
    data = sweep_page_data(sweep_dir, jobs, settings(sweep_dir, jobs, baseline) if jobs else [])
    return page(f"Sweep {sweep_dir.name}", "sweep", data)


def write_page(sweep_dir: str | Path, baseline: str | None = None) -> Path:
    """The sweep's page alone (`sft report --html`)."""
    sweep_dir = Path(sweep_dir)
    jobs = summarize(sweep_dir)
    return write_sweep_page(sweep_dir, sweep_page_data(sweep_dir, jobs, settings(sweep_dir, jobs, baseline)
                                                       if jobs else []))


def plot(sweep_dir: Path, rows: list[dict], grouped: list[dict]) -> None:
    """Three views of comparable metrics only (`comparable`; the weighted eval_loss is not one): eval_ce per job over
    the steps; each setting's paired difference to the baseline on every comparable metric, with its interval (to
    the right of 0 is better, whichever way the metric goes); and each setting's final eval_ce (mean and interval)
    against each swept parameter."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = [k for k in _parameters(rows[0]) if k not in SEED_KEYS]
    fig, axes = plt.subplots(1, 2 + len(params), figsize=(12 + 4 * len(params), 5), squeeze=False)
    curves, forest = axes[0][0], axes[0][1]
    for row in rows:
        results = RunResults.read(sweep_dir / str(row["job"]))
        points = [(h["step"], h["eval_ce"]) for h in (results.eval_history if results else [])
                  if h.get("eval_ce") is not None]
        if points:
            label = " ".join(f"{k}={row[k]}" for k in _parameters(row)) or f"job {row['job']}"
            curves.plot(*zip(*points), marker="o", markersize=3, label=label)
    curves.set(xlabel="step", ylabel="eval_ce", title="eval_ce per job (unweighted: comparable across losses)")
    if curves.lines:
        curves.legend(fontsize=7)
    labels, y = [], 0
    for row in grouped:
        if row["baseline"]:
            continue
        for metric in [m for m in row if m.startswith("diff_") and comparable(m[5:])]:
            diff = row[metric]
            if not isinstance(diff, Interval):
                continue
            sign = 1 if higher_is_better(metric[5:]) else -1  # drawn so that better is always to the right
            low, high = (diff.low, diff.high) if diff.low is not None else (diff.mean, diff.mean)
            better = sign * diff.mean > 0
            color = "tab:gray" if not resolved(diff, seed_count(row)) else ("tab:green" if better else "tab:red")
            forest.errorbar([sign * diff.mean], [y], xerr=[[sign * diff.mean - min(sign * low, sign * high)],
                                                         [max(sign * low, sign * high) - sign * diff.mean]],
                            fmt="o", color=color, capsize=3)
            labels.append(f"{' '.join(str(row[p]) for p in params)}: {metric[5:]}")
            y += 1
    forest.axvline(0, color="black", linewidth=0.8)
    forest.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
    forest.set_yticks(range(len(labels)), labels, fontsize=7)
    forest.invert_yaxis()
    forest.set(xlabel="paired difference to the baseline (right: better)", title="vs the baseline, 95% intervals")
    ok = [r for r in grouped if isinstance(r.get("eval_ce"), Interval)]
    for ax, key in zip(axes[0][2:], params):
        try:
            xs = [float(r[key]) for r in ok]
        except ValueError:
            xs = [str(r[key]) for r in ok]
        others = [k for k in params if k != key]
        lines: dict[str, list] = {}
        for x, r in zip(xs, ok):
            lines.setdefault(" ".join(f"{k}={r[k]}" for k in others), []).append((x, r["eval_ce"]))
        for label, points in lines.items():
            points.sort(key=lambda p: (isinstance(p[0], str), p[0]))
            x, intervals = zip(*points)
            means = [i.mean for i in intervals]
            errors = [[i.mean - (i.low if i.low is not None else i.mean) for i in intervals],
                      [(i.high if i.high is not None else i.mean) - i.mean for i in intervals]]
            ax.errorbar(x, means, yerr=errors, marker="o", capsize=4, label=label or None)
        ax.set(xlabel=key, ylabel="final eval_ce", title=f"final eval_ce vs {key} (mean, 95% interval)")
        if len(lines) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(own_path(sweep_dir / "sweep_summary.png"), dpi=110)
    plt.close(fig)


class SweepReport(Callback):
    """Hydra callback: write the sweep report when a multirun ends."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            rows = write_report(sweep_dir, config.get("sweep", {}).get("baseline"))
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr)
            return
        except OSError as e:  # a full disk: the sweep's jobs are done, its report is not, and the exit code says so
            print(f"error: the sweep's report cannot be written into {sweep_dir}: {e.strerror} ({e.filename}); "
                  f"sft report {sweep_dir} writes it once there is room", file=sys.stderr)
            sys.exit(1)
        if rows:
            from sft.experiments.tracking import log_sweep_report

            log_sweep_report(sweep_dir, config.get("trainer", {}).get("report_to"))
            print((sweep_dir / "sweep_summary.md").read_text())
        exit_if_a_job_failed(sweep_dir)
