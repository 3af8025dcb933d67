"""Each write of `sft.training.compat` to another library's private attribute still does what sft relies on: a
test per write, which fails when the library renames the attribute or stops reading it."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, free_port

from sft.training.compat import mark_update_skipped, present_cpu_group_as_gpu, set_scheduler_last_lr


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
from sft.training.step.control import set_deepspeed_clip
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


def test_the_schedulers_last_rates_follow_the_optimizer_once_set():
    # set_scheduler_last_lr writes torch's LRScheduler._last_lr: get_last_lr() (what Trainer logs) must then report
    # the rates a resume with another trainer.learning_rate put on the optimizer.
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer.param_groups[0]["lr"] = 0.25
    assert scheduler.get_last_lr() == [1.0]
    set_scheduler_last_lr(scheduler, optimizer)
    assert scheduler.get_last_lr() == [0.25]


def test_accelerates_process_state_takes_the_gpu_type_for_the_block_and_gets_the_cpu_type_back():
    # present_cpu_group_as_gpu writes accelerate's PartialState.distributed_type, shared by every PartialState (and
    # read by AcceleratorState when the Accelerator is created): it must be settable and seen by a new one.
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    before = state.distributed_type
    state.distributed_type = DistributedType.MULTI_CPU
    try:
        with present_cpu_group_as_gpu(state):
            assert PartialState().distributed_type == DistributedType.MULTI_GPU
        assert PartialState().distributed_type == DistributedType.MULTI_CPU
        with present_cpu_group_as_gpu(state):
            state.distributed_type = DistributedType.FSDP  # accelerate recorded another type: it stays
        assert PartialState().distributed_type == DistributedType.FSDP
    finally:
        state.distributed_type = before


@pytest.mark.slow
def test_setting_up_a_trainer_without_deepspeed_no_longer_imports_it_and_unwrapping_still_sees_engines(tmp_path):
    # import_deepspeed_only_when_used replaces the is_deepspeed_available that accelerate's extract_model_from_parallel
    # reads: Trainer's set-up imported DeepSpeed (1.5 s of start-up) in runs that never use it (issue 32).
    script = """
import sys, torch
from transformers import Trainer, TrainingArguments
from sft.training.compat import import_deepspeed_only_when_used
import_deepspeed_only_when_used()
import_deepspeed_only_when_used()  # twice: still one wrapper around accelerate's own
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
    def forward(self, x):
        return self.linear(x)
Trainer(model=Tiny(), args=TrainingArguments(output_dir=sys.argv[1], report_to=[], use_cpu=True))
assert "deepspeed" not in sys.modules, "Trainer's set-up imported deepspeed"
import accelerate.utils.other as other
assert other.is_deepspeed_available.__wrapped__.__module__ == "accelerate.utils.imports"
import deepspeed  # once a run imports it, accelerate tests for engines again
from accelerate.utils import extract_model_from_parallel
assert other.is_deepspeed_available()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "ok", proc.stderr[-3000:]
