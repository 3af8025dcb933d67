"""The statistics of a sweep report: intervals over seeds, bootstraps over eval rows, paired differences.

    t_interval([0.84, 0.80, 0.86])                 ->  Interval(mean=0.8333, low=0.7574, high=0.9092)
    Interval(1.0, 0.5, 1.5).excludes_zero          ->  True

Over seeds (two or more): Student's t. With one seed, a percentile bootstrap over the eval rows of that
run (`sft.experiments.results.write_eval_rows`), for the metrics that are ratios of row sums (cross entropy, loss,
token accuracy, per-bucket cross entropy). A difference between two settings is paired: over the seeds
both have (same seed, same initialisation and data order), or with one seed each, over the same eval rows
resampled together. Bootstraps use a fixed seed: the report is the same every time it is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 2000


@dataclass
class Interval:
    mean: float
    low: float | None = None  # None: one value, no interval
    high: float | None = None

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)

    def __str__(self) -> str:
        if self.low is None:
            return f"{self.mean:.4g}"
        return f"{self.mean:.4g} [{self.low:.4g}, {self.high:.4g}]"


def t_interval(values: list[float]) -> Interval:
    """Mean and its 95% interval from Student's t (no interval for fewer than two values)."""
    from scipy.stats import t

    values = [v for v in values if v is not None and math.isfinite(v)]
    mean = float(np.mean(values))
    if len(values) < 2:
        return Interval(mean)
    half = float(t.ppf(0.5 + CONFIDENCE / 2, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values)))
    return Interval(mean, mean - half, mean + half)


class EvalRows:
    """A run's final evaluation row by row, as arrays keyed by (source, line, view), with ratio metrics on any
    resample of the rows.

    Metrics: `eval_ce` (sum ce / tokens), `eval_loss` (sum numerator / sum denominator),
    `eval_token_accuracy` (correct / tokens), `eval_loss_bucket_<k>` (ce / tokens over the rows of
    difficulty bucket k, cut at `edges` as the trainer cuts them), a mixture's `eval_ce_task_<task>` and
    `eval_loss_task_<task>` (over the rows of that task).
    """

    def __init__(self, rows: list[dict], edges: list[float]):
        self.keys = [(r.get("source", 0), r["line"], r["view"]) for r in rows]
        self.task = np.array([r.get("task") or "" for r in rows], dtype=object)
        self.columns = {name: np.array([float(r[name]) for r in rows])
                        for name in ("ce_sum", "tokens", "loss_num", "loss_den", "correct")}
        scores = [r.get("difficulty_score") for r in rows]
        self.bucket = np.array([np.searchsorted(edges, s, side="right") if s is not None else -1 for s in scores])

    def aligned(self, keys: list) -> EvalRows:
        """These rows in the order of `keys` (which must all be present)."""
        where = {k: i for i, k in enumerate(self.keys)}
        index = np.array([where[k] for k in keys])
        out = object.__new__(EvalRows)
        out.keys = list(keys)
        out.columns = {name: col[index] for name, col in self.columns.items()}
        out.bucket = self.bucket[index]
        out.task = self.task[index]
        return out

    def metric(self, name: str, index: np.ndarray | None = None) -> np.ndarray | None:
        """The metric on each resample (`index`: [samples, rows] row indices; None: all rows once);
        None for a metric that is not a ratio of row sums."""
        from sft.experiments.results import BUCKET

        if index is None:
            index = np.arange(len(self.keys))[None]
        c = {name_: col[index] for name_, col in self.columns.items()}
        with np.errstate(invalid="ignore", divide="ignore"):
            if name == "eval_ce":
                return c["ce_sum"].sum(-1) / c["tokens"].sum(-1)
            if name == "eval_loss":
                return c["loss_num"].sum(-1) / c["loss_den"].sum(-1)
            if name == "eval_token_accuracy":
                return c["correct"].sum(-1) / c["tokens"].sum(-1)
            if name.startswith(BUCKET):
                mask = self.bucket[index] == int(name[len(BUCKET):])
                return (c["ce_sum"] * mask).sum(-1) / (c["tokens"] * mask).sum(-1)
            for metric, (num, den) in (("eval_ce_task_", ("ce_sum", "tokens")),
                                       ("eval_loss_task_", ("loss_num", "loss_den"))):
                if name.startswith(metric):
                    mask = self.task[index] == name[len(metric):]
                    return (c[num] * mask).sum(-1) / (c[den] * mask).sum(-1)
        return None


def _resamples(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, n, size=(BOOTSTRAP_SAMPLES, n))


def _percentiles(mean: float, samples: np.ndarray) -> Interval:
    samples = samples[np.isfinite(samples)]
    if not len(samples):
        return Interval(mean)
    tail = 100 * (1 - CONFIDENCE) / 2
    return Interval(mean, float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail)))


def bootstrap_interval(rows: EvalRows, metric: str) -> Interval | None:
    """A one-seed run's metric with a percentile bootstrap interval over its eval rows."""
    whole = rows.metric(metric)
    if whole is None or not np.isfinite(whole[0]):  # not a ratio of row sums, or no row of that bucket
        return None
    return _percentiles(float(whole[0]), rows.metric(metric, _resamples(len(rows.keys))))


def paired_bootstrap(rows: EvalRows, baseline: EvalRows, metric: str) -> Interval | None:
    """The difference `rows - baseline` of a metric over the eval rows both have, the same rows resampled
    for both; None for a metric that is not a ratio of row sums, or no common rows."""
    common = sorted(set(rows.keys) & set(baseline.keys))
    if not common or rows.metric(metric) is None:
        return None
    a, b = rows.aligned(common), baseline.aligned(common)
    index = _resamples(len(common))
    return _percentiles(float(a.metric(metric)[0] - b.metric(metric)[0]),
                        a.metric(metric, index) - b.metric(metric, index))
