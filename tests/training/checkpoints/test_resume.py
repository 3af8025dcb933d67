"""What a resume may change (`sft.training.checkpoints.resume`): every differing setting is listed, those a checkpoint
cannot follow are refused naming them, as are another number of processes and a weights-only checkpoint."""

import pytest

from sft.config import ConfigError
from sft.training.checkpoints.resume import (batch_for_ranks, check_resume_processes, config_changes, data_ranks,
                                             fixed_on_resume, refused_on_resume)


def test_config_changes_list_every_differing_leaf_and_which_a_resume_refuses():
    saved = {"trainer": {"learning_rate": 2e-4, "seed": 42}, "lora": None, "model": {"name": "tiny"},
             "clip": {"max_norm": 1.0}, "resume": None}
    current = {"trainer": {"learning_rate": 1e-4, "seed": 42}, "lora": {"r": 16}, "model": {"name": "tiny"},
               "clip": {"max_norm": 0.01}, "resume": "auto"}
    assert config_changes(saved, current) == [("clip.max_norm", 1.0, 0.01), ("lora", None, "<absent>"),
                                              ("lora.r", "<absent>", 16), ("trainer.learning_rate", 2e-4, 1e-4)]
    assert [key for key, _, _ in config_changes(saved, current) if fixed_on_resume(key)] == ["lora", "lora.r"]
    assert not fixed_on_resume("model.attn_implementation") and fixed_on_resume("model.pretrained_model_name_or_path")
    assert fixed_on_resume("deepspeed") and not fixed_on_resume("deepspeed.gradient_clipping")
    assert fixed_on_resume("trainer.precision")  # pure keeps the fp32 weights in the optimizer, mixed in the model


def test_a_checkpoint_saved_before_the_null_optimizer_resumes_under_it_and_another_optimizer_is_refused():
    """`trainer.optim` was `adamw_torch` before null (AdamW, fused on a GPU) became the default: one AdamW state."""
    assert not refused_on_resume("trainer.optim", "adamw_torch", None)
    assert not refused_on_resume("trainer.optim", "adamw_torch_fused", "adamw_torch")
    assert refused_on_resume("trainer.optim", "adamw_torch", "adafactor")
    assert refused_on_resume("trainer.optim", None, "sgd") and refused_on_resume("lora.r", 8, 16)


def test_another_number_of_processes_keeps_the_steps_rows_and_a_weights_only_checkpoint_is_refused(monkeypatch):
    trainer = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "save_only_model": False}
    state = {"world_size": 1, "config": {"trainer": trainer}}
    monkeypatch.setenv("WORLD_SIZE", "2")  # 8 rows a step: 4 x 2 on one rank, 4 x 1 on each of two
    assert check_resume_processes("ck", state, force=False) == {"per_device_train_batch_size": 4,
                                                                "gradient_accumulation_steps": 1}
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert check_resume_processes("ck", state, force=False) == {}
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"^resume='ck': was saved by 1 process\(es\), this run has 3: its 8 rows a "
                                          r"step do not divide over 3 rank\(s\). Resume with 1 process\(es\) "
                                          r"\(./launch.sh --nproc 1\) or a number that divides 8$"):
        check_resume_processes("ck", state, force=False)
    assert check_resume_processes("ck", state, force=True) == {}  # forced: said in the log, the batch as configured
    deepspeed = {"world_size": 2, "config": {"trainer": trainer, "deepspeed": {"zero_optimization": {"stage": 3}}}}
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"with DeepSpeed, this run has 4: a DeepSpeed checkpoint is partitioned for "
                                          r"its number of ranks.*ds_to_universal"):
        check_resume_processes("ck", deepspeed, force=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="was saved with trainer.save_only_model=true: no optimizer state or "
                                          "schedule to continue"):
        check_resume_processes("ck", {**state, "config": {"trainer": {**trainer, "save_only_model": True}}}, False)


@pytest.mark.parametrize("batch, accumulation, saved, now, kept", [
    (2, 1, 2, 1, (2, 2)), (4, 1, 1, 2, (2, 1)), (2, 3, 2, 4, (1, 3)), (3, 1, 2, 4, None), (4, 4, 8, 4, (4, 8)),
    (8, 1, 4, 8, (4, 1)), (6, 1, 1, 4, None)])
def test_the_rows_of_a_step_on_another_number_of_ranks(batch, accumulation, saved, now, kept):
    assert batch_for_ranks(batch, accumulation, saved, now) == kept
    if kept is not None:
        assert kept[0] * kept[1] * now == batch * accumulation * saved and kept[0] <= batch


def test_sequence_parallel_groups_count_as_one_data_rank():
    assert data_ranks(8, {"sp": {"size": 4}}) == 2 and data_ranks(8, {"sp": None}) == 8 and data_ranks(2, {}) == 2
