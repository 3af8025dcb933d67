"""What a resume may change (`sft.training.resume`): every differing setting is listed, those a checkpoint cannot
follow are refused naming them, as are another number of processes and a weights-only checkpoint."""

import pytest

from sft.config import ConfigError
from sft.training.resume import check_resume_processes, config_changes, fixed_on_resume


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


def test_a_resume_with_another_number_of_processes_or_from_a_weights_only_checkpoint_is_refused(monkeypatch):
    trainer = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "save_only_model": False}
    state = {"world_size": 1, "config": {"trainer": trainer}}
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^resume='ck': was saved by 1 process\(es\), this run has 2: the global "
                                          r"batch would go from 8 to 16 rows a step. Resume with 1 process\(es\) "
                                          r"\(./launch.sh --nproc 1\), or resume_force=true"):
        check_resume_processes("ck", state, force=False)
    check_resume_processes("ck", state, force=True)  # forced: said in the log, and resumed
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_resume_processes("ck", state, force=False)
    with pytest.raises(ConfigError, match="was saved with trainer.save_only_model=true: no optimizer state or "
                                          "schedule to continue"):
        check_resume_processes("ck", {**state, "config": {"trainer": {**trainer, "save_only_model": True}}}, False)
