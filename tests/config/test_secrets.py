"""Secrets in a config (`sft.config.secrets`): masked wherever a config is written, moved off the command line."""

import os

import pytest
from conftest import run_train

from sft.config.secrets import MASK, environment_name, is_secret, masked, secrets_to_environment


@pytest.mark.parametrize("key, secret", [("hub_token", True), ("token", True), ("api_key", True),
                                         ("wandb_apikey", True), ("password", True), ("db_secret", True),
                                         ("pad_token", False), ("eos_token", False), ("max_new_tokens", False),
                                         ("chunk_tokens", False), ("stop_tokens", False), ("tokenizer", False)])
def test_a_secret_is_named_so(key, secret):
    assert is_secret(key) is secret


def test_masked_hides_set_secrets_at_any_depth_and_keeps_the_rest():
    config = {"trainer": {"hub_token": "hf_abc", "learning_rate": 1e-4},
              "controllers": {"notify": {"api_key": "k", "channel": "#runs"}}, "x": [{"password": "p"}],
              "model": {"token": None}}
    assert masked(config) == {"trainer": {"hub_token": MASK, "learning_rate": 1e-4},
                              "controllers": {"notify": {"api_key": MASK, "channel": "#runs"}}, "x": [{"password": MASK}],
                              "model": {"token": None}}
    assert config["trainer"]["hub_token"] == "hf_abc"  # a copy


def test_a_secret_on_the_command_line_moves_to_the_environment(monkeypatch):
    name = environment_name("trainer.hub_token")
    for key in (name, environment_name("controllers.n.api_key")):
        monkeypatch.setenv(key, "before")  # restored (removed) after the test
    argv = ["-m", "trainer.hub_token=hf_abc", "+controllers.n.api_key='k 1'", "trainer.learning_rate=1e-4",
            "trainer.hub_token=null"]
    moved = secrets_to_environment(argv)
    assert moved == ["-m", f"trainer.hub_token=${{oc.env:{name}}}",
                     f"+controllers.n.api_key=${{oc.env:{environment_name('controllers.n.api_key')}}}",
                     "trainer.learning_rate=1e-4", "trainer.hub_token=null"]
    assert os.environ[name] == "hf_abc" and os.environ[environment_name("controllers.n.api_key")] == "k 1"
    from sft.config.registry import compose

    assert compose("train", moved[1:2]).trainer.hub_token == "hf_abc"  # the config still resolves to it


@pytest.mark.slow
def test_a_secret_template_kwarg_is_in_no_file_of_the_run(tmp_path):
    """`tokenizer.chat_template_kwargs.api_key` renders the template, and is written nowhere in clear: not in the
    checkpoints' state, the log, the saved chat template's defaults, the data hash's record, the TensorBoard events."""
    run = tmp_path / "run"
    proc = run_train("+tokenizer.chat_template_kwargs.api_key=sk-LEAKED-42", "trainer.max_steps=2",
                     "trainer.save_steps=2", "trainer.eval_strategy=no", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    leaks = [p for p in run.rglob("*") if p.is_file() and b"sk-LEAKED-42" in p.read_bytes()]
    assert leaks == [] and "sk-LEAKED-42" not in proc.stdout + proc.stderr
    assert "chat_template_kwargs.api_key is a secret: not made a default" in (run / "train.log").read_text()
