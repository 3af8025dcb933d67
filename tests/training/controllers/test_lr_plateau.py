"""LR on plateau (`sft.training.controllers.lr_plateau`): the scheduler's base rates and the optimizer's scaled
together."""

from types import SimpleNamespace

import pytest
import torch

from sft.training.controllers import ReduceLROnPlateau


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
