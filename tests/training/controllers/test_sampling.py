"""The curriculum's sampler (`sft.training.controllers.sampling`): hard rows favoured at a low temperature, the draw
replayed exactly."""

import json

from sft.training.controllers import Curriculum
from sft.training.controllers.sampling import CurriculumSampler


def test_curriculum_sampler_favours_hard_rows_at_low_temperature_and_replays_exactly():
    scores = [0.5] * 50 + [4.0] * 50
    c = Curriculum(temperature=100.0, chunk_size=20)
    sampler = CurriculumSampler(scores, c, seed=0)
    uniform = list(sampler)
    c.current_temperature = 0.3
    c.epoch = 1
    hard = list(sampler)
    assert 35 <= sum(i >= 50 for i in uniform) <= 65
    assert sum(i >= 50 for i in hard) > 90
    # A resumed run restores the recorded temperatures and draws the same rows, whatever T is now.
    replay = Curriculum(chunk_size=20)
    replay.load_state_dict(json.loads(json.dumps(c.state_dict())))
    replay.current_temperature, replay.epoch = 7.0, 1
    assert list(CurriculumSampler(scores, replay, seed=0)) == hard
