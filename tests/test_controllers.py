"""Each controller on synthetic metric sequences, all of them together in one short real run, and one of
your own (a class and a YAML file outside sft/) through the command line."""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import log_history, plugin, run_train
from sft.training.controllers import (AdaptiveEvalInterval, Curriculum, CurriculumSampler, EarlyStopping, ReduceLROnPlateau)


def test_early_stopping_after_patience_evaluations_without_improvement():
    es = EarlyStopping(patience=2, min_delta=0.01)
    decisions = [es.should_stop(v) for v in [3.0, 2.5, 2.495, 2.6, 2.0, 2.1, 2.1]]
    # 2.495 is within min_delta: no improvement; 2.6 worse: stop. After 2.0 the count restarts.
    assert decisions == [False, False, False, True, False, False, True]


def test_early_stopping_in_max_mode():
    es = EarlyStopping(metric="eval_token_accuracy", patience=1, mode="max")
    assert [es.should_stop(v) for v in [0.5, 0.6, 0.55]] == [False, False, True]


def test_plateau_scales_the_schedulers_base_lr_and_the_optimizer():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    plateau = ReduceLROnPlateau(factor=0.1, patience=2, min_lr=0.005)
    control, state = SimpleNamespace(), SimpleNamespace(global_step=0)
    for step, value in enumerate([1.0, 1.0, 1.0, 0.5, 0.6, 0.7, 0.8, 0.9]):
        state.global_step = step
        plateau.on_evaluate(None, state, control, metrics={"eval_loss": value}, lr_scheduler=sched, optimizer=opt)
    assert [r["step"] for r in plateau.reductions] == [2, 5, 7]
    assert sched.base_lrs == [pytest.approx(0.005)]  # 1 -> 0.1 -> 0.01 -> floor 0.005
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0025)  # the schedule's shape is kept: 0.5 x base


def test_curriculum_temperature_falls_while_improving_and_rises_when_stalled():
    c = Curriculum(temperature=4.0, factor=0.5, min_temperature=0.5, max_temperature=8.0)
    temps = [c.move(v) for v in [3.0, 2.0, 1.5, 1.5, 1.6, 1.0, 1.0, 1.0, 1.0]]
    assert temps == [2.0, 1.0, 0.5, 1.0, 2.0, 1.0, 2.0, 4.0, 8.0]


def test_curriculum_sampler_favours_hard_rows_at_low_temperature_and_replays_exactly():
    scores = [0.5] * 50 + [4.0] * 50
    c = Curriculum(temperature=100.0, chunk_size=20)
    sampler = CurriculumSampler(scores, c, seed=0)
    uniform = list(sampler)
    c.current_temperature = 0.3
    c.epoch = 1
    hard = list(sampler)
    assert 35 <= sum(i >= 50 for i in uniform) <= 65
    assert sum(i >= 50 for i in hard) > 90
    # A resumed run restores the recorded temperatures and draws the same rows, whatever T is now.
    replay = Curriculum(chunk_size=20)
    replay.load_state_dict(json.loads(json.dumps(c.state_dict())))
    replay.current_temperature, replay.epoch = 7.0, 1
    assert list(CurriculumSampler(scores, replay, seed=0)) == hard


def test_adaptive_eval_interval_halves_when_fast_doubles_when_flat_within_bounds():
    a = AdaptiveEvalInterval(min_steps=10, max_steps=80, fast=0.05, slow=0.005)
    a.interval = 40
    intervals = [a.next_interval(v) for v in [5.0, 4.0, 3.5, 3.49, 3.489, 3.4889, 3.48889, 3.488889]]
    assert intervals == [40, 20, 10, 20, 40, 80, 80, 80]


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
    from sft.training.clipping import ZClip
    from sft.training.controllers import TrainingGuard

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
