"""Every write to another library's private attribute, here and nowhere else; each has a test
(`tests/training/test_compat.py`) that fails loudly when the library changes what it writes to.

- `mark_update_skipped`: accelerate's `AcceleratedOptimizer._is_overflow`, so that a step the guard skips does
  not advance the learning-rate schedule;
- `set_deepspeed_clip`: DeepSpeed's `engine._config.gradient_clipping` and ZeRO's `optimizer.clip_grad`, so that
  an adaptive clip policy sets the threshold the engine clips to inside its own step;
- `set_scheduler_last_lr`: torch's `LRScheduler._last_lr`, so that the rate logged after a resume with another
  `trainer.learning_rate` is the new one;
- `present_cpu_group_as_gpu`: accelerate's `PartialState.distributed_type`, so that its FSDP2 plugin takes a CPU
  (gloo) process group;
- `import_deepspeed_only_when_used`: the `is_deepspeed_available` that accelerate's `extract_model_from_parallel`
  reads, so that unwrapping a model (Trainer does it while it is set up) does not import DeepSpeed (1.5 s) in a run
  that never uses it.
"""

from __future__ import annotations

import contextlib
import math


def mark_update_skipped(optimizer, skipped: bool) -> None:
    """Tell accelerate whether this step's update was skipped, as its fp16 loss scaler would.

    `AcceleratedOptimizer.step_was_skipped` reads `_is_overflow`; a skipped step then does not advance
    the learning-rate scheduler (`Trainer` checks `accelerator.optimizer_step_was_skipped`). Without a
    loss scaler accelerate never resets the flag itself, so every step sets it.
    """
    optimizer._is_overflow = skipped


def set_deepspeed_clip(engine, threshold: float) -> float:
    """Set the threshold a DeepSpeed engine clips to in its next step; return it (inf: no clipping).

    The engine clips to its config's `gradient_clipping` (read through `engine.gradient_clipping()`),
    ZeRO optimizers to their own `clip_grad`; DeepSpeed takes 0 for no clipping.
    """
    threshold = threshold if math.isfinite(threshold) else 0.0
    engine._config.gradient_clipping = threshold
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = threshold
    return threshold if threshold > 0 else math.inf


def set_scheduler_last_lr(lr_scheduler, optimizer) -> None:
    """Make a scheduler's last rates (what `get_last_lr()` and Trainer's log report) the optimizer's current ones,
    after they were changed outside a scheduler step."""
    if hasattr(lr_scheduler, "_last_lr"):
        lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@contextlib.contextmanager
def present_cpu_group_as_gpu(state):
    """While the block runs, accelerate's process state (`PartialState`) of a CPU process group says GPU; where the
    block left it so (accelerate recorded another type, FSDP's), the CPU type is put back after."""
    from accelerate.utils import DistributedType

    state.distributed_type = DistributedType.MULTI_GPU
    try:
        yield
    finally:
        if state.distributed_type == DistributedType.MULTI_GPU:
            state.distributed_type = DistributedType.MULTI_CPU


def import_deepspeed_only_when_used() -> None:
    """accelerate's `extract_model_from_parallel` imports DeepSpeed, where it is installed, to test whether a model
    is a `DeepSpeedEngine`. No object can be one before DeepSpeed was imported: so its availability is asked only
    once DeepSpeed is in `sys.modules` (a DeepSpeed run imports it before any engine exists)."""
    import sys

    import accelerate.utils.other as other

    available = getattr(other.is_deepspeed_available, "__wrapped__", other.is_deepspeed_available)

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and available()

    is_deepspeed_available.__wrapped__ = available
    other.is_deepspeed_available = is_deepspeed_available
