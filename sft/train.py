"""Fine-tune a chat model: `python -m sft.train [group=option] [key=value ...]` (see conf/train.yaml).

The recipe, top to bottom: check the config, build the training arguments (before the model, as
DeepSpeed ZeRO-3 requires), tokenizer, loss, data, model (+ LoRA), collator and trainer (`build`, which
`sft.bench` shares); evaluate, train, evaluate; save the model and `results.json` in the run dir.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sft.config import ConfigError, check, register
from sft.distributed import (end_process_group, gloo_deepspeed_state, rank_overrides, share_run_dir,
                             single_process_distributed_env, slurm_distributed_env)

if TYPE_CHECKING:
    from sft.data import SFTData
    from sft.trainer import WeightedLossTrainer

log = logging.getLogger("sft")
register()


def fail(message: str, code: int = 2) -> None:
    """From an `except` block: stop with the reason and `code` (a traceback with HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def training_arguments(cfg: DictConfig, run_dir: str, resuming: bool, max_grad_norm: float):
    """`TrainingArguments` from the `trainer` group, plus what the recipe decides itself."""
    import torch
    from transformers import TrainingArguments

    fields = OmegaConf.to_container(cfg.trainer, resolve=True)
    fields["output_dir"] = fields["output_dir"] or run_dir
    fields["save_total_limit"] = None  # sft.checkpoints rotates, counting complete checkpoints only
    on_gpu = torch.cuda.is_available()
    fields["dataloader_pin_memory"] &= on_gpu  # pinning without a GPU only warns
    if not on_gpu and not cfg.deepspeed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fields["use_cpu"] = True  # else accelerate sees no GPU and runs each rank alone; DeepSpeed inits gloo itself
    has_eval = cfg.data.eval_file is not None
    if not has_eval:
        fields["eval_strategy"] = "no"
    if cfg.deepspeed:
        single_process_distributed_env()
        if not on_gpu:
            fields["accelerator_config"] = gloo_deepspeed_state()
    try:
        return TrainingArguments(
            **fields,
            max_grad_norm=max_grad_norm,  # the clip policy's; WeightedLossTrainer moves it as the policy says
            remove_unused_columns=False,  # loss_weights must reach compute_loss; the collator drops the rest
            label_names=["labels"],
            include_num_input_tokens_seen="non_padding",
            eval_on_start=has_eval and not resuming,
            activation_checkpointing_kwargs={"use_reentrant": False} if fields["activation_checkpointing"] else None,
            deepspeed=OmegaConf.to_container(cfg.deepspeed, resolve=True) if cfg.deepspeed else None,
        )
    except ValueError as e:
        raise ConfigError("trainer", None, str(e).splitlines()[0]) from e


def find_checkpoint(resume: str | None, output_dir: str, force: bool) -> str | None:
    """The checkpoint to resume from: none, the newest complete one in the run dir (`auto`), or a path."""
    from sft.checkpoints import STATE_FILE, latest_complete, remove_incomplete

    if resume is None:
        return None
    if resume == "auto":
        found = latest_complete(output_dir)
        if os.environ.get("RANK", "0") == "0":
            for debris in remove_incomplete(output_dir):
                log.warning("resume=auto: removed %s, a checkpoint left incomplete by a crash", debris)
        log.info("resume=auto: %s", f"resuming from {found}" if found else f"no checkpoint in {output_dir}, starting fresh")
        return str(found) if found else None
    if not Path(resume, STATE_FILE).is_file() and not force:
        raise ConfigError("resume", resume, f"no {STATE_FILE}: an incomplete checkpoint, or not one of sft's "
                          "(resume_force=true resumes anyway)")
    return resume


def check_resume_data(checkpoint: str, identity: dict, force: bool) -> dict | None:
    """The checkpoint's saved state; refuse it if it was trained on other data, unless forced."""
    from sft.checkpoints import STATE_FILE, data_changes, read_state

    if not Path(checkpoint, STATE_FILE).is_file():
        return None
    state = read_state(checkpoint)
    changes = data_changes(state.get("data", {}), identity)
    if changes:
        if not force:
            raise ConfigError("resume", checkpoint, "the data changed since this checkpoint (" + "; ".join(changes)
                              + "); set resume_force=true to resume anyway")
        log.warning("resume_force: resuming although the data changed: %s", "; ".join(changes))
    return state


CONTROLLERS = ("guard", "early_stopping", "lr_plateau", "curriculum", "adaptive_eval")


class TrainingStopped(RuntimeError):
    """The guard stopped the run; the message says why and how to go on."""


@dataclass
class Recipe:
    """What `build` makes from a config: the trainer and the parts the rest of the run needs."""

    trainer: WeightedLossTrainer
    data: SFTData
    tokenizer: object
    clip_policy: object
    controllers: dict


def build_model(cfg: DictConfig, activation_checkpointing: bool):
    """The model (+ LoRA) of the `model` and `lora` groups, with the attention packed batches need."""
    from hydra.utils import instantiate

    attn = cfg.model.attn_implementation
    if cfg.data.packing and attn == "sdpa":  # sdpa would attend across the whole packed row, under a mask
        attn = "sdpa_varlen"
        log.info("data.packing: attention sdpa_varlen (sdpa per sample of the packed row)")
    model = instantiate(cfg.model, attn_implementation=attn)
    if cfg.lora is not None:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if cfg.model.quantization:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=activation_checkpointing)
        model = get_peft_model(model, instantiate(cfg.lora, _convert_="all"))
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # ZeRO-3 shards
    total, trainable = sum(n for n, _ in sizes), sum(n for n, grad in sizes if grad)
    log.info("model: %d parameters, %d trainable (%.2f%%)", total, trainable, 100 * trainable / total)
    return model


