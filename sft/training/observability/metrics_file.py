"""A run's `metrics.jsonl` read back: every log `sft.training.observability.step_log.MetricsFile` wrote, one JSON object
of numbers per line, for the summary, `sft plot` and the tests. Light on purpose: no torch or transformers behind it."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """The logs `MetricsFile` wrote (`sft.training.observability.step_log`), in order ([] where there is no file); a
    line cut short (the run was killed while writing it) is left out."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
