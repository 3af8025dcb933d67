"""The two engines' config (`sft.training.processes.engines`): DeepSpeed's JSON file and rules, FSDP2's plugin fields
and its resume rule; the word before DeepSpeed's silent build of its CPU collectives."""

from pathlib import Path

import pytest
from conftest import assert_cli_refuses, composed
from omegaconf import OmegaConf

from sft.config import ConfigError, check


def test_a_deepspeed_json_file_is_taken_unchanged_with_keys_beside_path_on_top(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0.7,'
                  ' "zero_optimization": {"stage": 2, "overlap_comm": false}}')
    cfg = composed("deepspeed=file", f"deepspeed.path={ds}", "+deepspeed.zero_optimization.overlap_comm=true")
    check(cfg)
    assert OmegaConf.to_container(cfg.deepspeed) == {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0.7,
                                                     "zero_optimization": {"stage": 2, "overlap_comm": True}}


@pytest.mark.parametrize("content, reason", [
    (None, "deepspeed.path='{path}': cannot be read (No such file or directory)"),
    ('{"zero_optimization": {"stage": 3,}}', "deepspeed.path='{path}': not JSON: line 1 column 35: Expecting "
                                             "property name enclosed in double quotes"),
    ('[1, 2]', "deepspeed.path='{path}': must hold a JSON object, not list"),
    ('{"zero_optimization": {"stage": 3}}', "deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save: "
                                            "must be true with ZeRO-3"),
    ('{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}',
     "deepspeed.zero_optimization.offload_param={'device': 'cpu'}: parameter offload needs ZeRO stage 3"),
])
def test_a_bad_deepspeed_json_file_is_one_config_error_naming_it(tmp_path, content, reason):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        check(composed("deepspeed=file", f"deepspeed.path={path}"))
    assert str(e.value).startswith(reason.replace("{path}", str(path)))


def test_deepspeed_file_without_a_path_names_the_knob():
    with pytest.raises(ConfigError, match=r"deepspeed.path: missing: deepspeed=file takes deepspeed.path="):
        check(composed("deepspeed=file"))


def test_cli_deepspeed_file_that_is_not_json_exits_2_naming_the_position(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{\n  "zero_optimization": {"stage": 2\n}\n')
    assert_cli_refuses(tmp_path, f"error: config: deepspeed.path='{bad}': not JSON: line 4 column 1: Expecting ',' "
                                 "delimiter", "deepspeed=file", f"deepspeed.path={bad}")


def test_fsdp_offload_without_a_gpu_is_one_config_error(monkeypatch):
    import sft.training.processes.engines

    monkeypatch.setattr(sft.training.processes.engines, "cuda_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check(composed("fsdp=full_shard_offload"))
    assert str(e.value).startswith("fsdp.cpu_offload=True: moves GPU memory to the CPU, and needs a CUDA GPU")
    check(composed("fsdp=full_shard"))


def test_the_fsdp_group_becomes_accelerates_fsdp2_plugin_with_fsdps_own_activation_checkpointing(tmp_path):
    from transformers import TrainingArguments

    from sft.training.processes.engines import fsdp_fields

    cfg = composed("fsdp=full_shard_offload", "fsdp.layers=[Qwen2DecoderLayer]", "fsdp.reshard_after_forward=false")
    fields = fsdp_fields(cfg.fsdp, activation_checkpointing=True)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fields)
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["cpu_offload"] and not plugin["reshard_after_forward"]
    assert plugin["transformer_cls_names_to_wrap"] == "Qwen2DecoderLayer" and plugin["activation_checkpointing"]
    assert not args.activation_checkpointing  # Trainer's own would gather each layer once more in backward
    default = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                **fsdp_fields(composed("fsdp=full_shard").fsdp, False)).fsdp_plugin_args
    assert default["reshard_after_forward"] and not default.get("cpu_offload")
    assert "transformer_cls_names_to_wrap" not in default  # the model's own _no_split_modules


def test_deepspeeds_silent_build_of_its_cpu_collectives_is_announced_until_it_is_built(tmp_path, monkeypatch, caplog):
    """On a machine without a GPU, `deepspeed.comm` JIT-compiles a C++ op on first use (minutes, with no output):
    the run says so before it starts, and stops saying it once torch's extensions dir holds the built op."""
    import logging

    from torch.utils.cpp_extension import _get_build_directory

    from sft.training.processes.engines import SHM_COMM_OP, announce_deepspeed_comm_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")  # the other processes of a machine: silent (one of them builds it)
    with caplog.at_level(logging.WARNING, logger="sft"):
        announce_deepspeed_comm_build()
    assert SHM_COMM_OP not in caplog.text
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level(logging.WARNING, logger="sft"):
        announce_deepspeed_comm_build()
    assert f"the C++ op {SHM_COMM_OP}" in caplog.text and str(tmp_path) in caplog.text
    caplog.clear()
    built = Path(_get_build_directory(SHM_COMM_OP, verbose=False)) / f"{SHM_COMM_OP}.so"  # where torch's load puts it
    built.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="sft"):
        announce_deepspeed_comm_build()
    assert SHM_COMM_OP not in caplog.text
