"""Where a step's time goes (`sft.bench.profile`): a training case profiled after its timed steps."""

import pytest


@pytest.mark.slow  # a training case of a few steps (about 10 s)
def test_a_profiled_case_splits_its_steps_wall_time_into_shares_that_add_up_to_one():
    from sft.bench.cases import CASES
    from sft.bench.config import compose
    from sft.bench.profile import CATEGORIES
    from sft.bench.training import timed_training_overrides

    base = compose(["bench.steps=3", "bench.warmup_steps=1", "bench.profile_steps=2"])
    cfg = compose(["bench.steps=3", "bench.warmup_steps=1", "bench.profile_steps=2", *CASES["ce"].overrides,
                   *timed_training_overrides(base), "trainer.per_device_train_batch_size=8"])
    result = CASES["ce"].run("ce", cfg)
    shares = result["breakdown"]
    assert set(shares) == set(CATEGORIES) and sum(shares.values()) == pytest.approx(1.0)
    assert shares["matmul"] > 0 and shares["loss"] > 0 and shares["optimizer"] > 0
    assert result["timed_steps"] == 2  # the profiled steps come after the timed ones, untimed
