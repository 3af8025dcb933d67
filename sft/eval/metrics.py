"""Evaluation's metrics from its rows (`eval_metrics`): exact ratios over the eval set, each row counted once."""

from __future__ import annotations

import bisect


def eval_metrics(rows: dict, prefix: str, tasks: dict[int, str], scores: dict, buckets: list[float]) -> dict:
    """Exact ratios over the eval rows, `(source, line, view) -> [numerator, denominator, ce sum, tokens, correct]`:
    `<prefix>_loss`, `_ce`, `_token_accuracy`; with a mixture's `tasks` (source number -> task), each task's loss and
    ce; with difficulty `scores` ((source, line) -> score), the ce of each bucket cut by `buckets` and of the hardest.

        eval_metrics({(0, 1, 0): [2.0, 1.0, 3.0, 2, 1]}, "eval", {}, {}, [])
          ->  {eval_loss: 2.0, eval_ce: 1.5, eval_token_accuracy: 0.5}
    """
    numerator, denominator, ce_sum, tokens, correct = (sum(col) for col in zip(*rows.values()))
    metrics = {
        f"{prefix}_loss": numerator / max(denominator, 1e-12),
        f"{prefix}_ce": ce_sum / max(tokens, 1),
        f"{prefix}_token_accuracy": correct / max(tokens, 1),
    }
    if tasks:
        by_task: dict[str, list[float]] = {}
        for (source, _, _), (num, den, ce, n, _) in rows.items():
            if source in tasks:
                acc = by_task.setdefault(tasks[source], [0.0] * 4)
                for i, v in enumerate((num, den, ce, n)):
                    acc[i] += v
        for task, (num, den, ce, n) in sorted(by_task.items()):
            metrics[f"{prefix}_loss_task_{task}"] = num / max(den, 1e-12)
            metrics[f"{prefix}_ce_task_{task}"] = ce / max(n, 1)
    if scores:
        by_bucket: dict[int, list[float]] = {}
        for (source, line, _), (_, _, ce, n, _) in rows.items():
            if (source, line) not in scores:  # a row without a score is in no bucket
                continue
            k = bisect.bisect_right(buckets, scores[(source, line)])
            acc = by_bucket.setdefault(k, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + ce, acc[1] + n
        for k, (ce, n) in sorted(by_bucket.items()):
            metrics[f"{prefix}_loss_bucket_{k}"] = ce / max(n, 1)
        if by_bucket:
            metrics[f"{prefix}_loss_hardest_bucket"] = metrics[f"{prefix}_loss_bucket_{max(by_bucket)}"]
    return metrics
