"""Sharded checkpoints' config (`sft.training.checkpoints.sharded`); their consolidation is
tests/model/test_consolidate.py, the 2-process saves, resumes and async writes tests/e2e/test_distributed.py."""

import pytest

from sft.config import ConfigError, check, compose
from sft.training.checkpoints.sharded import format_of_checkpoint, sharded


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.format=sharded"], "checkpoint.format='sharded': sharded checkpoints are FSDP's"),
    (["checkpoint.format=sharded", "fsdp=full_shard", "lora=default"], "a LoRA adapter is saved whole"),
    (["checkpoint.async_save=true", "fsdp=full_shard", "lora=default"], "checkpoint.async_save=True: writes sharded"),
    (["checkpoint.async_save=true", "fsdp=full_shard", "checkpoint.format=gathered"], "it needs them"),
])
def test_what_sharded_checkpoints_need_is_refused_naming_the_knob(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(compose("train", overrides))


def test_fsdp_full_fine_tuning_writes_sharded_checkpoints_by_default_and_a_resume_follows_the_checkpoint(tmp_path):
    assert sharded(compose("train", ["fsdp=full_shard"]))
    assert not sharded(compose("train", ["fsdp=full_shard", "lora=default"])) and not sharded(compose("train", []))
    gathered = tmp_path / "checkpoint-4"
    gathered.mkdir()
    cfg = compose("train", ["fsdp=full_shard"])
    format_of_checkpoint(cfg, str(gathered))  # an older run's gathered checkpoint: this run goes on gathered
    assert cfg.checkpoint.format == "gathered" and not sharded(cfg)
    explicit = compose("train", ["fsdp=full_shard", "checkpoint.format=sharded"])
    with pytest.raises(ConfigError, match="was saved gathered: a resume goes on in its format"):
        format_of_checkpoint(explicit, str(gathered))
