"""The controller protocol (`sft.training.controllers.base`): every controller in one real run, one of your own (a
class and a YAML), its knobs from the config and only its learned state from a checkpoint."""

import json

import pytest
from conftest import log_history, plugin, run_train


@pytest.mark.slow
def test_all_controllers_in_one_real_run(tmp_path):
    proc = run_train("clip=autoclip", "clip.warmup_steps=3", "+controllers=[curriculum,early_stopping,lr_plateau,adaptive_eval]",
                     "controllers.curriculum.chunk_size=32", "controllers.early_stopping.patience=50",
                     "controllers.lr_plateau.patience=1", "controllers.adaptive_eval.min_steps=4",
                     "controllers.adaptive_eval.max_steps=16", "trainer.eval_steps=8", "trainer.max_steps=40",
                     "trainer.save_steps=40", "trainer.logging_steps=4", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "checkpoint-40" / "sft_state.json").read_text())
    ctl = state["controllers"]
    assert len(ctl["clip"]["history"]) == 40 and ctl["adaptive_eval"]["schedule"]
    assert ctl["curriculum"]["schedule"] and ctl["curriculum"]["chunk_temperatures"]
    evals = [e for e in json.loads((tmp_path / "checkpoint-40" / "trainer_state.json").read_text())["log_history"]
             if "eval_loss" in e]
    assert {"eval_token_accuracy", "eval_loss_bucket_0", "eval_loss_hardest_bucket"} <= set(evals[-1])
    assert [e["step"] for e in evals] != list(range(0, 41, 8))  # the interval moved off eval_steps
    logs = [e for e in json.loads((tmp_path / "checkpoint-40" / "trainer_state.json").read_text())["log_history"]
            if "loss" in e]
    thresholds = {e["clip/threshold"] for e in logs if "clip/threshold" in e}
    assert len(thresholds) > 2  # autoclip's threshold follows the measured norms
    assert "curriculum/temperature" in logs[-1] and "lr_plateau/scale" in logs[-1]


STOP_AT = '''
from sft.training.controllers import Controller


class StopAtStep(Controller):
    """Stops training once `step` optimizer steps are done."""

    def __init__(self, step: int = 3):
        self.step, self.stopped_at = step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step and self.stopped_at is None:
            self.stopped_at = state.global_step
            control.should_training_stop = True

    def log_values(self):
        return {"stop_at/step": self.step}
'''


STOP_AT_YAML = "# @package controllers.stop_at\n_target_: my_plugins.StopAtStep\nstep: 3\n"


QUICK = ["data.eval_file=null", "trainer.max_steps=10", "trainer.logging_steps=1", "trainer.save_steps=2",
         "trainer.report_to=[]"]


@pytest.mark.slow
def test_a_controller_of_your_own_is_one_class_and_one_yaml_file(tmp_path):
    search, env = plugin(tmp_path, STOP_AT, {"controllers/stop_at.yaml": STOP_AT_YAML})
    run = tmp_path / "run"
    proc = run_train(*search, "+controllers=stop_at", "controllers.stop_at.step=4", *QUICK, f"hydra.run.dir={run}",
                     env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["global_step"] == 4
    state = json.loads((run / "checkpoint-4" / "sft_state.json").read_text())["controllers"]
    assert state["stop_at"] == {"step": 4, "stopped_at": 4} and "guard" in state
    assert log_history(run, 4)[-2]["stop_at/step"] == 4


@pytest.mark.slow
def test_a_misspelt_knob_of_your_own_controller_is_refused_naming_it(tmp_path):
    search, env = plugin(tmp_path, STOP_AT, {"controllers/stop_at.yaml": STOP_AT_YAML})
    proc = run_train(*search, "+controllers=stop_at", "+controllers.stop_at.stpe=4", *QUICK,
                     f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "controllers.stop_at.stpe: not a parameter of my_plugins.StopAtStep (it takes: step)" in proc.stderr


def test_on_resume_the_knobs_come_from_the_config_and_only_the_learned_state_from_the_checkpoint():
    """`resume=auto clip.z_threshold=1` applies the new threshold: a checkpoint carries statistics, not
    settings (and a knob an older checkpoint did carry is ignored)."""
    from sft.training.controllers import TrainingGuard
    from sft.training.step.clipping import ZClip

    old = ZClip(warmup_steps=2, z_threshold=2.5)
    for norm in (1.0, 2.0, 3.0):
        old.observe(norm, old.threshold(norm))
    saved = json.loads(json.dumps(old.state_dict()))
    assert not {"z_threshold", "alpha", "warmup_steps", "max_norm"} & set(saved) and saved["steps"] == 3
    new = ZClip(warmup_steps=2, z_threshold=1.0)
    new.load_state_dict({**saved, "z_threshold": 2.5})
    assert new.z_threshold == 1.0 and new.state_dict() == saved

    guard = TrainingGuard(max_consecutive=3)
    guard.judge(1, float("nan"), 1.0)
    resumed = TrainingGuard(max_consecutive=5)
    resumed.load_state_dict({**json.loads(json.dumps(guard.state_dict())), "max_consecutive": 3})
    assert resumed.max_consecutive == 5 and resumed.consecutive == 1 and resumed.skipped_steps == guard.skipped_steps
