"""The step-control room: a controller's verdict skips a step exactly; the private fields of other
libraries it touches still do what it relies on; every Trainer override still overrides something."""

import inspect
import subprocess
import sys

import pytest
import torch

from conftest import REPO, ROWS, free_port, train_steps
from sft.training.controllers import Controller, StepVerdict
from sft.loss.builtin import CrossEntropyLoss
from sft.training.step_control import mark_update_skipped
from sft.training.trainer import WeightedLossTrainer


class SkipStep(Controller):
    """Vetoes one optimizer step; records every step's loss and gradient norm it was shown."""

    def __init__(self, step: int):
        self.step, self.seen = step, []

    def judge_step(self, step, loss, grad_norm):
        self.seen.append((step, loss, grad_norm))
        return StepVerdict("test", skip=True, folder="skipped", summary="vetoed") if step == self.step else None


def test_a_controller_verdict_skips_exactly_that_step_and_is_reported(tmp_path, tokenizer):
    # A veto leaves parameters, optimizer state and schedule as they were: skipping step 2 of the batches
    # [A, B, C] (SGD, constant rate) ends where training on [A, C] ends.
    veto = SkipStep(step=2)
    _, skipped, trainer = train_steps(tmp_path / "veto", tokenizer, CrossEntropyLoss(), 2, 1, rows=ROWS[:6], steps=3,
                                      max_grad_norm=1e9, controllers={"veto": veto})
    _, direct, _ = train_steps(tmp_path / "direct", tokenizer, CrossEntropyLoss(), 2, 1, rows=ROWS[:2] + ROWS[4:6],
                               steps=2, max_grad_norm=1e9)
    torch.testing.assert_close(skipped, direct, atol=1e-6, rtol=0)
    assert [s for s, _, _ in veto.seen] == [1, 2, 3] and all(n > 0 for _, _, n in veto.seen)
    report = (tmp_path / "veto" / "out-2x1" / "skipped" / "step-2.json").read_text()
    assert '"update_skipped": true' in report and '"verdict": "test"' in report


def test_accelerate_reads_the_skip_flag_and_holds_the_scheduler():
    # mark_update_skipped writes accelerate's private AcceleratedOptimizer._is_overflow: a skipped step must
    # read as skipped (Trainer then does not step the scheduler) and must not move the learning rate.
    from accelerate import Accelerator

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    mark_update_skipped(optimizer, True)
    assert accelerator.optimizer_step_was_skipped
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [1.0]
    mark_update_skipped(optimizer, False)
    assert not accelerator.optimizer_step_was_skipped
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5]


@pytest.mark.slow
def test_deepspeed_engine_clips_to_the_threshold_set_on_it():
    # set_deepspeed_clip writes DeepSpeed's private engine._config.gradient_clipping and ZeRO's clip_grad:
    # the engine must read them back and clip a real step to that threshold.
    script = """
import os, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(%d), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
deepspeed.init_distributed("gloo")
from sft.training.step_control import set_deepspeed_clip
model = torch.nn.Linear(4, 4, bias=False)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
          "zero_allow_untested_optimizer": True}  # a torch optimizer, as Trainer hands DeepSpeed
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                       config=config)
assert set_deepspeed_clip(engine, 0.25) == 0.25
assert engine.gradient_clipping() == 0.25 and engine.optimizer.clip_grad == 0.25
before = model.weight.detach().clone()
loss = (engine(torch.full((1, 4), 100.0)) ** 2).sum()
engine.backward(loss)
engine.step()
moved = (model.weight.detach() - before).norm().item()
print("MOVED", moved)
assert abs(moved - 0.25) < 1e-4, moved  # SGD with lr 1: the update is the clipped gradient
assert set_deepspeed_clip(engine, float("inf")) == float("inf") and engine.gradient_clipping() == 0.0
"""
    proc = subprocess.run([sys.executable, "-c", script % free_port()], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_override_of_trainer_still_overrides_a_method_with_the_same_parameters():
    # Three of them are private hooks of transformers (_clip_grad_norm, _get_train_sampler, _save): a rename or a
    # new parameter there would silently bypass sft.training.step_control, the curriculum's sampler or the tied-copy filter.
    from transformers import Trainer

    overrides = {name: f for name, f in vars(WeightedLossTrainer).items() if getattr(f, "__override__", False)}
    assert set(overrides) == {"get_batch_samples", "compute_loss", "_clip_grad_norm", "_get_train_sampler",
                              "evaluation_loop", "prediction_step", "log", "create_accelerator_and_postprocess",
                              "_save"}
    for name, ours in overrides.items():
        theirs = getattr(Trainer, name, None)
        assert theirs is not None, f"transformers.Trainer has no {name} any more"
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def test_the_step_loss_and_every_ranks_stop_flag_share_one_all_reduce(monkeypatch):
    """Two ranks as `_sum_over_ranks` would see them: this one's loss 2 and no signal, the other's loss 4 and
    a SIGTERM. One all-reduce per step gives the judges the mean loss and preemption the other rank's signal;
    preemption then makes no collective of its own."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState

    from sft.training.clipping import StaticClip
    from sft.training.preemption import Preemption
    from sft.training.step_control import StepControl

    reductions = []

    def sum_over_two_ranks(t):
        reductions.append(t.clone())
        return t + torch.tensor([4.0, 1.0], dtype=t.dtype)  # the other rank: loss 4, signalled

    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2), _sum_over_ranks=sum_over_two_ranks,
                              is_deepspeed_enabled=False)
    control = StepControl(trainer, StaticClip(max_norm=1.0), {"veto": SkipStep(step=99)})
    preemption = Preemption(step_control=control)
    control.begin("cpu")
    control.add_micro_batch(torch.tensor(2.0), torch.tensor([0]), None, torch.tensor([2.0]), [None, None, None])
    assert control._reduce_step() == 3.0
    assert len(reductions) == 1 and reductions[0].tolist() == [2.0, 0.0]  # this rank: no signal
    assert control.stop_requested

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("preemption made a collective of its own"))
    state, step_end = TrainerState(), TrainerControl()
    state.global_step = 5
    preemption.on_step_end(SimpleNamespace(device="cpu"), state, step_end)
    assert step_end.should_save and step_end.should_training_stop and preemption.stopped_at == 5

    # Without judges the flag still travels, alone; on one process nothing is reduced at all.
    reductions.clear()
    control.judges = []
    assert control._reduce_step() is None and len(reductions) == 1
    trainer.accelerator.num_processes = 1
    assert control._reduce_step() is None and len(reductions) == 1 and not control.stop_requested
