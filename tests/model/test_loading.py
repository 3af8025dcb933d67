"""Model loading (`sft.model.loading`): a random-init architecture from its config, config overrides, attention
implementations."""

import os

import pytest

from sft.config import compose


def test_random_init_builds_the_given_architecture_without_weights_on_disk():
    from sft.model.loading import load_model

    shape = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = load_model("no/such/model", random_init=shape)
    assert model.config.hidden_size == 64 and model.lm_head.weight.shape == (1000, 64)
    assert len(model.model.layers) == 2
    # The shape given on the command line: added to the empty dict (into a null node, OmegaConf's merge would
    # raise an AttributeError); without the +, Hydra's own message says to add it.
    cfg = compose("train", ["+model.random_init={model_type: qwen2, hidden_size: 64}"])
    assert cfg.model.random_init == {"model_type": "qwen2", "hidden_size": 64}
    with pytest.raises(Exception, match=r"To append to your config use \+model.random_init="):
        compose("train", ["model.random_init={model_type: qwen2}"])


def test_a_config_override_the_model_does_not_have_is_refused():
    from sft.config import ConfigError
    from sft.model.loading import load_model

    with pytest.raises(ConfigError, match="model.config_overrides.output_router_logits=True: Qwen2Config has no "
                                          "field 'output_router_logits'"):
        load_model("tiny", config_overrides={"output_router_logits": True})
    with pytest.raises(ConfigError, match=r"model.config_overrides=\{'intermediate_size': 96\}: changes the shape of "
                                          "tiny's weights, which then cannot load"):
        load_model("tiny", config_overrides={"intermediate_size": 96})


@pytest.mark.slow  # the command in a process of its own
@pytest.mark.parametrize("env, why", [({"HF_HUB_OFFLINE": "1"}, "the hub is off (HF_HUB_OFFLINE)"),
                                      ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub cannot be reached")])
def test_a_model_neither_on_disk_nor_reachable_is_one_line_at_once_saying_how_to_point_at_a_local_copy(
        tmp_path, env, why):
    import subprocess
    import sys
    import time

    from conftest import REPO

    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sft", "inspect", "model=qwen2_5_7b", "--rows", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf"), **env})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: config: model.name_or_path='Qwen/Qwen2.5-7B-Instruct': is not on this "
                                  f"machine (no such dir, not in the hub's cache) and {why}")
    assert "set model.name_or_path=<dir>, or train a GGUF file: model.gguf_file=<file.gguf>" in proc.stderr
    assert time.perf_counter() - started < 30  # not a minute of retries


def test_a_local_path_that_is_no_dir_is_refused_by_name():
    from sft.config import ConfigError
    from sft.model.loading import check_reachable

    with pytest.raises(ConfigError, match="^name_or_path='/no/such/model': no such model dir$"):
        check_reachable("/no/such/model")


def test_lists_and_dicts_from_the_command_line_reach_the_configs_as_plain_python():
    """OmegaConf's ListConfig and DictConfig would fail transformers' strict config fields (`layer_types`)."""
    from hydra.utils import instantiate

    cfg = compose("train", ["+model.config_overrides.layer_types=[full_attention,full_attention,sliding_attention,"
                            "full_attention]", "+model.config_overrides.use_sliding_window=true",
                            "+tokenizer.chat_template_kwargs.tools_shown=[a,b]",
                            "+tokenizer.chat_template_kwargs.extra={depth:2}"])
    model = instantiate(cfg.model)
    assert type(model.config.layer_types) is list and model.config.layer_types[2] == "sliding_attention"
    kwargs = instantiate(cfg.tokenizer).sft_chat.kwargs
    assert type(kwargs["tools_shown"]) is list and type(kwargs["extra"]) is dict


def test_ddp_looks_for_unused_parameters_only_in_models_that_may_leave_some_unused():
    """A mixture of experts (an expert no token reached) or a model with a vision tower (text rows never reach it)
    may leave parameters without a gradient; a dense text model never does, and DDP need not look after each step."""
    from transformers import Gemma3Config, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig

    from sft.model.loading import may_leave_parameters_unused

    assert may_leave_parameters_unused(Qwen3MoeConfig()) and may_leave_parameters_unused(MixtralConfig())
    assert may_leave_parameters_unused(Gemma3Config())  # image-text-to-text: a SigLIP tower
    assert not may_leave_parameters_unused(Qwen2Config()) and not may_leave_parameters_unused(LlamaConfig())
