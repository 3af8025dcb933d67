"""Command-line checks before Hydra (`sft.config.argv`): a field the recipe owns, a key of an engine that is off, named
with the knob to use."""

import pytest
from conftest import assert_cli_refuses, run_train


@pytest.mark.parametrize("override", ["trainer.max_grad_norm=0.5", "+trainer.max_grad_norm=0.5",
                                      "trainer.remove_unused_columns=true"])
def test_cli_a_field_the_recipe_owns_names_the_knob_that_replaces_it(override):
    proc = run_train(override)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    key = override.lstrip("+").split("=")[0]
    from sft.training.arguments import TrainerConfig

    assert f"error: config: {key}: {TrainerConfig.owned_fields[key.split('.')[1]]}" in proc.stderr


@pytest.mark.parametrize("overrides, message", [
    (["fsdp.cpu_offload=true"], "error: config: fsdp.cpu_offload: fsdp is off (fsdp=none in this config): turn it "
                                "on with fsdp=full_shard or fsdp=full_shard_offload, then set its keys"),
    (["deepspeed.zero_optimization.offload_param.device=cpu"], "error: config: deepspeed.zero_optimization."
                                                              "offload_param.device: deepspeed is off"),
    (["fsdp=full_shard", "deepspeed=zero3"], "error: config: fsdp: FSDP and DeepSpeed are two engines for the "
                                             "same job: choose one (fsdp=none, or deepspeed=none)"),
])
def test_cli_an_engine_setting_without_its_engine_or_two_engines_is_one_line(tmp_path, overrides, message):
    assert_cli_refuses(tmp_path, message, *overrides)


@pytest.mark.parametrize("override, message", [
    ("data.overlong=cut", "error: config: data.overlong='cut': must be one of truncate, drop, error"),
    ("loss.alpha=abc", "error: config: loss.alpha: Value 'abc' of type 'str' could not be converted to Float"),
])
def test_cli_a_value_its_knob_refuses_is_one_line_naming_the_knob(tmp_path, override, message):
    proc = run_train(override, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == message


def test_an_option_of_your_search_path_is_not_refused_before_hydra_reads_the_search_path(tmp_path):
    from sft.config.argv import refused_override

    (tmp_path / "loss").mkdir()
    (tmp_path / "loss" / "mine.yaml").write_text("defaults: [ce_schema, _self_]\nalpha: 0.5\n")
    assert refused_override([f"hydra.searchpath=[file://{tmp_path}]", "loss=mine", "loss.alpha=2"]) is None
    refused = refused_override([f"hydra.searchpath=[file://{tmp_path}]", "loss=mine", "loss.normalize=mean"])
    assert str(refused) == "loss.normalize='mean': must be one of weight, token, sample"
