"""What a run that cannot go on tells its user, in one line each: a CUDA out-of-memory error with the settings that
lower memory, a full disk with where and how to go on, a checkpoint whose weights do not fit the model, and a
controller that stopped training as failed (`TrainingStopped`, exit code 1)."""

from __future__ import annotations

import contextlib

from sft.config.schema import ConfigError


class TrainingStopped(RuntimeError):
    """A controller stopped the run as failed (the guard, after too many bad steps), or the disk filled up; the
    message says why."""


def train_with_advice(trainer, cfg, checkpoint: str | None):
    """`trainer.train`, turning a CUDA out-of-memory error into the settings that lower memory, and a full
    disk while saving into one line (`TrainingStopped`) saying so."""
    import pickle

    import torch

    try:
        return trainer.train(resume_from_checkpoint=checkpoint)
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met a pickled object: refused, not run
        if not checkpoint:
            raise
        raise ConfigError("resume", checkpoint, f"{pickled_file(checkpoint) or 'a file'} holds Python objects, not "
                          "only tensors, which torch.load(weights_only=True) refuses to run: a checkpoint is code, "
                          "so resume only from checkpoints you trust (docs/checkpoints.md)") from None
    except torch.OutOfMemoryError as e:  # a RuntimeError: before the disk-full clause
        raise torch.OutOfMemoryError(f"{out_of_memory_advice(cfg)} Original error: {str(e).splitlines()[0]}") from e
    except Exception as e:  # noqa: BLE001 - a SafetensorError is neither OSError nor RuntimeError
        if checkpoint and "size mismatch" in str(e):  # the config matched (or resume_force), the weights do not
            mismatch = next(line.strip() for line in str(e).splitlines() if "size mismatch" in line)
            raise ConfigError("resume", checkpoint, f"its weights do not fit this model ({mismatch}): a checkpoint "
                              "of another model or LoRA shape") from e
        if "Expected to have finished reduction in the prior iteration" in str(e):  # DDP, find_unused_parameters off
            raise ConfigError("trainer.ddp_find_unused_parameters", trainer.args.ddp_find_unused_parameters,
                              "some trainable parameters of this model had no gradient in a step (a part no forward "
                              "reached), which DDP must then look for: set trainer.ddp_find_unused_parameters=true "
                              "(or freeze that part)") from e
        if not disk_full(e):
            raise
        raise TrainingStopped(disk_full_message(trainer.args.output_dir,
                                                f"checkpoint-{trainer.state.global_step}")) from e


@contextlib.contextmanager
def stop_on_full_disk(output_dir: str, saving: str):
    """A full disk while saving `saving` (e.g. the final model) as one line (`TrainingStopped`) saying how to go on."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unless the disk is full
        if not disk_full(e):
            raise
        raise TrainingStopped(disk_full_message(output_dir, saving)) from e


def pickled_file(checkpoint: str) -> str | None:
    """The first file of a checkpoint that `torch.load(weights_only=True)` refuses, or None."""
    import pickle
    from pathlib import Path

    import torch

    for path in sorted(Path(checkpoint).rglob("*")):
        if path.suffix in (".pt", ".pth", ".bin") and path.is_file():
            try:
                torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                return path.name
            except Exception:  # noqa: BLE001 - another fault of that file: not the one looked for
                continue
    return None


def out_of_memory_advice(cfg) -> str:
    """The settings in use that decide memory, and those that lower it, in the order to try them."""
    t = cfg.trainer
    checkpointing = "null (the memory plan's)" if t.activation_checkpointing is None else t.activation_checkpointing
    in_use = (f"trainer.per_device_train_batch_size={t.per_device_train_batch_size}, "
              f"data.max_length={cfg.data.max_length}, trainer.activation_checkpointing={checkpointing}, "
              f"lora={'on' if cfg.lora is not None else 'off'}, "
              f"deepspeed stage={(cfg.deepspeed or {}).get('zero_optimization', {}).get('stage', 'none')}, "
              f"fsdp={'off' if cfg.fsdp is None else 'offload' if cfg.fsdp.cpu_offload else 'on'}")
    return (f"CUDA out of memory with {in_use}. To lower memory, in this order: "
            "1) a smaller trainer.memory_limit_gib (the memory plan, logged as 'memory: ...', then splits the step "
            "into smaller micro-batches or checkpoints activations; the loss is unchanged), or with "
            "trainer.fit_micro_batch=false a smaller trainer.per_device_train_batch_size with a larger "
            "trainer.gradient_accumulation_steps; 2) a smaller data.max_length; 3) trainer.activation_checkpointing=true; "
            "4) lora=default instead of full fine-tuning; 5) deepspeed=zero3 (or fsdp=full_shard), then "
            "deepspeed=zero3_offload (or fsdp=full_shard_offload).")


def disk_full(error: BaseException) -> bool:
    """Whether an error while training is a full disk: ENOSPC, or how torch.save reports a short write."""
    import errno

    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    text = str(error)
    return "No space left on device" in text or "unexpected pos" in text or "file write failed" in text


def disk_full_message(output_dir: str, saving: str) -> str:
    """The disk is full: what was being saved, how much is free, about how much a checkpoint takes, how to go on."""
    import shutil

    from sft.training.checkpoints.store import latest_complete

    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:  # the process's own limit, not the disk: `ulimit -f`
        return (f"writing {saving} in {output_dir} stopped at this process's file-size limit (ulimit -f: "
                f"{limit / 2**20:,.0f} MiB a file), not a full disk ({shutil.disk_usage(output_dir).free / 2**30:,.1f} "
                "GiB free). What was being written is incomplete, so no resume uses it: raise the limit (ulimit -f "
                "unlimited), then run again with resume=auto")
    free = shutil.disk_usage(output_dir).free / 2**20
    last = latest_complete(output_dir)
    needed = (f"; {last.name} took {sum(f.stat().st_size for f in last.rglob('*') if f.is_file()) / 2**20:,.0f} MiB"
              if last else "")
    return (f"the disk is full: saving {saving} in {output_dir} failed with {free:,.0f} MiB free{needed}. "
            "What was being written is incomplete, so no resume uses it, and the earlier checkpoints are untouched: "
            "free space (or lower trainer.save_total_limit), then run again with resume=auto")


def raise_if_failed(controllers: dict) -> None:
    """A controller that stopped training as a failure ends the run with its reason."""
    for controller in controllers.values():
        reason = controller.failure()
        if reason:
            raise TrainingStopped(reason)