def build(cfg: DictConfig, run_dir: str, checkpoint: str | None = None) -> Recipe:
    """Training arguments (before the model, as ZeRO-3 requires), tokenizer, loss, data, model (+ LoRA),
    controllers, collator and trainer, for a checked config."""
    from hydra.utils import instantiate
    from transformers import set_seed

    from sft.trainer import WeightedLossTrainer

    clip_policy = instantiate(cfg.clip)
    # Positive, so that Trainer hands every step to WeightedLossTrainer._clip_grad_norm (guard, policy).
    max_grad_norm = clip_policy.initial_threshold() or 1.0
    args = training_arguments(cfg, run_dir, resuming=checkpoint is not None, max_grad_norm=max_grad_norm)
    set_seed(args.seed)

    tokenizer = instantiate(cfg.tokenizer)
    loss = instantiate(cfg.loss)
    with args.main_process_first(desc="preprocessing"):
        data = instantiate(cfg.data, tokenizer=tokenizer, sample_weight=loss.sample_weight,
                           rejected_file=os.path.join(run_dir, "rejected.jsonl") if args.process_index == 0 else None)
    log.info("data %s: %d train rows, %d eval rows", data.data_hash, len(data.train), len(data.eval or []))

    model = build_model(cfg, args.activation_checkpointing)
    controllers = {name: instantiate(cfg[name]) for name in CONTROLLERS if cfg[name] is not None}
    trainer = WeightedLossTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=instantiate(cfg.collator, tokenizer=tokenizer),
        processing_class=tokenizer,
        loss=loss,
        clip_policy=clip_policy,
        controllers=controllers,
        eval_buckets=cfg.eval_buckets,
        train_file=cfg.data.train_file,
        throughput=instantiate(cfg.throughput),
    )
    if cfg.watchdog is not None:
        trainer.add_callback(instantiate(cfg.watchdog))
    return Recipe(trainer, data, tokenizer, clip_policy, controllers)


