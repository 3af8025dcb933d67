"""A run's or a sweep's results as one page (`report.html`): a single file with no server and no network (Plotly's
pinned bundle, the page's own script and style, and the data all inline), which opens from a mail attachment or a CI
artifact.

- A run's page (`run_page`): the recipe (what differs from the defaults, `sft recipe`, given by the caller), the
  summary, the curves from `metrics.jsonl` (loss and its smoothing, eval loss, learning rate, gradient norm against
  the clip threshold, eval loss per difficulty bucket), throughput and peak memory, and the base and trained models' answers side by
  side where `sft compare` wrote them (`compare.json`), exact matches marked, filterable by bucket.
- A sweep's page (`write_sweep_page`, its data from `sft.experiments.report.sweep_page_data`): the verdict first
  (the lines of `sweep_summary.md`), the failed jobs, the settings with their intervals, every job's curves on one set
  of axes (a job shown or hidden by clicking its name), per-bucket eval loss per setting with intervals, and a link to
  each job's page.

The data travels as JSON inside the page (non-finite numbers as null: a gap in a curve), and the page's script shows
every text through the DOM's `textContent`, never as markup: a row holding `<script>` is shown, not run. What is
missing (no `metrics.jsonl`, a failed job) is said on the page.

    write_run_page("outputs/2026-12-05/12-00-00")  ->  outputs/2026-12-05/12-00-00/report.html
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

from sft.files import own_path, write_text

PAGE = "report.html"
ASSETS = Path(__file__).with_name("page_assets")  # the page's script and style (package data)


def finite(value):
    """JSON-safe data: NaN and infinities as None (a gap), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def page(title: str, kind: str, data: dict) -> str:
    """The whole page: Plotly's bundle, the style, `data` as inert JSON (a `</` inside any text cannot close the
    script element holding it), and the script that draws it."""
    from plotly.offline import get_plotlyjs

    payload = json.dumps(finite({"kind": kind, "title": title, **data}), ensure_ascii=False, allow_nan=False)
    payload = payload.replace("</", "<\\/").replace("<!--", "<\\!--")
    style = (ASSETS / "page.css").read_text()
    script = (ASSETS / "page.js").read_text()
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_escape(title)}</title><style>{style}</style>"
            f"<script>{get_plotlyjs()}</script></head>\n<body><main id=\"page\"></main>\n"
            f"<script type=\"application/json\" id=\"sft-data\">{payload}</script>\n<script>{script}</script>"
            "</body></html>\n")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# --- a run -----------------------------------------------------------------------------------------------------------


def run_data(run_dir: str | Path, recipe: str | None = None) -> dict:
    """What a run's page shows, read from its dir; a part it lacks is absent (the page says so). `recipe`: what the
    run's config sets apart from the defaults (`sft recipe`, which the commands and the run compose)."""
    from sft.experiments.curves import series
    from sft.experiments.results import RunResults
    from sft.training.observability.metrics_file import read_metrics

    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    results = RunResults.read(run_dir)
    data = {"run_dir": str(run_dir), "has_metrics": bool(metrics),
            "series": {name: {"x": x, "y": y} for name, (x, y) in series(metrics).items()} if metrics else {},
            "throughput": _series_of(metrics, "tokens_per_second"), "memory": _series_of(metrics, "peak_memory_gb"),
            "results": results.to_json() if results else None,
            "summary": _text(run_dir / "summary.txt"), "recipe": recipe,
            "answers": _answers(run_dir)}
    return data


def _series_of(metrics: list[dict], key: str) -> dict:
    points = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
    return {"x": [s for s, _ in points], "y": [v for _, v in points]}


def _text(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def _answers(run_dir: Path) -> dict | None:
    """`sft compare`'s answers (`compare.json`), each row with its difficulty bucket (the run's eval bucket edges)."""
    path = run_dir / "compare.json"
    if not path.is_file():
        return None
    try:
        compared = json.loads(path.read_text())
    except ValueError:
        return None
    edges = _bucket_edges(run_dir)
    scores = compared.get("difficulty_scores") or [None] * len(compared.get("references", []))
    # the bucket the run's eval metrics put a row in (sft.eval.metrics: an edge starts the bucket above it)
    compared["buckets"] = [None if s is None else bisect.bisect_right(edges, s) for s in scores]
    return compared


def _bucket_edges(run_dir: Path) -> list[float]:
    import yaml

    saved = run_dir / ".hydra" / "config.yaml"
    try:
        return list(yaml.safe_load(saved.read_text()).get("eval_buckets") or [])
    except (OSError, AttributeError, yaml.YAMLError):
        return []


def run_page(run_dir: str | Path, recipe: str | None = None) -> str:
    return page(f"Run {Path(run_dir).name}", "run", run_data(run_dir, recipe))


def write_run_page(run_dir: str | Path, recipe: str | None = None) -> Path:
    path = Path(run_dir) / PAGE
    write_text(own_path(path), run_page(run_dir, recipe))
    return path


# --- a sweep (its data: sft.experiments.report.sweep_page_data) ---------------------------------------------------


def job_curves(sweep_dir: Path, jobs: list[dict]) -> dict:
    """Each job's train and eval loss from its `metrics.jsonl`, for the sweep's overlaid curves."""
    from sft.experiments.curves import series
    from sft.training.observability.metrics_file import read_metrics

    curves = {}
    for row in jobs:
        metrics = read_metrics(Path(sweep_dir) / str(row["job"]) / "metrics.jsonl")
        curves[str(row["job"])] = {name: {"x": x, "y": y} for name, (x, y) in series(metrics).items()
                                   if name in ("train loss", "eval loss")}
    return curves


def write_sweep_page(sweep_dir: str | Path, data: dict) -> Path:
    """A sweep's page from its data (`sft.experiments.report.sweep_page_data`)."""
    path = Path(sweep_dir) / PAGE
    write_text(own_path(path), page(f"Sweep {Path(sweep_dir).name}", "sweep", data))
    return path
