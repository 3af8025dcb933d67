"""The curriculum (`sft.training.controllers.curriculum`): the temperature falls while the metric improves and rises
when it stalls."""

from sft.training.controllers import Curriculum


def test_curriculum_temperature_falls_while_improving_and_rises_when_stalled():
    c = Curriculum(temperature=4.0, factor=0.5, min_temperature=0.5, max_temperature=8.0)
    temps = [c.move(v) for v in [3.0, 2.0, 1.5, 1.5, 1.6, 1.0, 1.0, 1.0, 1.0]]
    assert temps == [2.0, 1.0, 0.5, 1.0, 2.0, 1.0, 2.0, 4.0, 8.0]
