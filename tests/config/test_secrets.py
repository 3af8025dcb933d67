"""Secrets in a config (`sft.config.secrets`): masked wherever a config is written, moved off the command line."""

import os

import pytest

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