def train(cfg: DictConfig) -> dict:
    """Run the recipe for a checked config; return the results written to `results.json`."""
    from importlib.metadata import version

    from sft.checkpoints import CheckpointState, git_commit

    started = time.time()
    slurm_distributed_env()
    run_dir = HydraConfig.get().runtime.output_dir
    output_dir = cfg.trainer.output_dir or run_dir
    name_the_run()
    checkpoint = find_checkpoint(cfg.resume, output_dir, cfg.resume_force)
    recipe = build(cfg, run_dir, checkpoint)
    trainer, data, tokenizer, controllers = recipe.trainer, recipe.data, recipe.tokenizer, recipe.controllers
    args = trainer.args
    saved = check_resume_data(checkpoint, data.identity, cfg.resume_force) if checkpoint else None

    stateful = {"clip": recipe.clip_policy, "trainer": trainer, **controllers}
    run_info = {"config": OmegaConf.to_container(cfg, resolve=True), "data_hash": data.data_hash,
                "data": data.identity, "sft_version": version("sft"), "git_commit": git_commit()}
    trainer.add_callback(CheckpointState(run_info, stateful, cfg.trainer.save_total_limit, checkpoint))
    if saved is not None:
        for name, state in saved["controllers"].items():
            if name in stateful:
                stateful[name].load_state_dict(state)

    train_output = train_with_advice(trainer, cfg, checkpoint)
    guard = controllers.get("guard")
    if guard is not None and guard.stopped_at_step is not None:
        raise TrainingStopped(
            f"{guard.consecutive} bad steps in a row (non-finite loss or gradient, or skipped spikes), the last at "
            f"step {guard.stopped_at_step}: stopped with checkpoint-{guard.stopped_at_step} in {output_dir}. "
            f"The rows are named in {output_dir}/nan_batches/ (and spikes/); fix or drop them (data.on_error, "
            "guard.*), then resume with resume=auto")
    final_eval = trainer.evaluate() if data.eval is not None else {}
    trainer.save_model(os.path.join(run_dir, "model"))

    if cfg.exact_match is not None and data.eval is not None:
        final_eval["eval_exact_match_hardest"] = hardest_bucket_exact_match(trainer, tokenizer, cfg)
    results = {
        "status": "ok",
        "eval_loss_initial": initial_eval_loss(trainer, run_dir),
        "eval_loss": final_eval.get("eval_loss"),
        "eval_ce": final_eval.get("eval_ce"),
        "eval_token_accuracy": final_eval.get("eval_token_accuracy"),
        **{k: v for k, v in final_eval.items() if k.startswith("eval_loss_bucket_")},
        "train_loss": train_output.training_loss,
        "global_step": trainer.state.global_step,
        "train_tokens_per_second": trainer.throughput.tokens_per_second,
        "loss_impl": trainer.loss_impl,
        "train_runtime": train_output.metrics.get("train_runtime"),
        "data_hash": data.data_hash,
        "resumed_from": checkpoint,
        "stopped_early": bool(controllers.get("early_stopping") and controllers["early_stopping"].stopped_at_step),
        "eval_exact_match_hardest": final_eval.get("eval_exact_match_hardest"),
        "wall_time_s": round(time.time() - started, 1),
        "eval_history": [{k: e[k] for k in ("step", "eval_loss", "eval_ce") if k in e}
                         for e in trainer.state.log_history if "eval_loss" in e],
    }
    log_hparams(cfg, run_dir, results, args)
    finish_trackers()
    if trainer.is_world_process_zero():
        Path(run_dir, "results.json").write_text(json.dumps(results, indent=2) + "\n")
    end_process_group()
    return results


def job_overrides() -> list[str]:
    """The overrides that make this job what it is (Hydra's task overrides)."""
    return list(HydraConfig.get().overrides.task)


def name_the_run() -> None:
    """In a sweep, W&B runs share a group named after the sweep and are named by their overrides."""
    if in_sweep():
        os.environ.setdefault("WANDB_RUN_GROUP", Path(HydraConfig.get().sweep.dir).name)
        os.environ["WANDB_NAME"] = " ".join(job_overrides()) or "defaults"


def log_hparams(cfg: DictConfig, run_dir: str, results: dict, args) -> None:
    """The job's overrides and final metrics in TensorBoard's HParams tab, so sweeps compare side by side."""
    if "tensorboard" not in (args.report_to or []) or args.process_index != 0:
        return
    from torch.utils.tensorboard import SummaryWriter

    hparams = {k: v for k, v in (o.split("=", 1) for o in job_overrides() if "=" in o) if not k.startswith("hydra.")}
    hparams.update({"loss": cfg.loss._target_.rsplit(".", 1)[-1], "clip": cfg.clip._target_.rsplit(".", 1)[-1]})
    metrics = {f"hparam/{k}": results[k] for k in ("eval_loss", "eval_ce", "train_loss", "eval_exact_match_hardest")
               if isinstance(results.get(k), (int, float))}
    with SummaryWriter(log_dir=os.path.join(run_dir, "runs", "hparams")) as writer:
        writer.add_hparams({k: str(v) for k, v in hparams.items()}, metrics, run_name=".")


