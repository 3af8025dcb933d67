"""The adaptive evaluation interval (`sft.training.controllers.adaptive_eval`): halved when the metric moves fast,
doubled when flat, within bounds."""

from sft.training.controllers import AdaptiveEvalInterval


def test_adaptive_eval_interval_halves_when_fast_doubles_when_flat_within_bounds():
    a = AdaptiveEvalInterval(min_steps=10, max_steps=80, fast=0.05, slow=0.005)
    a.interval = 40
    intervals = [a.next_interval(v) for v in [5.0, 4.0, 3.5, 3.49, 3.489, 3.4889, 3.48889, 3.488889]]
    assert intervals == [40, 20, 10, 20, 40, 80, 80, 80]
