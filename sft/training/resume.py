"""What a resume may change: the settings a checkpoint cannot follow are refused naming them (`check_resume_config`:
the model, the LoRA shape, the batch shape, the optimizer ...; another number of processes or a checkpoint without
optimizer state, `check_resume_processes`), as is other data (`check_resume_data`); the others apply, a new learning
rate from the resumed step on (`LearningRateChange`). `resume_force=true` turns each refusal into a warning."""

from __future__ import annotations

import logging
import os

from transformers import TrainerCallback

from sft.config.schema import ConfigError
from sft.training.checkpoints import read_state
from sft.training.compat import set_scheduler_last_lr

log = logging.getLogger("sft")


# Settings a resume cannot change: the checkpoint's weights, optimizer state or data order were made with
# them. An entry ending in "." covers its group, and turning the group on or off.
FIXED_ON_RESUME = ("model.", "lora.", "tokenizer.", "deepspeed", "deepspeed.zero_optimization.stage",
                   "trainer.per_device_train_batch_size", "trainer.gradient_accumulation_steps", "trainer.seed",
                   "trainer.data_seed", "trainer.optim", "trainer.train_sampling_strategy")
CHANGEABLE_ON_RESUME = ("model.attn_implementation",)  # the same weights, another kernel
NOT_COMPARED = ("resume", "resume_force", "overwrite", "trust_checkpoint")
ABSENT = "<absent>"


def data_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """What differs between the data identity a checkpoint was trained on and the current one, down to the
    field of a mixture's source: `mixture[1].ratio: 0.3 -> 0.5`."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            changes += data_changes(old, new, f"{prefix}{key}.")
        elif (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)
              and all(isinstance(x, dict) for x in old + new)):
            for i, (a, b) in enumerate(zip(old, new)):
                changes += data_changes(a, b, f"{prefix}{key}[{i}].")
        else:
            changes.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changes


def _leaves(node, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested dict; lists are leaves, an empty dict has none."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def config_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, current value) of every leaf setting that differs between two resolved configs.

        {"trainer": {"learning_rate": 2e-4}}, {"trainer": {"learning_rate": 1e-4}}
            -> [("trainer.learning_rate", 2e-4, 1e-4)]
    """
    a, b = dict(_leaves(saved)), dict(_leaves(current))
    return [(key, a.get(key, ABSENT), b.get(key, ABSENT)) for key in sorted(a.keys() | b.keys())
            if key not in NOT_COMPARED and a.get(key, ABSENT) != b.get(key, ABSENT)]


def fixed_on_resume(key: str) -> bool:
    """Whether a resume must refuse a change of this setting (`FIXED_ON_RESUME`)."""
    if key in CHANGEABLE_ON_RESUME:
        return False
    return any(key == fixed.rstrip(".") or (fixed.endswith(".") and key.startswith(fixed)) for fixed in FIXED_ON_RESUME)


def check_resume_config(checkpoint: str, current: dict, force: bool) -> list[tuple[str, object, object]]:
    """The settings that differ from the checkpoint's saved config, each logged; a change of one the
    checkpoint cannot follow (`fixed_on_resume`: model, LoRA shape, batch shape, optimizer ...) is refused
    naming it, unless forced. The others apply: see `LearningRateChange` for the learning rate."""
    try:
        state = read_state(checkpoint)
    except (OSError, ValueError):  # resume_force on a checkpoint without sft's state: nothing to compare
        return []
    saved = state.get("config")
    if saved is None:
        return []
    check_resume_processes(checkpoint, state, force)
    changes = config_changes(saved, current)
    fixed = [(key, old, new) for key, old, new in changes if fixed_on_resume(key)]
    if changes:
        log.warning("resume: %d setting(s) differ from %s:\n%s", len(changes), checkpoint, "\n".join(
            f"  {key}: {old!r} -> {new!r} ({'refused' if (key, old, new) in fixed and not force else 'applied'})"
            for key, old, new in changes))
    if fixed and not force:
        key, old, new = fixed[0]
        others = f" (and {', '.join(k for k, _, _ in fixed[1:])})" if len(fixed) > 1 else ""
        raise ConfigError(key, new, f"was {old!r} when {checkpoint} was saved{others}: a resume continues that run, "
                          "whose weights, optimizer state or data order depend on it. Keep the saved value, start "
                          "a new run (another hydra.run.dir), or resume_force=true")
    if fixed:
        log.warning("resume_force: resuming although %s changed", ", ".join(k for k, _, _ in fixed))
    return changes


def check_resume_processes(checkpoint: str, state: dict, force: bool) -> None:
    """What a resume cannot see in the config, refused unless forced: another number of processes (another global
    batch), and a checkpoint saved without optimizer and schedule (`trainer.save_only_model`: restarted silently)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    saved_world = state.get("world_size")
    problems = []
    if saved_world is not None and saved_world != world:
        trainer = state["config"]["trainer"]
        per_process = trainer["per_device_train_batch_size"] * trainer["gradient_accumulation_steps"]
        problems.append(("resume", f"was saved by {saved_world} process(es), this run has {world}: the global batch "
                         f"would go from {per_process * saved_world} to {per_process * world} rows a step. Resume with "
                         f"{saved_world} process(es) (./launch.sh --nproc {saved_world}), or resume_force=true"))
    if state["config"].get("trainer", {}).get("save_only_model"):
        problems.append(("resume", "was saved with trainer.save_only_model=true: no optimizer state or schedule to "
                         "continue, so a resume would restart both at step 0's values. Start a new run from its "
                         "weights (model.name_or_path=<its model>), or resume_force=true"))
    for key, reason in problems:
        if not force:
            raise ConfigError(key, checkpoint, reason)
        log.warning("resume_force: %s %s", checkpoint, reason)


class LearningRateChange(TrainerCallback):
    """A resume with another `trainer.learning_rate`: Trainer restores the scheduler's base rates and the
    optimizer's current ones from the checkpoint; at the start of training both are scaled by new/old, so
    the schedule (warmup, decay, plateau reductions) goes on from the resumed step at the new peak rate."""

    def __init__(self, old: float, new: float):
        self.old, self.new = old, new

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        ratio = self.new / self.old
        if hasattr(lr_scheduler, "base_lrs"):
            lr_scheduler.base_lrs = [lr * ratio for lr in lr_scheduler.base_lrs]
        for group in optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        set_scheduler_last_lr(lr_scheduler, optimizer)
        log.info("resume: trainer.learning_rate %g -> %g: the schedule goes on from step %d at the new rate "
                 "(now %g)", self.old, self.new, state.global_step, optimizer.param_groups[0]["lr"])


def check_resume_data(checkpoint: str, identity: dict, force: bool) -> dict | None:
    """The checkpoint's saved state; refuse it if it was trained on other data, unless forced."""
    try:
        state = read_state(checkpoint)
    except (OSError, ValueError):  # absent, or unreadable under resume_force: no state of sft's to restore
        return None
    changes = data_changes(state.get("data", {}), identity)
    if changes:
        if not force:
            raise ConfigError("resume", checkpoint, "the data changed since this checkpoint (" + "; ".join(changes)
                              + "); set resume_force=true to resume anyway")
        log.warning("resume_force: resuming although the data changed: %s", "; ".join(changes))
    return state
