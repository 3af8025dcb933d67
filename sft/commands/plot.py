"""`sft plot <run dir> [<run dir> ...] [-o curves.png]`: runs overlaid in one picture (`sft.experiments.curves`),
drawn from each run's `metrics.jsonl`; a sweep's dir stands for its jobs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sft.experiments.curves import draw
from sft.training.observability.metrics_file import read_metrics


def runs_of(paths: list[str]) -> dict[str, list[dict]]:
    """label -> logs of each run named, a sweep dir's jobs (its sub-dirs with a metrics.jsonl) each as one run."""
    runs = {}
    for path in map(Path, paths):
        if (path / "metrics.jsonl").is_file():
            runs[str(path)] = read_metrics(path / "metrics.jsonl")
            continue
        jobs = sorted(p.parent for p in path.glob("*/metrics.jsonl"))
        if not jobs:
            raise ValueError(f"{path}: no metrics.jsonl here nor in its sub-dirs (a run dir of sft train, or a "
                             "sweep's)")
        runs.update({str(job): read_metrics(job / "metrics.jsonl") for job in jobs})
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sft plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run dirs of sft train (or a sweep's dir: its jobs)")
    parser.add_argument("-o", "--output", default="curves.png", help="where the picture goes (default: curves.png)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = runs_of(args.runs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    draw(runs, args.output)
    print(f"wrote {args.output}: {len(runs)} run(s)")
