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
    (["sp.size=4"], "error: config: sp.size: sp is off (sp=none in this config): turn it on with sp=ulysses, then "
                    "set its keys"),
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


@pytest.mark.parametrize("override, message", [
    ("trainer.learning_rate=abc", "trainer.learning_rate: Value 'abc' of type 'str' could not be converted to Float"),
    ("trainer.per_device_train_batch_size=1.5",
     "trainer.per_device_train_batch_size: Value '1.5' of type 'float' could not be converted to Integer"),
    ("loss.alpha=[1,2]", "loss.alpha: Value '[1, 2]' of type 'list' could not be converted to Float"),
    ("nosuchgroup=x", "nosuchgroup: not a group or knob of the config"),
    ("trainer.learnin_rate=1", "trainer.learnin_rate: not a knob of trainer (did you mean trainer.learning_rate?)"),
    ("loss=nonexistent", "loss='nonexistent': no such option (options: asft, ce, dft, distill, eaft, focal, "
                         "hard_sample, keywords, length, reference_weighted)"),
    ("loss=focall", "loss='focall': no such option (options: asft, ce, dft, distill, eaft, focal, hard_sample, "
                    "keywords, length, reference_weighted) (did you mean focal?)"),
    ("exact_match.max_rows=5", "exact_match.max_rows: exact_match is off (exact_match: null in this config): turn it "
                               "on with exact_match=default, then set its keys"),
    ("model.random_init.hidden_size=64", "model.random_init.hidden_size: a new key of model.random_init (a free-form "
                                         "dict): add it with +model.random_init.hidden_size=..."),
    ("data.train_file=/data/données.jsonl", "data.train_file='/data/données.jsonl': Hydra's grammar reads unquoted "
                                            "values as ASCII only: write it 'data.train_file=\"/data/données.jsonl\"'"),
    ("tokenizer.stop_tokens=[<|a|>,<|b|>]", "tokenizer.stop_tokens='[<|a|>,<|b|>]': Hydra cannot parse it (values "
                                            "with characters such as < > | ' \" , [ ] { } need quotes): write it "
                                            "'tokenizer.stop_tokens=[\"<|a|>\",\"<|b|>\"]'"),
    ("+hydra.callbacks.x._target_=shutil.copyfile", "hydra.callbacks.x._target_: a Hydra callback or plugin is "
                                                    "built before any check: set it in a config file"),
])
def test_each_bad_override_is_one_line_naming_the_key(override, message):
    # Each exited 1 with Hydra's multi-line text or a traceback (issue 33); the CLI prints `error: config: <this>`.
    from sft.config.argv import refused_override

    assert str(refused_override([override])).startswith(message)


@pytest.mark.parametrize("override, message", [
    ("trainer.learning_rate=1e999", "trainer.learning_rate=inf: must be a finite number > 0"),
    ("trainer.save_steps=-1", "trainer.save_steps=-1.0: must be > 0"),
    ("trainer.eval_steps=0", "trainer.eval_steps=0.0: must be > 0"),
    ("trainer.report_to=[nosuchtracker]", "trainer.report_to=['nosuchtracker']: 'nosuchtracker' is not a tracker "
                                          "transformers knows"),
])
def test_values_once_accepted_but_wrong_are_refused_at_the_start(override, message):
    from conftest import composed

    from sft.config import ConfigError, check

    with pytest.raises(ConfigError) as e:
        check(composed(override))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("override, key", [("trainer.lr_scheduler_type=bogus", "trainer.lr_scheduler_type"),
                                           ("trainer.optim=bogus", "trainer.optim")])
def test_a_value_training_arguments_refuses_names_its_field(tmp_path, override, key):
    from conftest import composed

    from sft.config import ConfigError
    from sft.run.build import arguments

    with pytest.raises(ConfigError) as e:
        arguments(composed(override), str(tmp_path), resuming=False, max_grad_norm=1.0)
    assert str(e.value).startswith(f"{key}='bogus': must be one of [")


@pytest.mark.slow
def test_bad_overrides_on_the_command_line_exit_2_with_one_line(tmp_path):
    for override, message in [("trainer.learnin_rate=1", "did you mean trainer.learning_rate?"),
                              ("trainer.optim=bogus", "trainer.optim='bogus': must be one of ["),
                              ("+controllers.x._target_=shutil.copyfile", "controllers.x._target_='shutil.copyfile': "
                                                                         "must be sft.training.controllers.base.Controller")]:
        proc = run_train(override, f"hydra.run.dir={tmp_path}/run")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0] and errors[0].startswith("error: config: "), proc.stderr


def test_an_option_of_a_config_dir_given_to_hydra_is_not_refused_before_hydra_reads_it(tmp_path):
    from sft.config.argv import refused_override

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text("defaults: [data_schema, _self_]\nmax_length: 64\n")
    assert refused_override(["--config-dir", str(tmp_path), "data=mine"]) is None
    assert refused_override([f"--config-dir={tmp_path}", "data=mine"]) is None


def test_check_only_composes_and_checks_without_training(capsys):
    """`python -m sft.train --check`: what ./launch.sh runs once before several processes."""
    from sft.config.argv import check_only

    assert check_only(["trainer.learning_rate=1e-4"]) == 0 and capsys.readouterr().out == "config: ok\n"
    assert check_only(["trainer.adam_beta1=3"]) == 2
    assert capsys.readouterr().err == "error: config: trainer.adam_beta1=3.0: must be in [0, 1)\n"
    assert check_only(["trainer.max_stepz=3"]) == 2
    assert capsys.readouterr().err.startswith("error: config: trainer.max_stepz: not a knob of trainer (did you mean "
                                              "trainer.max_steps?)")


@pytest.mark.slow
def test_launch_checks_the_config_with_the_world_size_its_processes_will_have():
    """./launch.sh --nproc N checks the config once before it starts N processes, as each of them will see it: sp.size=2
    for 3 processes is refused there, naming 3 (a check that saw 1 process refused every sp run)."""
    import subprocess

    from conftest import REPO

    proc = subprocess.run([str(REPO / "launch.sh"), "--nproc", "3", "sp=ulysses"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == ("error: config: sp.size=2: splits each sequence over 2 processes, "
                                                    "and this run has 3: launch a multiple of 2 (./launch.sh --nproc 2 ...)\n")
