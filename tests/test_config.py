"""Composition rejects unknown keys and bad types; value checks name the field; presets compose."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import run_train
from sft.config import ConfigError, check, compose


def composed(*overrides):
    return compose("train", overrides)


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
        (["data.on_error=ignore"], "data.on_error"),
        (["data.overlong=cut"], "data.overlong"),
        (["model.dtype=float8"], "model.dtype"),
        (["lora=qlora"], "model.quantization"),
        (["model.quantization=nf4"], "model.quantization"),
        (["deepspeed=zero3", "deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save=false"],
         "deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save"),
        (["deepspeed=zero2", "+deepspeed.zero_optimization.offload_param={device: cpu}"],
         "deepspeed.zero_optimization.offload_param"),
        (["deepspeed=zero2", "deepspeed.zero_optimization.stage=4"], "deepspeed.zero_optimization.stage"),
        (["fsdp=full_shard", "deepspeed=zero3"], "fsdp"),
        (["fsdp=full_shard", "deepspeed=zero2"], "fsdp"),
        (["fsdp=full_shard", "fsdp.layers=[]"], "fsdp.layers"),
        (["clip=autoclip", "clip.percentile=0"], "clip.percentile"),
        (["clip=zclip", "clip.alpha=1.5"], "clip.alpha"),
        (["clip=zclip", "clip.warmup_steps=0"], "clip.warmup_steps"),
        (["+controllers=early_stopping", "controllers.early_stopping.patience=0"], "controllers.early_stopping.patience"),
        (["+controllers=early_stopping", "controllers.early_stopping.mode=up"], "controllers.early_stopping.mode"),
        (["+controllers=lr_plateau", "controllers.lr_plateau.factor=2"], "controllers.lr_plateau.factor"),
        (["+controllers=curriculum", "controllers.curriculum.min_temperature=5"], "controllers.curriculum.min_temperature"),
        (["+controllers=curriculum", "controllers.curriculum.factor=1"], "controllers.curriculum.factor"),
        (["+controllers=adaptive_eval", "controllers.adaptive_eval.min_steps=900"], "controllers.adaptive_eval.min_steps"),
        (["+controllers=adaptive_eval", "controllers.adaptive_eval.slow=0.5"], "controllers.adaptive_eval.slow"),
        (["+controllers=curriculum", "data=jsonl", "data.train_file=sft/sample_data/train.jsonl"], "controllers.curriculum"),
        (["+controllers=early_stopping", "trainer.eval_strategy=no"], "controllers.early_stopping"),
        (["controllers.guard.max_consecutive=0"], "controllers.guard.max_consecutive"),
        (["controllers.guard.spike_factor=0.5"], "controllers.guard.spike_factor"),
        (["controllers.watchdog.timeout_s=0"], "controllers.watchdog.timeout_s"),
        (["controllers.watchdog.timeout_s=3600"], "controllers.watchdog.timeout_s"),
        (["eval_buckets=[3.0,1.0]"], "eval_buckets"),
        (["loss.impl=fast"], "loss.impl"),
        (["loss=ce", "loss.chunk_tokens=0"], "loss.chunk_tokens"),
        (["throughput.peak_tflops=0"], "throughput.peak_tflops"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(overrides, key):
    with pytest.raises(ConfigError) as e:
        check(composed(*overrides))
    assert e.value.key == key and str(e.value).startswith(key)


@pytest.mark.parametrize("group", ["model=qwen2_5_7b", "model=qwen2_5_7b_random", "loss=ce", "data=jsonl", "lora=default", "lora=dora",
                                   "fsdp=full_shard", "fsdp=full_shard_offload",
                                   "clip=none", "clip=autoclip", "clip=zclip", "~controllers.guard", "~controllers.watchdog",
                                   "+controllers=early_stopping", "+controllers=lr_plateau", "+controllers=adaptive_eval",
                                   "+controllers=curriculum"])
def test_presets_compose(group):
    cfg = composed(group, "data.train_file=sft/sample_data/train.jsonl") if group == "data=jsonl" else composed(group)
    assert cfg is not None


def test_cli_bad_value_exits_2_with_one_line_and_no_traceback():
    proc = run_train("trainer.learning_rate=-1")
    assert proc.returncode == 2
    assert "trainer.learning_rate=-1.0: must be > 0" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_unknown_key_fails_naming_it():
    proc = run_train("loss.nope=1")
    assert proc.returncode != 0 and "nope" in proc.stderr and "Traceback" not in proc.stderr


def assert_cli_refuses(tmp_path, message: str, *overrides: str) -> None:
    """`python -m sft.train overrides...` exits 2 with `message` and no traceback."""
    proc = run_train(*overrides, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_cli_bad_data_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}], "difficulty_score": 1}\n')
    assert_cli_refuses(tmp_path, f"{bad}:1: messages: no assistant turn", "data=jsonl", f"data.train_file={bad}")


def test_gpu_7b_bench_preset_is_lora_on_qwen2_5_7b_shape_packed_bf16():
    cfg = compose("bench", ["preset=gpu_7b"])
    check(cfg)
    shape = cfg.model.random_init
    assert (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size) == (3584, 28, 152064)
    assert cfg.lora is not None and cfg.data.packing and cfg.trainer.bf16 and cfg.model.dtype == "bfloat16"
    assert cfg.loss.impl == "auto" and cfg.bench.steps == 20 and cfg.trainer.per_device_train_batch_size == 80


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


def test_help_lists_the_choices_and_the_composed_config_and_falls_back_to_hydra(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    def help_of(*args):
        return subprocess.run([sys.executable, "-m", "sft.train", "--help", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)

    fast = help_of("loss=ce")
    assert fast.returncode == 0, fast.stderr
    assert "\nloss: ce, dft, focal, hard_sample, keywords, length\n" in fast.stdout  # no *_schema entries
    assert "  _target_: sft.loss.builtin.CrossEntropyLoss\n" in fast.stdout  # the config as composed
    (tmp_path / "loss").mkdir()
    (tmp_path / "loss" / "mine.yaml").write_text("defaults:\n  - ce\n")
    own = help_of(f"hydra.searchpath=[file://{tmp_path}]", "loss=mine")  # a config dir of the user's
    assert own.returncode == 0, own.stderr
    assert "\nloss: ce, dft, focal, hard_sample, keywords, length, mine\n" in own.stdout
    bad = help_of("loss=nope")
    assert bad.returncode != 0 and "nope" in bad.stderr


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


def test_the_trainer_schema_is_every_training_arguments_field_of_the_installed_transformers():
    """sft/trainer_fields.py is generated from TrainingArguments; when transformers adds, removes or changes a
    field this fails until `python -m sft.config` writes it again. Each field is either in the schema or owned."""
    import dataclasses
    from pathlib import Path

    from transformers import TrainingArguments

    import sft.config
    from sft.config import TrainerConfig, trainer_fields_source

    committed = Path(sft.config.__file__).with_name("trainer_fields.py").read_text()
    assert committed == trainer_fields_source(), "sft/trainer_fields.py is stale: run python -m sft.config"
    theirs = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    ours = {f.name for f in dataclasses.fields(TrainerConfig)}
    assert ours | set(TrainerConfig.owned_fields) == theirs and not ours & set(TrainerConfig.owned_fields)


def test_any_training_arguments_field_is_set_without_plus_and_reaches_training_arguments():
    from sft.train import training_arguments

    cfg = composed("trainer.lr_scheduler_kwargs={min_lr:1e-5}", "trainer.lr_scheduler_type=cosine_with_min_lr",
                   "trainer.neftune_noise_alpha=5", "trainer.optim_args='betas=0.9'", "trainer.push_to_hub=false",
                   "trainer.dataloader_drop_last=true", "trainer.label_smoothing_factor=0.1")
    check(cfg)
    args = training_arguments(cfg, "/tmp/unused", resuming=False, max_grad_norm=1.0)
    assert args.lr_scheduler_kwargs == {"min_lr": 1e-5} and args.lr_scheduler_type == "cosine_with_min_lr"
    assert args.neftune_noise_alpha == 5.0 and args.optim_args == "betas=0.9" and args.dataloader_drop_last
    assert args.label_smoothing_factor == 0.1
    default = training_arguments(composed(), "/tmp/unused", resuming=False, max_grad_norm=1.0)
    assert default.learning_rate == 2e-3 and default.adam_beta2 == 0.98  # this project's defaults stand


@pytest.mark.parametrize("override", ["trainer.max_grad_norm=0.5", "+trainer.max_grad_norm=0.5",
                                      "trainer.remove_unused_columns=true"])
def test_cli_a_field_the_recipe_owns_names_the_knob_that_replaces_it(override):
    proc = run_train(override)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    key = override.lstrip("+").split("=")[0]
    from sft.config import TrainerConfig

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


def test_fsdp_offload_without_a_gpu_is_one_config_error(monkeypatch):
    import sft.config

    monkeypatch.setattr(sft.config, "_cuda_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check(composed("fsdp=full_shard_offload"))
    assert str(e.value).startswith("fsdp.cpu_offload=True: moves GPU memory to the CPU, and needs a CUDA GPU")
    check(composed("fsdp=full_shard"))


def test_an_fsdp_resume_of_plain_sgd_is_refused_before_any_model_is_built():
    from sft.train import check_fsdp_resume

    with pytest.raises(ConfigError) as e:
        check_fsdp_resume(composed("fsdp=full_shard", "trainer.optim=sgd"), "/runs/a/checkpoint-2")
    assert str(e.value).startswith("resume='/runs/a/checkpoint-2': FSDP cannot reload plain SGD's optimizer state")
    check_fsdp_resume(composed("fsdp=full_shard", "trainer.optim=sgd", 'trainer.optim_args="momentum=0.5"'), "c")
    check_fsdp_resume(composed("trainer.optim=sgd"), "c")  # without FSDP Trainer loads it
    check_fsdp_resume(composed("fsdp=full_shard", "trainer.optim=sgd"), None)  # a fresh run


def test_the_fsdp_group_becomes_accelerates_fsdp2_plugin_with_fsdps_own_activation_checkpointing(tmp_path):
    from transformers import TrainingArguments

    from sft.train import fsdp_fields

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


def test_a_tracker_that_is_not_installed_is_one_config_error(monkeypatch):
    import sft.config

    monkeypatch.setattr(sft.config, "_installed", lambda module: module != "mlflow")
    with pytest.raises(ConfigError) as e:
        check(composed("trainer.report_to=[tensorboard,mlflow]"))
    assert str(e.value) == ("trainer.report_to=['tensorboard', 'mlflow']: mlflow is not installed: "
                            "pip install mlflow-skinny")
    check(composed("trainer.report_to=[tensorboard]"))
