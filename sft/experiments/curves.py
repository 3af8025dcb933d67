"""A run as a picture (`curves.png`), drawn from its record of every log (`metrics.jsonl`): the training loss, raw and
smoothed (an exponential moving average), the eval loss, the learning rate, the gradient norm against the clip
threshold, and the eval loss of each difficulty bucket. Several runs (`sft plot <run dir> ...`, a sweep's jobs) are
overlaid, one colour a run.

`series` is what is drawn, point for point, from the logs: a test compares it with `metrics.jsonl`.
"""

from __future__ import annotations

from pathlib import Path

from sft.files import own_path

PANELS = ("loss", "eval loss", "learning rate", "gradient norm", "eval loss by bucket")
SMOOTHING = 0.9  # the moving average's weight on its past


def series(metrics: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) of every curve the picture has, read from the logs (None values left out)."""
    def curve(key: str, where: str = "loss") -> tuple[list[int], list[float]]:
        points = [(m["step"], m[key]) for m in metrics
                  if isinstance(m.get(key), (int, float)) and (where in m)]
        return [s for s, _ in points], [v for _, v in points]

    out = {"train loss": curve("loss"), "eval loss": curve("eval_loss", "eval_loss"),
           "learning rate": curve("learning_rate"), "grad norm": curve("grad_norm"),
           "clip threshold": curve("clip/threshold")}
    steps, values = out["train loss"]
    smooth, ema = [], None
    for value in values:
        ema = value if ema is None else SMOOTHING * ema + (1 - SMOOTHING) * value
        smooth.append(ema)
    out["train loss (smoothed)"] = (list(steps), smooth)
    buckets = sorted({k for m in metrics for k in m if k.startswith("eval_loss_bucket_")})
    for key in buckets:
        out[f"bucket {key.removeprefix('eval_loss_bucket_')}"] = curve(key, "eval_loss")
    return {name: points for name, points in out.items() if points[0]}


def draw(runs: dict[str, list[dict]], path: str | Path) -> dict[str, dict]:
    """`runs` (label -> its logs) drawn into one picture at `path`; returns label -> its `series`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {label: series(metrics) for label, metrics in runs.items()}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, curves) in enumerate(drawn.items()):
        colour = colours[i % len(colours)]
        name = f"{label}: " if len(drawn) > 1 else ""

        def plot(axis, key, **style):
            if key in curves:
                steps, values = curves[key]
                axis.plot(steps, values, color=style.pop("color", colour), label=f"{name}{key}", **style)

        plot(axes[0], "train loss", alpha=0.3)
        plot(axes[0], "train loss (smoothed)")
        plot(axes[1], "eval loss", marker="o")
        plot(axes[2], "learning rate")
        plot(axes[3], "grad norm")
        plot(axes[3], "clip threshold", linestyle="--")
        for j, key in enumerate(k for k in curves if k.startswith("bucket ")):
            plot(axes[4], key, marker=".", color=colours[(i + j) % len(colours)])
    for axis, title in zip(axes, PANELS):
        axis.set_title(title)
        axis.set_xlabel("step")
        if axis.lines:
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(own_path(path), dpi=80)  # (never through a link planted there)
    plt.close(fig)
    return drawn