def finish_trackers() -> None:
    """Close this job's W&B run so that the next job of a sweep starts its own."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def hardest_bucket_exact_match(trainer, tokenizer, cfg: DictConfig) -> float:
    """Exact match of greedy answers on the hardest eval bucket (every rank generates; rank 0 reports)."""
    from sft.generation import exact_match, hardest_bucket_rows

    rows = hardest_bucket_rows(cfg.data.eval_file, list(cfg.eval_buckets), cfg.exact_match.max_rows)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped if trainer.is_zero3 else trainer.model)
    score = exact_match(model, tokenizer, rows, cfg.exact_match.max_new_tokens, synced_gpus=trainer.is_zero3)
    log.info("exact match of greedy answers on the hardest eval bucket (%d rows): %.4f", len(rows), score)
    return score


def train_with_advice(trainer, cfg: DictConfig, checkpoint: str | None):
    """`trainer.train`, turning a CUDA out-of-memory error into the settings that lower memory."""
    import torch

    try:
        return trainer.train(resume_from_checkpoint=checkpoint)
    except torch.OutOfMemoryError as e:
        t = cfg.trainer
        in_use = (f"trainer.per_device_train_batch_size={t.per_device_train_batch_size}, "
                  f"data.max_length={cfg.data.max_length}, trainer.activation_checkpointing={t.activation_checkpointing}, "
                  f"lora={'on' if cfg.lora is not None else 'off'}, "
                  f"deepspeed stage={(cfg.deepspeed or {}).get('zero_optimization', {}).get('stage', 'none')}")
        raise torch.OutOfMemoryError(
            f"CUDA out of memory with {in_use}. To lower memory, in this order: "
            "1) a smaller trainer.per_device_train_batch_size with a larger trainer.gradient_accumulation_steps "
            "(the loss is unchanged); 2) a smaller data.max_length; 3) trainer.activation_checkpointing=true; "
            "4) lora=default instead of full fine-tuning; 5) deepspeed=zero3, then deepspeed=zero3_offload. "
            f"Original error: {str(e).splitlines()[0]}") from e


def initial_eval_loss(trainer, run_dir: str) -> float | None:
    """Eval loss before any training: from this session's first evaluation, or the saved one on resume."""
    saved = Path(run_dir, "eval_initial.json")
    first = next((e for e in trainer.state.log_history if "eval_loss" in e), None)
    if first is not None and first.get("step") == 0:
        if trainer.is_world_process_zero():
            saved.write_text(json.dumps(first) + "\n")
        return first["eval_loss"]
    return json.loads(saved.read_text())["eval_loss"] if saved.exists() else None


CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # the repo's conf/ (editable install)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from hydra.errors import InstantiationException

    from sft.data import DataError

    started = time.time()
    try:
        check(cfg)
        results = train(cfg)
    except Exception as e:
        # instantiate wraps what the built function raised; the user needs that reason, not the wrapper.
        reason = e.__cause__ if isinstance(e, InstantiationException) else e
        if in_sweep() and cfg.sweep.continue_on_error:
            record_failure(reason, time.time() - started)
            return None
        if isinstance(reason, ConfigError):
            fail(f"config: {reason}")
        if isinstance(reason, DataError):
            fail(str(reason))
        if isinstance(reason, TrainingStopped):
            fail(str(reason), code=1)
        raise
    if os.environ.get("RANK", "0") == "0":
        print(f"run dir: {HydraConfig.get().runtime.output_dir}")
    return results["eval_ce"]  # the objective of sweeps: comparable across loss weights, unlike eval_loss


def in_sweep() -> bool:
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def record_failure(error: BaseException, wall_time_s: float) -> None:
    """A failed job of a sweep: its error in `results.json` and the log; the sweep goes on."""
    message = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    log.error("job failed (sweep.continue_on_error=true, the sweep goes on): %s", message)
    if os.environ.get("RANK", "0") == "0":
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps(
            {"status": "failed", "error": message, "wall_time_s": round(wall_time_s, 1)}, indent=2) + "\n")


def cli() -> None:
    """The `python -m sft.train` entry point: settle the multi-process details, then run `main`."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and {"-m", "--multirun"} & set(sys.argv[1:]):
        print("error: -m/--multirun cannot run inside a multi-process launch (every rank would run the whole "
              "sweep). Run `./launch.sh -m ...` (each job in turn through accelerate launch) or use "
              "hydra/launcher=slurm (one allocation per job).", file=sys.stderr)
        sys.exit(2)
    share_run_dir()
    sys.argv.extend(rank_overrides())
    main()


if __name__ == "__main__":
    cli()
