"""Sharded checkpoints: under FSDP2 every rank writes its own shards of the model and the optimizer state with
torch.distributed.checkpoint (DCP), in parallel, and a load reshards them onto any number of processes.

A gathered checkpoint (the other format) passes the whole state through rank 0: for a full fine-tune of 32B, ~384 GB
of fp32 weights and Adam moments in one process's memory. A sharded one never gathers: rank 0 writes its share, like
every other rank. The layout is accelerate's (`SHARDED_STATE_DICT`), which Trainer itself loads on resume:

    checkpoint-N/pytorch_model_fsdp_0/   .metadata + __<rank>_0.distcp   the model, {"model": {fqn: tensor}}
    checkpoint-N/optimizer_0/            .metadata + __<rank>_0.distcp   the optimizer, {"optimizer": ...}
    checkpoint-N/config.json, tokenizer files, trainer_state.json, scheduler.pt, rng_state_<rank>.pth, sft_state.json

With `checkpoint.async_save=true` the shards are copied aside and written in the background while training goes on
(`ShardWriter`): `sft_state.json`, which makes the checkpoint complete, is written only once every rank's writes have
finished, so a kill in the middle leaves the previous complete checkpoint the newest. The model for serving
(`model/`) is consolidated from shards too (`sft.model.consolidate`), as is a checkpoint offline with `sft
consolidate`. LoRA adapters stay gathered: one small file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sft.config.schema import Choice, Schema, knob

log = logging.getLogger("sft")

MODEL_DIR, OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"  # accelerate's names, which Trainer loads


class CheckpointFormat(Choice):
    auto = "auto"
    sharded = "sharded"
    gathered = "gathered"


@dataclass
class CheckpointConfig(Schema):
    """How checkpoints are written."""

    format: CheckpointFormat = knob(CheckpointFormat.auto, "auto: sharded under FSDP full fine-tuning, else gathered "
                                    "| sharded: every rank writes its own shards of the model and optimizer (DCP), "
                                    "a resume reshards them onto any process count (FSDP) | gathered: the whole "
                                    "state through rank 0 (a LoRA adapter: one small file)")
    async_save: bool = knob(False, "sharded checkpoints only: training goes on while the shards are written; the "
                            "checkpoint is complete (sft_state.json) once every rank's shards are on disk")

    def check(self, cfg=None):
        if cfg is None:
            return
        self.require("format", self.format != CheckpointFormat.sharded or cfg.fsdp is not None,
                     "sharded checkpoints are FSDP's (fsdp=full_shard); DeepSpeed writes its own shards per rank, and "
                     "DDP or one process has nothing sharded to write")
        self.require("format", self.format != CheckpointFormat.sharded or cfg.lora is None,
                     "a LoRA adapter is saved whole, one small file; sharded checkpoints are for full fine-tuning")
        self.require("async_save", not self.async_save or sharded(cfg),
                     "writes sharded checkpoints in the background: it needs them (fsdp=full_shard without LoRA, "
                     "checkpoint.format=auto or sharded)")


def sharded(cfg) -> bool:
    """Whether this run writes sharded checkpoints (`checkpoint.format`, `auto`: FSDP full fine-tuning)."""
    if cfg.checkpoint.format == CheckpointFormat.auto:
        return cfg.fsdp is not None and cfg.lora is None
    return cfg.checkpoint.format == CheckpointFormat.sharded


def sharded_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """Whether a checkpoint holds DCP shards (reshardable onto any process count)."""
    return Path(checkpoint, MODEL_DIR, ".metadata").is_file()


def model_state(model) -> dict:
    """The model's state dict as this rank's shards (DTensors): nothing gathered."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def optimizer_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer))


def save_model_shards(model, folder: str | os.PathLike) -> None:
    """Every rank writes its shards of the model into `folder` (DCP, accelerate's key: {"model": ...})."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model_state(model)}, storage_writer=dcp.FileSystemWriter(str(folder)))


class ShardWriter:
    """Writes a checkpoint's model and optimizer shards in the background (`checkpoint.async_save`).

    `start` copies this rank's shards aside (DCP's staging) and hands the model's and the optimizer's each to a writer
    thread, which talks to the other ranks over a process group of its own (gloo): never the training's, nor the other
    writer's, whose collectives would interleave in another order on another rank (a deadlock, seen). Once every rank's
    writes are done, `finish` (set by whoever completes the checkpoint: `CheckpointState`) runs on every rank. The ranks
    look at the same points: each step end (`finished_everywhere`, one small all-reduce while a write is pending), the
    next checkpoint's start and the end of training (`wait`).
    """

    def __init__(self, device):
        import torch.distributed as dist

        self.device = device
        self.groups = {name: dist.new_group(backend="gloo") if dist.is_initialized() else None
                       for name in (MODEL_DIR, OPTIMIZER_DIR)}
        self.futures: list = []
        self.folder: Path | None = None
        self.finish = None  # called on every rank once the pending checkpoint's shards are all written

    def start(self, folder: str | os.PathLike, model, optimizer) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()  # one pending checkpoint at a time: the previous one completes before the next one starts
        self.folder = Path(folder)
        for name, state in ((MODEL_DIR, {"model": model_state(model)}),
                            (OPTIMIZER_DIR, {"optimizer": optimizer_state(model, optimizer)})):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
            self.futures.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(self.folder / name)),
                                               process_group=self.groups[name]))

    def pending(self) -> Path | None:
        return self.folder if self.futures else None

    def finished_everywhere(self) -> bool:
        """Whether every rank's writes are done (every rank calls this at the same point)."""
        import torch
        import torch.distributed as dist

        done = torch.tensor([float(all(f.done() for f in self.futures))], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def wait(self) -> None:
        """Until this rank's writes are done (a failed write raises here), then `finish` the checkpoint."""
        if not self.futures:
            return
        for future in self.futures:
            future.result()
        finish, self.futures, self.folder, self.finish = self.finish, [], None, None
        if finish is not None:
            finish()


def format_of_checkpoint(cfg, checkpoint: str | None) -> None:
    """A resume writes its checkpoints in the format of the one it resumes (Trainer loads either by the format it
    writes): `checkpoint.format=auto` follows it, said in the log; an explicit other format is refused."""
    from omegaconf import open_dict

    from sft.config.schema import ConfigError

    if checkpoint is None or cfg.fsdp is None or sharded_checkpoint(checkpoint) == sharded(cfg):
        return
    saved = CheckpointFormat.sharded if sharded_checkpoint(checkpoint) else CheckpointFormat.gathered
    if cfg.checkpoint.format != CheckpointFormat.auto:
        raise ConfigError("checkpoint.format", str(cfg.checkpoint.format), f"{checkpoint} was saved {saved.value}: "
                          "a resume goes on in its format (checkpoint.format=auto follows it)")
    with open_dict(cfg):
        cfg.checkpoint.format = saved
    log.info("resume: %s was saved %s: this run's checkpoints are too (checkpoint.format=auto)", checkpoint,
             saved.value)
