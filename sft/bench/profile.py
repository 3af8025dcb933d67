"""Where a training step's time goes (`bench.profile_steps`): torch's profiler over a few steps after the timed ones,
each operator's own time put in one place, by the scope it ran in or else by its name:

- `loss`: inside the loss (`sft.loss`, the trainer's `compute_loss`: its kernel's products too);
- `optimizer`: inside `Optimizer.step`; `data`: inside the data loader's `__next__`;
- `matmul`: matrix products (mm, addmm, bmm, ... forward and backward); `attention`: the attention kernels;
- `elementwise`: every other operator (norms, activations, adds, copies, the autograd engine's accumulations);
- `framework`: the wall time no operator accounts for: Python (Trainer, accelerate, sft, PEFT's wrappers), hooks,
  the autograd engine between operators.

Each is a share of the profiled steps' wall time; they add up to 1.

    {"matmul": 0.62, "attention": 0.05, "elementwise": 0.14, "loss": 0.08, "optimizer": 0.05, "data": 0.01,
     "framework": 0.05}
"""

from __future__ import annotations

import time

SCOPES = (("sft.loss", "loss"), ("Optimizer.step", "optimizer"), ("Optimizer.zero_grad", "optimizer"),
          ("enumerate(DataLoader)", "data"))
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::_addmm_activation", "mkldnn", "onednn")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "varlen", "attn")
CATEGORIES = ("matmul", "attention", "elementwise", "loss", "optimizer", "data", "framework")


def category(event) -> str:
    """The category of one profiler event's own time: its enclosing scope's (`SCOPES`), else its name's."""
    parent = event
    while parent is not None:
        for prefix, name in SCOPES:
            if parent.name.startswith(prefix):
                return name
        parent = parent.cpu_parent
    name = event.name.lower()
    if any(op in name for op in MATMUL_OPS) or name.startswith(("mmbackward", "addmmbackward")):
        return "matmul"
    if any(op in name for op in ATTENTION_OPS):
        return "attention"
    return "elementwise"


def breakdown(events, wall_seconds: float) -> dict[str, float]:
    """The shares of `wall_seconds` (the profiled steps' wall time) that each category's events took (their own
    time: a scope's time less what its children took), the rest `framework`."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if event.device_type.name != "CPU" or not event.name:
            continue
        seconds[category(event)] += event.self_cpu_time_total / 1e6
    accounted = sum(seconds.values())
    seconds["framework"] = max(0.0, wall_seconds - accounted)
    total = max(wall_seconds, accounted)
    return {key: value / total for key, value in seconds.items()}


def step_profiler(first_step: int, steps: int):
    """A Trainer callback that profiles the optimizer steps after `first_step` (`steps` of them) and leaves the
    breakdown in `.result`."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        def __init__(self):
            self.result, self.profiler, self.started = None, None, 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == first_step:
                self.profiler = profile(activities=[ProfilerActivity.CPU])
                self.profiler.__enter__()
                self.started = time.perf_counter()
            elif state.global_step == first_step + steps and self.profiler is not None:
                wall = time.perf_counter() - self.started
                self.profiler.__exit__(None, None, None)
                self.result = breakdown(self.profiler.events(), wall)
                self.profiler = None

    return StepProfiler()
