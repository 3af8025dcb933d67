"""`CheckpointSaving`: Trainer's saving, as sft needs it; a base of `WeightedLossTrainer`, given its part,
`checkpoints=CheckpointConfig(...)` (the `checkpoint` section: `async_save` writes sharded checkpoints in the
background).

Every override, and why (each `@override`; a test checks that transformers still has each one, with the same
parameters):
- `_save_checkpoint` (private: where Trainer starts a checkpoint) marks the dir as sft's before writing into it
  (`sft.training.checkpoints.store.start_checkpoint`), so that a crash's debris is told from a checkpoint sft did not
  write, and logs how long it took and the most memory it took above the step's on each rank
  (`sft.training.checkpoints.memory_peak`);
- `_save` (private: the one place every engine's state dict reaches `save_pretrained`) leaves out the tied
  copies (a tied lm_head) that a gathered FSDP state dict carries as separate tensors;
- `save_model` (public): with sharded checkpoints (`checkpoint.format`, `sft.training.checkpoints.sharded`), where
  Trainer writes no model file, a checkpoint gets the config and tokenizer beside its shards, and the model for serving
  is consolidated from shards every rank writes (`sft.model.consolidate`), never gathered into one process;
- `_save_optimizer_and_scheduler` (private: where Trainer writes the model and optimizer state of a checkpoint) hands
  the shards to the background writer with `checkpoint.async_save` (`sft.training.checkpoints.sharded.ShardWriter`);
- `_load_optimizer_and_scheduler` (private: where Trainer reloads them on resume): under FSDP an optimizer that keeps
  no state (plain SGD) is not loaded through torch's `set_optimizer_state_dict`, which refuses a state without a
  tensor (torch 2.13); there is nothing to restore but each group's learning rate, taken from the schedule.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch
from accelerate.utils import gather_object
from transformers import Trainer
from typing_extensions import override

from sft.model.consolidate import tied_copies
from sft.training.checkpoints.memory_peak import PeakRss
from sft.training.checkpoints.sharded import CheckpointConfig, ShardWriter, save_model_shards

log = logging.getLogger("sft")


class CheckpointSaving(Trainer):
    def __init__(self, *args, checkpoints: CheckpointConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # sharded checkpoints written in the background (checkpoint.async_save)
        background = checkpoints is not None and checkpoints.async_save
        self.shard_writer = ShardWriter(self.args.device) if background and self.sharded_checkpoints else None

    @override
    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint, in a dir marked as being written by sft (`start_checkpoint`) until `sft_state.json`;
        how long it took and the most memory it took above the step's, on each rank, go to the log."""
        from sft.training.checkpoints.store import start_checkpoint

        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.args.should_save:
            start_checkpoint(folder)
        with PeakRss() as peak:
            result = super()._save_checkpoint(model, trial)
        above = gather_object([peak.above_start]) if self.accelerator.num_processes > 1 else [peak.above_start]
        if self.is_world_process_zero() and None not in above:
            how = ("sharded, in the background" if self.shard_writer is not None else
                   "sharded" if self.sharded_checkpoints else "gathered" if self.is_fsdp_enabled else "")
            log.info("%s%s: %.1f s; memory above the step's: %s", os.path.basename(folder), f" ({how})" if how else "",
                     peak.seconds, ", ".join(f"rank {r} +{b / 2**20:.0f} MiB" for r, b in enumerate(above)))
        return result

    @property
    def sharded_checkpoints(self) -> bool:
        """FSDP with accelerate's `SHARDED_STATE_DICT` (`checkpoint.format`, `sft.training.checkpoints.sharded`): each
        rank writes its own shards; Trainer writes no model file."""
        return self.is_fsdp_enabled and "SHARDED" in str(self.accelerator.state.fsdp_plugin.state_dict_type)

    @override
    def save_model(self, output_dir=None, _internal_call=False):
        """Trainer's; with sharded checkpoints, a checkpoint gets the config and tokenizer beside its shards, and the
        model for serving is consolidated from shards that every rank writes (`sft.model.consolidate`): never
        gathered into one process."""
        if not self.sharded_checkpoints:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if _internal_call:  # a checkpoint: its shards are written by _save_optimizer_and_scheduler
            if self.args.should_save:
                self._save_model_files(output_dir)
            return
        from sft.model.consolidate import consolidate

        shards = os.path.join(output_dir, ".shards")
        save_model_shards(self.model, shards)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self._save_model_files(output_dir)
            consolidate(shards, output_dir)
            shutil.rmtree(shards)
        self.accelerator.wait_for_everyone()

    def _save_model_files(self, output_dir: str) -> None:
        """What a model dir holds beside its weights: config, generation config, tokenizer."""
        model = self.accelerator.unwrap_model(self.model)
        os.makedirs(output_dir, exist_ok=True)
        model.config.save_pretrained(output_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    @override
    def _save_optimizer_and_scheduler(self, output_dir):
        """Trainer's; with `checkpoint.async_save`, the model and optimizer shards are handed to the background
        writer (`ShardWriter`) and only the schedule is written here."""
        if self.shard_writer is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        from transformers.trainer import SCHEDULER_NAME

        self.shard_writer.start(output_dir, self.model, self.optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    @override
    def _load_optimizer_and_scheduler(self, checkpoint):
        """Trainer's; under FSDP, for an optimizer without state, the schedule alone and the learning rate it had."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if checkpoint is None or not self.is_fsdp_enabled or not keeps_no_state(optimizer):
            return super()._load_optimizer_and_scheduler(checkpoint)
        from transformers.trainer import SCHEDULER_NAME

        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(path):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
        for group, lr in zip(optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # what the optimizer's own state dict would have restored

    @override
    def _save(self, output_dir=None, state_dict=None):
        """Trainer's, without the tied copies in a gathered (FSDP) state dict: `save_pretrained` leaves out a
        tied weight (Qwen2.5-0.5B's lm_head) only where it shares storage with its source, and gathered
        tensors are separate copies; the model would be saved one embedding matrix larger."""
        if state_dict is not None:
            copies = tied_copies(self.accelerator.unwrap_model(self.model), state_dict.keys())
            state_dict = {k: v for k, v in state_dict.items() if k not in copies}
        super()._save(output_dir, state_dict=state_dict)


def keeps_no_state(optimizer) -> bool:
    """An optimizer whose state stays empty as it steps: torch's SGD without momentum (its only state is the momentum
    buffer)."""
    return type(optimizer) is torch.optim.SGD and all(group["momentum"] == 0 for group in optimizer.param_groups)
