"""Gradient clipping policies on synthetic norms, a 100x gradient spike in real runs, and a policy of your
own (a class and a YAML file outside sft/) through the command line."""

import json
import math
import statistics

import pytest
import torch
from conftest import SMALL_EVAL, log_history, plugin, run_patched, run_train
from safetensors.torch import load_file

from sft.training.step.clipping import AutoClip, GradClipPolicy, StaticClip, ZClip


def feed(policy, norms, known_norm=True):
    thresholds = []
    for n in norms:
        t = policy.threshold(n if known_norm else None)
        policy.observe(n, t)
        thresholds.append(t)
    return thresholds


def test_static_clips_at_max_norm_and_none_never_clips():
    assert feed(StaticClip(max_norm=0.5), [0.1, 2.0]) == [0.5, 0.5]
    none = GradClipPolicy()
    assert feed(none, [5.0, 50.0]) == [math.inf, math.inf] and none.clipped_steps == 0


def test_autoclip_threshold_is_the_percentile_of_past_norms():
    policy = AutoClip(percentile=50, warmup_steps=3, max_norm=10.0)
    thresholds = feed(policy, [4.0, 2.0, 6.0, 8.0, 1.0])
    assert thresholds[:3] == [10.0, 10.0, 10.0]  # warmup
    assert thresholds[3] == pytest.approx(statistics.median([4.0, 2.0, 6.0]))
    assert thresholds[4] == pytest.approx(statistics.median([4.0, 2.0, 6.0, 8.0]))
    assert policy.clipped_steps == 1 and policy.last_clipped is False  # 8.0 > 4.0 was clipped, 1.0 was not


def test_autoclip_moves_with_the_measured_norms():
    policy = AutoClip(percentile=10, warmup_steps=2, max_norm=100.0)
    feed(policy, [1.0] * 20)
    low = policy.threshold()
    feed(policy, [5.0] * 200)
    assert low == pytest.approx(1.0) and policy.threshold() == pytest.approx(5.0)


def test_zclip_seeds_from_warmup_and_pulls_spikes_back_toward_the_mean():
    policy = ZClip(alpha=0.9, z_threshold=2.0, warmup_steps=4, max_norm=100.0)
    feed(policy, [1.0, 1.2, 0.8, 1.0])
    mean, std = 1.0, math.sqrt(statistics.pvariance([1.0, 1.2, 0.8, 1.0]))
    assert policy.mean == pytest.approx(mean) and math.sqrt(policy.var) == pytest.approx(std)
    assert policy.threshold(1.1) == math.inf  # z = 0.7: not clipped
    spike = 100.0
    z = (spike - mean) / std
    expected = mean + (2.0 ** 2 / z) * std  # the ZClip paper's reciprocal clipping
    assert policy.threshold(spike) == pytest.approx(expected)
    assert policy.threshold(None) == pytest.approx(mean + 2.0 * std)  # DeepSpeed: decided before the norm
    feed(policy, [spike])
    assert policy.last_clipped and policy.mean < 1.2  # the spike entered the EMA only as clipped


def test_policy_state_round_trips():
    a = ZClip(warmup_steps=2)
    feed(a, [1.0, 2.0, 1.5, 9.0])
    b = ZClip(warmup_steps=2)
    b.load_state_dict(a.state_dict())
    assert b.threshold(5.0) == a.threshold(5.0) and b.log_values() == a.log_values()


SPIKE = """
from sft.training.trainer import WeightedLossTrainer
_compute = WeightedLossTrainer.compute_loss
def compute_loss(self, model, inputs, *args, **kwargs):
    loss = _compute(self, model, inputs, *args, **kwargs)
    if model.training and self.state.global_step == 5:  # the update from step 5 to 6
        loss = loss * 100
    return loss
WeightedLossTrainer.compute_loss = compute_loss
"""


SGD = ["trainer.optim=sgd", "trainer.learning_rate=0.1", "trainer.lr_scheduler_type=constant",
       "trainer.warmup_steps=0", "trainer.max_steps=6", "trainer.save_steps=5", "trainer.save_total_limit=10",
       "trainer.logging_steps=1", "trainer.eval_steps=100", "trainer.per_device_train_batch_size=4",
       f"data.eval_file={SMALL_EVAL}"]


# Under DeepSpeed the policy's threshold is handed to the engine before each step (sft.training.step.control);
# test_step_control.py checks on a real ZeRO-2 engine that the engine clips to it.
@pytest.mark.slow
@pytest.mark.parametrize("clip", [
    ["clip=autoclip", "clip.warmup_steps=2", "clip.percentile=50"],
    ["clip=zclip", "clip.warmup_steps=3"],
], ids=["autoclip", "zclip"])
def test_a_100x_gradient_spike_is_clipped_to_the_threshold(tmp_path, clip):
    proc = run_patched(SPIKE, *SGD, *clip, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    step6 = next(e for e in log_history(tmp_path, 6) if e.get("step") == 6 and "loss" in e)
    normal = [e["grad_norm"] for e in log_history(tmp_path, 6) if "grad_norm" in e and e["step"] < 6]
    assert step6["grad_norm"] > 20 * max(normal), "no spike reached the gradient"
    assert step6["clip/clipped"] == 1.0
    before = load_file(tmp_path / "checkpoint-5" / "model.safetensors")
    after = load_file(tmp_path / "checkpoint-6" / "model.safetensors")
    update = torch.sqrt(sum(((after[k] - before[k]) ** 2).sum() for k in before))
    # SGD: the update is lr x the applied gradient, whose norm the threshold bounds.
    assert update / 0.1 <= step6["clip/threshold"] * (1 + 1e-3)
    assert update / 0.1 >= 0.5 * step6["clip/threshold"]  # and the step did happen, clipped, not skipped


HALVING = '''
from sft.training.step.clipping import GradClipPolicy


class HalvingClip(GradClipPolicy):
    """Clips to `max_norm`, halved every `every` steps."""

    def __init__(self, max_norm: float = 1.0, every: int = 2):
        super().__init__()
        self.max_norm, self.every = max_norm, every

    def threshold(self, norm=None):
        return self.max_norm / 2 ** (self.steps // self.every)
'''


@pytest.mark.slow
def test_a_clip_policy_of_your_own_is_one_class_and_one_yaml_file(tmp_path):
    search, env = plugin(tmp_path, HALVING, {"clip/halving.yaml": "_target_: my_plugins.HalvingClip\nmax_norm: 0.4\nevery: 3\n"})
    run = tmp_path / "run"
    proc = run_train(*search, "clip=halving", "clip.every=2", *SGD[:-2], "trainer.max_steps=4", "trainer.save_steps=1",
                     "data.eval_file=null", "trainer.report_to=[]", f"hydra.run.dir={run}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [e for e in log_history(run, 4) if "loss" in e]
    assert [e["clip/threshold"] for e in logs] == [0.4, 0.4, 0.2, 0.2]
    for step in (2, 3, 4):  # every step is clipped (norms are > 0.4): SGD's update is lr x the threshold
        before = load_file(run / f"checkpoint-{step - 1}" / "model.safetensors")
        after = load_file(run / f"checkpoint-{step}" / "model.safetensors")
        update = torch.sqrt(sum(((after[k] - before[k]) ** 2).sum() for k in before))
        assert logs[step - 1]["grad_norm"] > 0.4
        assert update / 0.1 == pytest.approx(logs[step - 1]["clip/threshold"], rel=1e-3)
    saved = json.loads((run / "checkpoint-4" / "sft_state.json").read_text())["controllers"]["clip"]
    assert saved["steps"] == 4 and saved["every"] == 2
