"""What a resume may change: the settings a checkpoint cannot follow are refused naming them (`check_resume_config`:
the model, the LoRA shape, the batch shape, the optimizer ...; a checkpoint without optimizer state,
`check_resume_processes`), as is other data (`check_resume_data`); the others apply, a new learning
rate from the resumed step on (`LearningRateChange`), another number of processes with the step's rows kept
(`check_resume_processes`). `resume_force=true` turns each refusal into a warning."""

from __future__ import annotations

import logging
import os

from transformers import TrainerCallback

from sft.config.schema import ConfigError
from sft.training.checkpoints.store import read_state
from sft.training.compat import set_scheduler_last_lr

log = logging.getLogger("sft")


# Settings a resume cannot change: the checkpoint's weights, optimizer state or data order were made with
# them. An entry ending in "." covers its group, and turning the group on or off.
FIXED_ON_RESUME = ("model.", "lora.", "tokenizer.", "deepspeed", "deepspeed.zero_optimization.stage",
                   "trainer.per_device_train_batch_size", "trainer.gradient_accumulation_steps", "trainer.seed",
                   "trainer.data_seed", "trainer.optim", "trainer.train_sampling_strategy",
                   "trainer.precision")  # pure's optimizer state holds the fp32 weights, mixed's model does
CHANGEABLE_ON_RESUME = ("model.attn_implementation",)  # the same weights, another kernel
# One AdamW state, fused or not (PyTorch's `fused=` is a kernel choice); null names one of the two
# (`optimizer_name`), so a checkpoint saved before the null default resumes under it.
ADAMW = (None, "adamw_torch", "adamw_torch_fused")
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


def refused_on_resume(key: str, old, new) -> bool:
    """Whether a resume must refuse this change (`fixed_on_resume`), a change between the names of one AdamW aside.

        ("trainer.optim", "adamw_torch", None) -> False      ("trainer.optim", "adamw_torch", "adafactor") -> True
    """
    return fixed_on_resume(key) and not (key == "trainer.optim" and old in ADAMW and new in ADAMW)


def check_resume_config(checkpoint: str, current: dict, force: bool) -> tuple[list[tuple[str, object, object]], dict]:
    """The settings that differ from the checkpoint's saved config, each logged; a change of one the
    checkpoint cannot follow (`fixed_on_resume`: model, LoRA shape, batch shape, optimizer ...) is refused
    naming it, unless forced. The others apply: see `LearningRateChange` for the learning rate. Returns them, and
    the trainer fields that keep the step's rows on another number of processes (`check_resume_processes`)."""
    try:
        state = read_state(checkpoint)
    except (OSError, ValueError):  # resume_force on a checkpoint without sft's state: nothing to compare
        return [], {}
    saved = state.get("config")
    if saved is None:
        return [], {}
    changes = config_changes(saved, current)
    fixed = [(key, old, new) for key, old, new in changes if refused_on_resume(key, old, new)]
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
    return changes, check_resume_processes(checkpoint, state, force, current)


def batch_for_ranks(per_device: int, accumulation: int, saved_ranks: int, ranks: int) -> tuple[int, int] | None:
    """The per-device batch and accumulation that keep a step's rows (per-device batch x accumulation x data ranks) on
    another number of ranks: the per-device batch kept where it can be (the memory it was run with), else the largest
    that divides the rows a rank takes and is no larger; None where the rows do not divide over the ranks.

        2, 1, 2 ranks -> 1 rank  =  (2, 2)   (4 rows a step)
        4, 1, 1 -> 2             =  (2, 1)
        2, 3, 2 -> 4             =  (1, 3)   (12 rows: 3 a rank)
        3, 1, 2 -> 4             =  None     (6 rows over 4 ranks)
    """
    rows = per_device * accumulation * saved_ranks
    if rows % ranks:
        return None
    per_rank = rows // ranks
    batch = max(d for d in range(1, min(per_device, per_rank) + 1) if per_rank % d == 0)
    return batch, per_rank // batch


def data_ranks(world: int, config: dict) -> int:
    """The ranks that take rows of their own: all, but one per sequence-parallel group (`sp.size`)."""
    return world // ((config.get("sp") or {}).get("size") or 1)


def check_resume_processes(checkpoint: str, state: dict, force: bool, current: dict | None = None) -> dict:
    """What a resume cannot see in the config: another number of processes and a checkpoint saved without optimizer
    and schedule (`trainer.save_only_model`: refused unless forced, else it would restart silently).

    On another number of processes the step keeps its rows: returns the trainer fields that keep them
    (`batch_for_ranks`: {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}), said in the log; the
    model and optimizer reload onto any number of processes (whole files, or DCP shards,
    `sft.training.checkpoints.sharded`). Refused where the rows do not divide over the new ranks, and for DeepSpeed,
    whose checkpoint is partitioned per rank (its universal checkpoint converts it; sft does not run that)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    saved_world = state.get("world_size")
    saved = state["config"]
    problems, batch = [], {}
    if saved_world is not None and saved_world != world:
        trainer = saved["trainer"]
        old_ranks, new_ranks = data_ranks(saved_world, saved), data_ranks(world, current or saved)
        per_device, accumulation = trainer["per_device_train_batch_size"], trainer["gradient_accumulation_steps"]
        rows = per_device * accumulation * old_ranks
        kept = batch_for_ranks(per_device, accumulation, old_ranks, new_ranks)
        if (saved.get("data") or {}).get("streaming"):
            problems.append(("resume", f"was saved by {saved_world} process(es) streaming its data, this run has "
                             f"{world}: each rank's stream is its share of the files, whose position does not carry "
                             f"over to another split. Resume with {saved_world} process(es) (./launch.sh --nproc "
                             f"{saved_world})"))
        elif saved.get("deepspeed"):
            problems.append(("resume", f"was saved by {saved_world} process(es) with DeepSpeed, this run has {world}: "
                             "a DeepSpeed checkpoint is partitioned for its number of ranks. Resume with "
                             f"{saved_world} process(es) (./launch.sh --nproc {saved_world}), or convert it with "
                             "DeepSpeed's universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal), "
                             "which sft does not load"))
        elif kept is None:
            problems.append(("resume", f"was saved by {saved_world} process(es), this run has {world}: its {rows} rows "
                             f"a step do not divide over {new_ranks} rank(s). Resume with {saved_world} process(es) "
                             f"(./launch.sh --nproc {saved_world}) or a number that divides {rows}"))
        else:
            batch = {"per_device_train_batch_size": kept[0], "gradient_accumulation_steps": kept[1]}
            log.warning("resume: %s was saved by %d process(es), this run has %d: per-device batch %d -> %d, "
                        "gradient accumulation %d -> %d (the step keeps its %d rows)", checkpoint, saved_world, world,
                        per_device, kept[0], accumulation, kept[1], rows)
    if saved.get("trainer", {}).get("save_only_model"):
        problems.append(("resume", "was saved with trainer.save_only_model=true: no optimizer state or schedule to "
                         "continue, so a resume would restart both at step 0's values. Start a new run from its "
                         "weights (model.name_or_path=<its model>), or resume_force=true"))
    for key, reason in problems:
        if not force:
            raise ConfigError(key, checkpoint, reason)
        log.warning("resume_force: %s %s", checkpoint, reason)
    return batch


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
