"""The `trainer` group (`sft.training.arguments`): every TrainingArguments field of the installed transformers, set as
it is, with this project's defaults and checks."""

import pytest
from conftest import composed

from sft.config import ConfigError, check


def test_the_trainer_schema_is_every_training_arguments_field_of_the_installed_transformers():
    """sft/training/trainer_fields.py is generated from TrainingArguments; when transformers adds, removes or changes a
    field this fails until `python -m sft.config` writes it again. Each field is either in the schema or owned."""
    import dataclasses
    from pathlib import Path

    from transformers import TrainingArguments

    import sft.training
    from sft.training.arguments import TrainerConfig, trainer_fields_source

    committed = Path(sft.training.__file__).with_name("trainer_fields.py").read_text()
    assert committed == trainer_fields_source(), "sft/training/trainer_fields.py is stale: run python -m sft.config"
    theirs = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    ours = {f.name for f in dataclasses.fields(TrainerConfig)} - set(TrainerConfig.sft_fields)
    assert ours | set(TrainerConfig.owned_fields) == theirs and not ours & set(TrainerConfig.owned_fields)


def test_any_training_arguments_field_is_set_without_plus_and_reaches_training_arguments():
    from sft.run.build import arguments

    cfg = composed("trainer.lr_scheduler_kwargs={min_lr:1e-5}", "trainer.lr_scheduler_type=cosine_with_min_lr",
                   "trainer.neftune_noise_alpha=5", "trainer.optim_args='betas=0.9'", "trainer.push_to_hub=false",
                   "trainer.dataloader_drop_last=true", "trainer.label_smoothing_factor=0.1")
    check(cfg)
    args = arguments(cfg, "/tmp/unused", resuming=False, max_grad_norm=1.0)
    assert args.lr_scheduler_kwargs == {"min_lr": 1e-5} and args.lr_scheduler_type == "cosine_with_min_lr"
    assert args.neftune_noise_alpha == 5.0 and args.optim_args == "betas=0.9" and args.dataloader_drop_last
    assert args.label_smoothing_factor == 0.1
    default = arguments(composed(), "/tmp/unused", resuming=False, max_grad_norm=1.0)
    assert default.learning_rate == 2e-3 and default.adam_beta2 == 0.98  # this project's defaults stand


def test_a_tracker_that_is_not_installed_is_one_config_error(monkeypatch):
    import sft.config.schema

    monkeypatch.setattr(sft.config.schema, "installed", lambda module: module != "mlflow")
    with pytest.raises(ConfigError) as e:
        check(composed("trainer.report_to=[tensorboard,mlflow]"))
    assert str(e.value) == ("trainer.report_to=['tensorboard', 'mlflow']: mlflow is not installed: "
                            "pip install mlflow-skinny")
    check(composed("trainer.report_to=[tensorboard]"))


def test_a_field_the_installed_transformers_lacks_is_one_config_error_naming_the_pinned_version():
    # A GPU image with another transformers once met `activation_checkpointing` as a bare TypeError (issue 32).
    import transformers

    from sft.config.schema import ConfigError
    from sft.training.arguments import check_installed_fields

    check_installed_fields({"learning_rate": 1e-4, "activation_checkpointing": False})
    with pytest.raises(ConfigError) as e:
        check_installed_fields({"learning_rate": 1e-4, "a_field_of_another_version": 1})
    assert str(e.value) == (f"trainer: the installed transformers {transformers.__version__} has no "
                            f"a_field_of_another_version: sft's trainer fields are transformers "
                            f"{transformers.__version__}'s (pip install 'transformers=={transformers.__version__}', "
                            "the version pyproject.toml pins)")


def test_pyproject_pins_the_transformers_the_trainer_fields_were_generated_from():
    import re

    import transformers
    from conftest import REPO

    pin = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', (REPO / "pyproject.toml").read_text())
    low, high = (tuple(int(p) for p in v.split(".")) for v in pin.groups())
    installed = tuple(int(p) for p in transformers.__version__.split(".")[:3])
    assert low <= installed < high
    assert f"(transformers {transformers.__version__})" in (REPO / "sft/training/trainer_fields.py").read_text()


@pytest.mark.parametrize("overrides, words", [
    (["trainer.activation_offloading=true"], "activation_checkpointing=true too"),
    (["trainer.activation_offloading=true", "trainer.activation_checkpointing=true"],
     "on a CPU they are in host memory already"),
    (["trainer.activation_offloading=true", "trainer.activation_checkpointing=true", "fsdp=full_shard"],
     "FSDP2 checkpoints activations its own way"),
])
def test_activation_offloading_where_it_cannot_work_is_one_config_error(overrides, words, monkeypatch):
    from conftest import composed

    from sft.config import ConfigError, check

    if "fsdp=full_shard" in overrides:  # as on a GPU, where the FSDP2 refusal is the one left
        import sft.training.arguments

        monkeypatch.setattr(sft.training.arguments, "cuda_available", lambda: True)
    with pytest.raises(ConfigError) as e:
        check(composed(*overrides))
    assert e.value.key == "trainer.activation_offloading" and words in str(e.value)


