"""`python -m sft.train` as a user runs it: results, checkpoints, TensorBoard, resume, LoRA, W&B offline."""

import json
from pathlib import Path

import pytest
import torch
from conftest import SMALL_EVAL, run_train

QUICK = ["trainer.per_device_train_batch_size=8", "trainer.eval_steps=3", "trainer.logging_steps=1",
         f"data.eval_file={SMALL_EVAL}"]


@pytest.mark.slow
def test_train_writes_results_checkpoint_and_events_then_resumes(tmp_path):
    run = tmp_path / "run"
    first = run_train(*QUICK, "trainer.max_steps=6", "trainer.save_steps=3", f"hydra.run.dir={run}")
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert set(results) >= {"eval_loss_initial", "eval_loss", "train_loss", "global_step",
                            "train_tokens_per_second", "data_hash"}
    assert results["global_step"] == 6 and results["eval_loss"] < results["eval_loss_initial"]
    assert results["train_tokens_per_second"] > 0 and len(results["data_hash"]) == 16
    assert (run / "checkpoint-6" / "model.safetensors").exists() and (run / "checkpoint-3").exists()
    assert (run / "model" / "model.safetensors").exists() and (run / "model" / "tokenizer.json").exists()
    assert list(run.glob("runs/*/events.out.tfevents.*")), "no TensorBoard events in the run dir"
    assert (run / ".hydra" / "config.yaml").exists()
    assert f"run dir: {run}" in first.stdout
    # Trainer evaluated at step 6 (eval_steps=3): that is the final evaluation, not repeated.
    assert [e["step"] for e in results["eval_history"]] == [0, 3, 6] and (run / "eval_rows.jsonl").exists()

    second = run_train(*QUICK, "trainer.max_steps=8", "trainer.save_steps=3", "resume=auto", f"hydra.run.dir={run}")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = json.loads((run / "results.json").read_text())
    assert resumed["resumed_from"] == str(run / "checkpoint-6")
    assert resumed["global_step"] == 8 and resumed["eval_loss_initial"] == results["eval_loss_initial"]
    state = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())
    steps_logged = [e["step"] for e in state["log_history"] if "loss" in e]
    assert steps_logged[-2:] == [7, 8] and 6 in steps_logged  # the history continued, not restarted
    assert [e["step"] for e in resumed["eval_history"]] == [0, 3, 6, 8]  # no eval at step 8 until the final one


@pytest.mark.slow
def test_eval_strategy_no_never_evaluates(tmp_path):
    proc = run_train(*QUICK, "trainer.max_steps=2", "trainer.eval_strategy=no", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["eval_history"] == [] and results["eval_loss"] is None and results["eval_loss_initial"] is None
    assert not (tmp_path / "eval_rows.jsonl").exists()


@pytest.mark.slow
def test_wandb_offline_logging(tmp_path):
    run = tmp_path / "run"
    proc = run_train(*QUICK, "trainer.max_steps=2", "trainer.report_to=[wandb]", f"hydra.run.dir={run}",
                     env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(Path(tmp_path).glob("wandb/offline-run-*/run-*.wandb"))


@pytest.mark.slow
def test_a_cold_and_a_warm_data_cache_give_the_same_initial_adapter(tmp_path):
    """Tokenising (the first run of a data config) draws random numbers, loading the cache does not: the model
    and its LoRA adapters are initialised after a fresh seed, so both runs start from the same weights."""
    from safetensors.torch import load_file

    common = ["lora=default", "trainer.max_steps=1", "trainer.learning_rate=1e-12", "trainer.eval_strategy=no",
              "trainer.report_to=[]", "trainer.save_strategy=no"]
    env = {"SFT_CACHE": str(tmp_path / "cache")}
    cold = run_train(*common, f"hydra.run.dir={tmp_path}/cold", env=env)
    warm = run_train(*common, f"hydra.run.dir={tmp_path}/warm", env=env)
    assert cold.returncode == 0 and warm.returncode == 0, (cold.stderr + warm.stderr)[-3000:]
    assert "from cache" not in (tmp_path / "cold/train.log").read_text()
    assert "from cache" in (tmp_path / "warm/train.log").read_text()
    a, b = (load_file(tmp_path / run / "model/adapter_model.safetensors") for run in ("cold", "warm"))
    lora_a = [k for k in a if "lora_A" in k]
    assert lora_a and all(torch.equal(a[k], b[k]) for k in lora_a)


@pytest.mark.slow  # a short run
def test_a_policy_that_does_not_clip_hands_trainer_no_threshold(tmp_path):
    """`clip=none` (or `clip.max_norm=0`) is `max_grad_norm=0` in TrainingArguments, which the trackers log: no
    stand-in threshold; the steps still reach step control (`_get_grad_norm`)."""
    from conftest import composed

    from sft.run.build import build

    none = build(composed("clip=none", "data.eval_file=null"), str(tmp_path / "a")).trainer
    static = build(composed("clip.max_norm=0.5", "data.eval_file=null"), str(tmp_path / "b")).trainer
    assert none.args.max_grad_norm == 0 and static.args.max_grad_norm == 0.5
    assert {"preemption", "guard", "watchdog"} == set(none.controllers)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["preemption", "trainer"])
def test_a_controller_named_as_a_key_of_the_checkpoint_state_is_refused(tmp_path, name):
    from conftest import assert_cli_refuses

    assert_cli_refuses(tmp_path, f"error: config: controllers.{name}: is the name of ",
                       f"+controllers.{name}._target_=sft.training.controllers.EarlyStopping", "trainer.max_steps=1")


@pytest.mark.slow
def test_torch_compile_trains_lora_on_packed_rows_with_the_lean_loss_as_eager_does(tmp_path):
    """`trainer.torch_compile=true` (inductor, on this CPU) with LoRA, packing (sdpa_varlen) and the chunked loss:
    the same step losses as the eager run."""
    from conftest import step_losses

    common = ["lora=default", "data.packing=true", "trainer.max_steps=2", "trainer.logging_steps=1",
              "trainer.save_steps=2", "trainer.eval_strategy=no", "data.eval_file=null"]
    losses = {}
    for compiled in ("false", "true"):
        run = tmp_path / compiled
        proc = run_train(*common, f"trainer.torch_compile={compiled}", f"hydra.run.dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads((run / "results.json").read_text())["loss_impl"] == "chunked"
        losses[compiled] = step_losses(run, 2)
    assert len(losses["true"]) == 2 and losses["true"] == pytest.approx(losses["false"], rel=1e-4)
