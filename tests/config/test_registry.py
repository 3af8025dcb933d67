"""Composition (`sft.config.registry`): the default config and every preset compose; unknown keys, bad types and values
outside a knob's choices are refused at composition, naming them."""

import pytest
from conftest import composed
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from sft.config import check


def test_default_config_composes_and_passes_checks():
    cfg = composed()
    check(cfg)
    assert cfg.loss._target_ == "sft.loss.builtin.HardSampleLoss" and cfg.model.name_or_path == "tiny"
    assert OmegaConf.to_container(cfg, resolve=True)["data"]["train_file"].endswith("sample_data/train.jsonl")


@pytest.mark.parametrize("override, key", [("loss.nope=1", "nope"), ("trainer.learning_rte=1", "learning_rte"),
                                           ("nope=1", "nope"), ("loss.alpha=abc", "loss.alpha")])
def test_unknown_keys_and_bad_types_are_rejected_naming_them(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        composed(override)
    assert key in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("override, key, choices", [
    ("loss.normalize=mean", "loss.normalize", "weight, token, sample"),
    ("loss.impl=fast", "loss.impl", "auto, naive, chunked, liger, cce"),
    ("data.on_error=ignore", "data.on_error", "raise, skip"),
    ("data.overlong=cut", "data.overlong", "truncate, drop, error"),
    ("data.format=chatml", "data.format", "auto, messages, sharegpt, alpaca, prompt_completion"),
    ("model.dtype=float8", "model.dtype", "float32, bfloat16, float16"),
    ("checkpoint_checksums=some", "checkpoint_checksums", "small, all"),
])
def test_a_value_outside_a_knobs_choices_is_refused_at_composition_naming_them(override, key, choices):
    with pytest.raises(ConfigCompositionException) as e:
        composed(override)
    message = str(e.value.__cause__)
    assert f"expected one of [{choices}]" in message and f"full_key: {key}" in message


def test_a_choice_outside_its_choices_in_a_controller_added_later_is_refused_too():
    with pytest.raises(ConfigCompositionException) as e:
        composed("+controllers=early_stopping", "controllers.early_stopping.mode=up")
    assert "expected one of [min, max]" in str(e.value.__cause__)


@pytest.mark.parametrize("group", ["model=qwen2_5_7b", "model=qwen2_5_7b_random", "loss=ce", "data=jsonl", "lora=default", "lora=dora",
                                   "fsdp=full_shard", "fsdp=full_shard_offload",
                                   "clip=none", "clip=autoclip", "clip=zclip", "~controllers.guard", "~controllers.watchdog",
                                   "+controllers=early_stopping", "+controllers=lr_plateau", "+controllers=adaptive_eval",
                                   "+controllers=curriculum"])
def test_presets_compose(group):
    cfg = composed(group, "data.train_file=sft/sample_data/train.jsonl") if group == "data=jsonl" else composed(group)
    assert cfg is not None
