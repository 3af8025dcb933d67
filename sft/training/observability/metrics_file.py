"""A run's `metrics.jsonl` read back: every log `sft.training.observability.step_log.MetricsFile` wrote, one JSON object
of numbers per line, for the summary, `sft plot` and the tests. Light on purpose: no torch or transformers behind it."""

from __future__ import annotations

from pathlib import Path

from sft.files import read_json_lines


def read_metrics(path: str | Path) -> list[dict]:
    """The logs `MetricsFile` wrote (`sft.training.observability.step_log`), in order ([] where there is no file); a
    line cut short (the run was killed while writing it) is left out."""
    return read_json_lines(path)
