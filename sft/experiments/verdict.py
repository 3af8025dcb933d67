"""The verdict of a sweep: which setting is better than the baseline on which metric, and how sure (`verdict_lines`,
the words `sweep_summary.md` and the sweep's page open with), the failed jobs (`failed_lines`), and the rules they
follow: a metric's direction (`higher_is_better`), whether it compares across losses (`comparable`), whether a paired
difference is resolved (`resolved`)."""

from __future__ import annotations

from sft.experiments.results import BUCKET, EVAL_EXTRA
from sft.experiments.stats import Interval

FIXED = ("eval_ce", "eval_token_accuracy", "exact_match_hardest")  # metrics beside the buckets, in every report

_LOWER_IS_BETTER = {"loss", "ce", "perplexity", "seconds", "malformed", "cut"}  # words of a metric's last part


def higher_is_better(metric: str) -> bool:
    """A metric's direction from its name: losses, cross entropies, perplexities, times, malformed or cut answers go
    down; accuracies, exact matches and other scores go up."""
    return not _LOWER_IS_BETTER & set(metric.rsplit("/", 1)[-1].split("_"))


def comparable(metric: str) -> bool:
    """Whether a metric means the same under every setting of a sweep: the unweighted cross entropy, per bucket and
    task, token accuracy, exact matches, generation and benchmark scores; not `eval_loss`, which each loss weighs its
    own way, nor times."""
    return ((metric in FIXED or metric.startswith((BUCKET, "eval_ce_task_", *EVAL_EXTRA)))
            and not metric.endswith("seconds"))


def seed_count(row: dict) -> int:
    """The seeds a setting's row holds (its `seeds` column: `3/3`)."""
    return int(row["seeds"].split("/")[0])


def resolved(diff: Interval, seeds: int) -> bool:
    """Whether a paired difference over `seeds` seeds is resolved: its interval excludes 0. One value, or a
    bootstrap over one row (one seed's low == high), is no interval; seeds that all differ alike are one.

        Interval(0.02, 0.02, 0.02), 3 seeds -> True; the same from 1 seed -> False; Interval(0.02) -> False"""
    if diff.low is None or (diff.low == diff.high and seeds < 2):
        return False
    return diff.excludes_zero


def verdict_lines(rows: list[dict]) -> list[str]:
    """A sentence per setting against the baseline: the comparable metrics on which its paired difference is better
    or worse (the interval excludes 0) and those it leaves unresolved; the best mean of `eval_ce`; and a warning
    where the seeds are too few for an interval to mean much."""
    if not rows:
        return []
    params = list(rows[0])[:list(rows[0]).index("seeds")]
    base = next(r for r in rows if r["baseline"])

    def name(row: dict) -> str:
        return " ".join(f"{p}={row[p]}" for p in params) or "the one setting"

    lines = []
    metrics = [m for m in dict.fromkeys(k for r in rows for k in r)
               if comparable(m) and isinstance(base.get(m), Interval)]
    for row in rows:
        if seed_count(row) == 0:
            lines.append(f"- {name(row)}: no job of this setting finished ({row['seeds']}): nothing to compare; see "
                         "Failed jobs")
            continue
        if row["baseline"]:
            continue
        judged: dict[str, list[str]] = {"better": [], "worse": [], "not resolved": []}
        seeds = seed_count(row)
        for metric in metrics:
            diff = row.get(f"diff_{metric}")
            if not isinstance(diff, Interval):
                continue
            if diff.low is None or (diff.low == diff.high and not resolved(diff, seeds)):
                judged["not resolved"].append(f"{metric} ({diff.mean:+.3g}, no interval)")
                continue
            shown = f"{metric} ({diff.mean:+.3g} [{diff.low:+.3g}, {diff.high:+.3g}])"
            if not resolved(diff, seeds):
                judged["not resolved"].append(shown)
            else:
                judged["better" if (diff.mean > 0) == higher_is_better(metric) else "worse"].append(shown)
        parts = [f"**{kind}** on {', '.join(found)}" for kind, found in judged.items() if found]
        lines.append(f"- {name(row)} against {name(base)} ({seeds} seed{'s' * (seeds != 1)}, paired): "
                     f"{'; '.join(parts) or 'no metric'}.")
    ce = [(r["eval_ce"].mean, name(r)) for r in rows if isinstance(r.get("eval_ce"), Interval)]
    if ce:
        best = min(ce)
        lines.append(f"- Lowest mean eval_ce (unweighted cross entropy, comparable across losses): {best[1]} "
                     f"({best[0]:.4g}).")
    fewest = min((seed_count(r) for r in rows if seed_count(r) > 0), default=0)
    if fewest == 1:
        lines.append("- Warning: a setting has one seed: its intervals are bootstraps over the eval rows, which "
                     "measure the eval set's noise, not the seed's: run 3 or more seeds (trainer.seed=1,2,3).")
    elif fewest < 3:
        lines.append(f"- Warning: a setting has {fewest} seeds: a 95% t interval from {fewest} values is "
                     f"{_t_factor(fewest):.1f} standard errors wide each side (from 3: 4.3, from 5: 2.8), so few "
                     "differences resolve: run 3 or more seeds (trainer.seed=1,2,3).")
    return lines


def failed_lines(jobs: list[dict]) -> list[str]:
    """A section naming each job that failed or did not end, with its SLURM job where one ran it and the first line
    of its error; nothing where every job finished."""
    bad = [j for j in jobs if j["status"] != "ok"]
    if not bad:
        return []
    lines = ["## Failed jobs", ""]
    for job in bad:
        where = f" (SLURM job {job['slurm_job']})" if job.get("slurm_job") else ""
        error = (job.get("error") or "").splitlines()[0] if job.get("error") else "no results.json: interrupted"
        lines.append(f"- job {job['job']}{where}: {job['status']}: {error}")
    return lines + [""]


def _t_factor(n: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1))


