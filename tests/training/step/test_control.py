"""The step-control room (`sft.training.step.control`): a controller's verdict skips a step exactly; the judges
and preemption share one all-reduce."""

import pytest
import torch
from conftest import ROWS, fast_loop, train_steps

from sft.loss.builtin import CrossEntropyLoss
from sft.training.controllers import Controller, StepVerdict
from sft.training.parts import StepParts


class SkipStep(Controller):
    """Vetoes one optimizer step; records every step's loss and gradient norm it was shown."""

    def __init__(self, step: int):
        self.step, self.seen = step, []

    def judge_step(self, step, loss, grad_norm):
        self.seen.append((step, loss, grad_norm))
        return StepVerdict("test", skip=True, folder="skipped", summary="vetoed") if step == self.step else None


# Trainer clips (_clip_grad_norm), or not (_get_grad_norm)
@pytest.mark.parametrize("max_grad_norm", fast_loop([1e9, 0.0], {"0.0"}))
def test_a_controller_verdict_skips_exactly_that_step_and_is_reported(tmp_path, tokenizer, max_grad_norm):
    # A veto leaves parameters, optimizer state and schedule as they were: skipping step 2 of the batches
    # [A, B, C] (SGD, constant rate) ends where training on [A, C] ends.
    veto = SkipStep(step=2)
    _, skipped, trainer = train_steps(tmp_path / "veto", tokenizer, CrossEntropyLoss(), 2, 1, rows=ROWS[:6], steps=3,
                                      max_grad_norm=max_grad_norm, step=StepParts(controllers={"veto": veto}))
    _, direct, _ = train_steps(tmp_path / "direct", tokenizer, CrossEntropyLoss(), 2, 1, rows=ROWS[:2] + ROWS[4:6],
                               steps=2, max_grad_norm=1e9)
    torch.testing.assert_close(skipped, direct, atol=1e-6, rtol=0)
    assert [s for s, _, _ in veto.seen] == [1, 2, 3] and all(n > 0 for _, _, n in veto.seen)
    report = (tmp_path / "veto" / "out-2x1" / "skipped" / "step-2.json").read_text()
    assert '"update_skipped": true' in report and '"verdict": "test"' in report


def test_the_step_loss_and_every_ranks_stop_flag_share_one_all_reduce(monkeypatch):
    """Two ranks as the accelerator's all-reduce would see them: this one's loss 2 and no signal, the other's loss 4
    and a SIGTERM. One all-reduce per step gives the judges the mean loss and preemption the other rank's signal;
    preemption then makes no collective of its own."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState

    from sft.training.step.clipping import StaticClip
    from sft.training.step.control import StepContext, StepControl, StepReport
    from sft.training.step.preemption import Preemption

    reductions = []

    def sum_over_two_ranks(t, reduction):
        assert reduction == "sum"
        reductions.append(t.clone())
        return t + torch.tensor([4.0, 1.0], dtype=t.dtype)  # the other rank: loss 4, signalled

    accelerator = SimpleNamespace(num_processes=2, reduce=sum_over_two_ranks)
    ctx = StepContext(step=6, accelerator=accelerator, optimizer=None)
    preemption = Preemption()
    control = StepControl(StaticClip(max_norm=1.0), {"veto": SkipStep(step=99), "preemption": preemption},
                          StepReport("unused", str, None, ["train.jsonl"]))
    control.begin("cpu")
    control.add_micro_batch(torch.tensor(2.0), torch.tensor([0]), None, torch.tensor([2.0]), [None, None, None])
    assert control._read_step(ctx, torch.tensor(0.5)) == (0.5, 3.0)
    assert len(reductions) == 1 and reductions[0].tolist() == [2.0, 0.0]  # this rank: no signal

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("preemption made a collective of its own"))
    state, step_end = TrainerState(), TrainerControl()
    state.global_step = 6
    preemption.on_step_end(SimpleNamespace(device="cpu"), state, step_end)
    assert step_end.should_save and step_end.should_training_stop and preemption.stopped_at == 6

    # Without judges the flag still travels, alone; on one process nothing is reduced at all.
    reductions.clear()
    control.judges = []
    assert control._read_step(ctx, torch.tensor(0.5)) == (0.5, None) and len(reductions) == 1
    accelerator.num_processes = 1
    quiet = Preemption()
    alone = StepControl(StaticClip(max_norm=1.0), {"preemption": quiet}, StepReport("unused", str, None, []))
    alone.begin("cpu")
    assert alone._read_step(ctx, torch.tensor(0.5)) == (0.5, None) and len(reductions) == 1
    state.global_step, step_end = 7, TrainerControl()
    quiet.on_step_end(SimpleNamespace(device="cpu"), state, step_end)
    assert not step_end.should_training_stop and quiet.stopped_at is None
