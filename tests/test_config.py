"""Composition rejects unknown keys and bad types; value checks name the field; presets compose."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import REPO, run_train
from sft.config import ConfigError, check, register

register()


def composed(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def test_default_config_composes_and_passes_checks():
    cfg = composed()
    check(cfg)
    assert cfg.loss._target_ == "sft.losses.HardSampleLoss" and cfg.model.name_or_path == "tiny"
    assert OmegaConf.to_container(cfg, resolve=True)["data"]["train_file"].endswith("sample_data/train.jsonl")


@pytest.mark.parametrize("override, key", [("loss.nope=1", "nope"), ("trainer.learning_rte=1", "learning_rte"),
                                           ("nope=1", "nope"), ("loss.alpha=abc", "loss.alpha")])
def test_unknown_keys_and_bad_types_are_rejected_naming_them(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        composed(override)
    assert key in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.learning_rate=0"], "trainer.learning_rate"),
        (["trainer.per_device_train_batch_size=0"], "trainer.per_device_train_batch_size"),
        (["trainer.gradient_accumulation_steps=0"], "trainer.gradient_accumulation_steps"),
        (["trainer.max_steps=0"], "trainer.max_steps"),
        (["trainer.fp16=true", "trainer.bf16=true"], "trainer.fp16"),
        (["loss.min_weight=-1"], "loss.min_weight"),
        (["loss.min_weight=5", "loss.max_weight=2"], "loss.min_weight"),
        (["loss.normalize=mean"], "loss.normalize"),
        (["loss.alpha=inf"], "loss.alpha"),
        (["data.max_length=2"], "data.max_length"),
        (["data.train_file=/does/not/exist.jsonl"], "data.train_file"),
        (["data.default_score=-1"], "data.default_score"),
        (["clip.max_norm=-1"], "clip.max_norm"),
        (["lora=default", "lora.r=0"], "lora.r"),
        (["resume=/no/such/checkpoint"], "resume"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(overrides, key):
    with pytest.raises(ConfigError) as e:
        check(composed(*overrides))
    assert e.value.key == key and str(e.value).startswith(key)


@pytest.mark.parametrize("group", ["model=qwen2_5_7b", "loss=ce", "data=jsonl", "lora=default", "clip=none"])
def test_presets_compose(group):
    cfg = composed(group, "data.train_file=README.md") if group == "data=jsonl" else composed(group)
    assert cfg is not None


def test_cli_bad_value_exits_2_with_one_line_and_no_traceback():
    proc = run_train("trainer.learning_rate=-1")
    assert proc.returncode == 2
    assert "trainer.learning_rate=-1.0: must be > 0" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_unknown_key_fails_naming_it():
    proc = run_train("loss.nope=1")
    assert proc.returncode != 0 and "nope" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_bad_data_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}], "difficulty_score": 1}\n')
    proc = run_train("data=jsonl", f"data.train_file={bad}", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{bad}:1: messages: no assistant turn" in proc.stderr
