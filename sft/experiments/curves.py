"""A run as a picture (`curves.png`), drawn from its record of every log (`metrics.jsonl`): the training loss, raw and
smoothed (a debiased exponential moving average, from 20 points), the eval loss, the learning rate, the gradient norm against the clip
threshold, and the eval loss of each difficulty bucket. Several runs (`sft plot <run dir> ...`, a sweep's jobs) are
overlaid, one colour a run.

`series` is what is drawn, point for point, from the logs: a test compares it with `metrics.jsonl`. A value that is not
finite (a NaN loss, an infinite norm) is a gap (None) in its curve and in the smoothed one, which goes on from the
values before it: a NaN once blanked the smoothed loss to the end of the run.
"""

from __future__ import annotations

import math
from pathlib import Path

from sft.files import own_path

PANELS = ("loss", "eval loss", "learning rate", "gradient norm", "eval loss by bucket")
SMOOTHING = 0.9  # the moving average's weight on its past, at most (less where there are few points: it would lag)
SPAN = 10  # the average's weight is about 1 - SPAN / points: it spans about a tenth of the run
SMOOTH_FROM = 20  # points of train loss below which no smoothed curve is drawn: the raw one reads as well


def series(metrics: list[dict]) -> dict[str, tuple[list[int], list[float | None]]]:
    """name -> (steps, values) of every curve the picture has, read from the logs (None values left out; a value that
    is not finite kept as a gap, None)."""
    def curve(key: str, where: str = "loss") -> tuple[list[int], list[float | None]]:
        points = [(m["step"], m[key] if math.isfinite(m[key]) else None) for m in metrics
                  if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool) and (where in m)]
        return [s for s, _ in points], [v for _, v in points]

    out = {"train loss": curve("loss"), "eval loss": curve("eval_loss", "eval_loss"),
           "learning rate": curve("learning_rate"), "grad norm": curve("grad_norm"),
           "clip threshold": curve("clip/threshold")}
    steps, values = out["train loss"]
    if len(values) >= SMOOTH_FROM:
        out["train loss (smoothed)"] = (list(steps), smoothed(values))
    buckets = sorted({k for m in metrics for k in m if k.startswith("eval_loss_bucket_")})
    for key in buckets:
        out[f"bucket {key.removeprefix('eval_loss_bucket_')}"] = curve(key, "eval_loss")
    return {name: points for name, points in out.items() if points[0]}


def smoothed(values: list[float | None]) -> list[float | None]:
    """A debiased exponential moving average (TensorBoard's smoothing): each point the mean of the points so far,
    weighted `w ** age`, with `w` at most `SMOOTHING` and spanning about a tenth of the points. Started from zero and
    divided by the weights' sum, it follows the data from the first point; one started at the first value would hold
    on to it, and lie above the whole of a falling curve. A gap (None) stays a gap and leaves the average as it was.

        [4, 2, 1], w = 0.5  ->  [4, (0.5*4 + 2) / 1.5, (0.25*4 + 0.5*2 + 1) / 1.75] = [4, 2.67, 1.71]
        [4, None, 2]        ->  [4, None, (0.5*4 + 2) / 1.5]
    """
    points = sum(value is not None for value in values)
    weight = max(0.0, min(SMOOTHING, 1 - SPAN / max(points, 1)))
    out, average, n = [], 0.0, 0
    for value in values:
        if value is None:
            out.append(None)
            continue
        n += 1
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight ** n) if weight else value)
    return out


def draw(runs: dict[str, list[dict]], path: str | Path) -> dict[str, dict]:
    """`runs` (label -> its logs) drawn into one picture at `path`; returns label -> its `series`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {label: series(metrics) for label, metrics in runs.items()}
    keys = {"loss": ("train loss",), "eval loss": ("eval loss",), "learning rate": ("learning rate",),
            "gradient norm": ("grad norm",), "eval loss by bucket": ()}
    panels = [p for p in PANELS if any(k in curves for curves in drawn.values() for k in keys[p])
              or (p == "eval loss by bucket" and any(k.startswith("bucket ") for c in drawn.values() for k in c))]
    panels = panels or ["loss"]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    axes = dict(zip(panels, grid.flat))
    for extra in list(grid.flat)[len(panels):]:
        extra.set_visible(False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, curves) in enumerate(drawn.items()):
        colour = colours[i % len(colours)]
        name = f"{label}: " if len(drawn) > 1 else ""

        def plot(panel, key, **style):
            if key in curves and panel in axes:
                steps, values = curves[key]
                axes[panel].plot(steps, values, color=style.pop("color", colour), label=f"{name}{key}", **style)

        plot("loss", "train loss", alpha=0.3)
        plot("loss", "train loss (smoothed)")
        plot("eval loss", "eval loss", marker="o")
        plot("learning rate", "learning rate")
        plot("gradient norm", "grad norm")
        plot("gradient norm", "clip threshold", linestyle="--")
        for j, key in enumerate(k for k in curves if k.startswith("bucket ")):
            plot("eval loss by bucket", key, marker=".", color=colours[(i + j) % len(colours)])
    for title, axis in axes.items():
        axis.set_title(title)
        axis.set_xlabel("step")
        if axis.lines:
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(own_path(path), dpi=80)  # (never through a link planted there)
    plt.close(fig)
    return drawn
