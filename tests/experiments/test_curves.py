"""`curves.png`'s smoothed train loss (`sft.experiments.curves`): a debiased moving average that follows the data."""

import math
import random

from sft.experiments.curves import SMOOTH_FROM, SPAN, series, smoothed


def weighted_mean_so_far(values, weight):
    """The definition, written out: point k is the mean of points 0..k weighted weight ** (k - i)."""
    out = []
    for k in range(len(values)):
        weights = [weight ** (k - i) for i in range(k + 1)]
        out.append(sum(w * v for w, v in zip(weights, values)) / sum(weights))
    return out


def falling_loss(n, seed=0):
    rng = random.Random(seed)
    return [2.0 * math.exp(-k / 8) + 0.3 + rng.gauss(0, 0.05) for k in range(n)]


def test_the_smoothed_loss_is_the_weighted_mean_of_the_points_so_far():
    values = falling_loss(40)
    weight = 1 - SPAN / 40
    assert all(abs(a - b) < 1e-12 for a, b in zip(smoothed(values), weighted_mean_so_far(values, weight)))
    assert smoothed([4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])[0] == 4.0  # the first point is itself


def test_on_a_falling_curve_the_smoothed_loss_follows_the_data_rather_than_lying_above_it():
    """The moving average started at the first value (as before) lay above every raw point of a falling curve after
    its first few; the debiased one keeps within the noise of the curve it smooths once it has fallen."""
    values = falling_loss(60)
    smooth = smoothed(values)
    truth = [2.0 * math.exp(-k / 8) + 0.3 for k in range(60)]
    late = range(30, 60)
    assert sum(abs(smooth[k] - truth[k]) for k in late) < sum(abs(values[k] - truth[k]) for k in late)  # smoother
    assert 5 < sum(smooth[k] < values[k] for k in late) < 25  # on both sides of the raw points
    undebiased, ema = [], values[0]
    for v in values:
        ema = 0.9 * ema + 0.1 * v
        undebiased.append(ema)
    assert sum(s > v for s, v in zip(undebiased[5:30], values[5:30])) == 25  # the old curve: above every point


def test_a_short_run_draws_no_smoothed_curve():
    logs = [{"step": k, "loss": v} for k, v in enumerate(falling_loss(SMOOTH_FROM - 1), 1)]
    assert "train loss (smoothed)" not in series(logs) and "train loss" in series(logs)
    logs = [{"step": k, "loss": v} for k, v in enumerate(falling_loss(SMOOTH_FROM), 1)]
    assert series(logs)["train loss (smoothed)"][0] == list(range(1, SMOOTH_FROM + 1))


def test_a_nan_is_a_gap_in_the_raw_and_smoothed_loss_which_go_on_after_it(tmp_path):
    """A NaN step (the guard skipped it) blanked the smoothed loss to the end of the run, on the page and in
    curves.png: it is a gap in both curves, and the smoothing goes on from the values before it."""
    from sft.experiments.curves import draw

    values = falling_loss(40)
    logs = [{"step": k, "loss": float("nan") if k == 12 else v, "grad_norm": float("inf") if k == 12 else 1.0}
            for k, v in enumerate(values, 1)]
    curves = series(logs)
    steps, raw = curves["train loss"]
    _, smooth = curves["train loss (smoothed)"]
    assert steps == list(range(1, 41)) and raw[11] is None and smooth[11] is None
    finite = [v for k, v in enumerate(values, 1) if k != 12]
    assert [s for s in smooth if s is not None] == smoothed(finite)  # the average as though the NaN were not there
    assert all(s is not None and math.isfinite(s) for s in smooth[12:])
    assert curves["grad norm"][1][11] is None
    drawn = draw({"run": logs}, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and drawn["run"]["train loss (smoothed)"][1][-1] > 0