@pytest.mark.parametrize("overrides, rate", [
    ([], 2e-3),  # the embedded tiny model's own
    (["model=smollm2_135m"], 2e-5),  # a real model, full fine-tune
    (["model=smollm2_135m", "lora=default"], 2e-4),  # a real model with LoRA
    (["model.name_or_path=/models/my-llama"], 2e-5),  # a real model's dir named in the tiny model's group
    (["model=smollm2_135m", "trainer.learning_rate=5e-5"], 5e-5),  # as given
])
def test_a_null_learning_rate_is_the_models_own_kind_of_rate(overrides, rate):
    """trainer.learning_rate=null (the default) is 2e-5 for a real model's full fine-tune and 2e-4 with LoRA, the tiny
    model's own 2e-3 only for the tiny model: a real model named in any group gets a real model's rate."""
    from sft.training.arguments import learning_rate

    assert learning_rate(composed(*overrides)) == rate


def test_a_null_optimizer_is_adamw_fused_on_a_gpu_and_the_multi_tensor_one_on_a_cpu(tmp_path):
    from sft.run.build import arguments
    from sft.training.arguments import optimizer_name

    assert optimizer_name(None, on_gpu=True) == "adamw_torch_fused"
    assert optimizer_name(None, on_gpu=False) == "adamw_torch"
    assert optimizer_name("sgd", on_gpu=True) == "sgd"  # as set
    args = arguments(composed(), str(tmp_path), resuming=False, max_grad_norm=1.0)
    assert args.optim == "adamw_torch"  # this machine has no GPU


@pytest.mark.slow  # two short runs
def test_fused_adamw_trains_to_the_losses_and_weights_of_the_multi_tensor_one(tmp_path):
    """The GPU's default optimizer is the same update: checked on this CPU, where PyTorch fuses AdamW too."""
    import torch

    from sft.run.build import build

    def trained(*overrides):
        trainer = build(composed("data.eval_file=null", "trainer.max_steps=3", "trainer.logging_steps=1",
                                 "trainer.report_to=[]", "trainer.save_strategy=no", "trainer.weight_decay=0.1",
                                 *overrides), str(tmp_path / str(len(overrides)))).trainer
        trainer.train()
        return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e]

    fused, fused_losses = trained("trainer.optim=adamw_torch_fused")
    plain, plain_losses = trained()
    assert fused.optimizer.defaults["fused"] and not plain.optimizer.defaults.get("fused")
    assert fused_losses == pytest.approx(plain_losses, rel=1e-6)
    for ours, theirs in zip(fused.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides, on_gpu, key, words", [
    ([], False, "trainer.use_liger_kernel", "Liger's kernels are Triton's, which run on a CUDA GPU"),
    (["trainer.liger_kernel_config={fused_linear_cross_entropy: true}"], True, "trainer.liger_kernel_config",
     "sft computes the loss from the decoder's output itself"),
])
def test_liger_where_it_cannot_work_is_one_config_error(overrides, on_gpu, key, words, monkeypatch):
    import sft.training.arguments

    monkeypatch.setattr(sft.training.arguments, "cuda_available", lambda: on_gpu)
    with pytest.raises(ConfigError) as e:
        check(composed("trainer.use_liger_kernel=true", *overrides))
    assert e.value.key == key and words in str(e.value)


def test_liger_patches_the_layers_only_of_a_family_it_has_kernels_for(monkeypatch):
    """sft's loss stays its own (Liger's cross entropy off); a family outside liger-kernel's table, which it would
    leave unpatched saying so at info level, is refused."""
    import importlib.util
    import sys
    import types

    import sft.model.liger
    from sft.model.liger import liger_config, liger_refusal

    assert liger_config(None) == {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                                  "fused_linear_cross_entropy": False}
    assert liger_config({"rope": False})["rope"] is False  # a kernel turned off as asked
    if importlib.util.find_spec("liger_kernel") is None:  # as on this project's CPU machines
        assert liger_refusal("qwen2", compile_layers=False) == ("liger-kernel is not installed "
                                                                "(pip install -e '.[gpu]')")
    monkeypatch.setattr(sft.model.liger, "version", lambda name: "0.8.5")
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "qwen2": None}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    assert liger_refusal("qwen2", compile_layers=False) is None
    assert liger_refusal("lfm2", compile_layers=False) == ("liger-kernel 0.8.5 has no kernels for lfm2 (it patches "
                                                           "llama, qwen2): set it to false")
    assert "not checked together" in liger_refusal("qwen2", compile_layers=True)


def test_a_null_data_loader_is_two_workers_on_a_gpu_and_none_on_a_cpu():
    """On a GPU the collator's work (batching, finding the trained tokens) runs in workers beside the step; on a CPU its
    cores train. A number set is kept."""
    from sft.training.arguments import resolve_nulls

    for on_gpu, use_cpu, given, expected in ((True, False, None, 2), (False, False, None, 0), (True, True, None, 0),
                                             (True, False, 0, 0), (False, False, 3, 3)):
        fields = {"optim": None, "activation_checkpointing": None, "use_cpu": use_cpu, "dataloader_num_workers": given}
        resolve_nulls(fields, on_gpu)
        assert fields["dataloader_num_workers"] == expected, (on_gpu, use_cpu, given)
