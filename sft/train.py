"""Fine-tune a chat model: `python -m sft.train [group=option] [key=value ...]` (see conf/train.yaml).

The recipe, top to bottom (`train`): find the checkpoint to resume from; build the training arguments
(before the model, as DeepSpeed ZeRO-3 requires), tokenizer, loss, data, model (+ LoRA), controllers,
collator and trainer (`build`, which `sft.bench.run` shares); restore the checkpoint's state; train
(evaluating before, during and after); save the model and `results.json` in the run dir.
"""

from __future__ import annotations

import contextlib
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

from sft.config import CONF_DIR, ConfigError, check, key_of_engine_left_off, owned_field_override, register
from sft.training.distributed import (end_process_group, process_fields, rank_overrides, refuse_multirun_in_launch, set_cpu_threads, share_run_dir, slurm_distributed_env)
from sft.experiments.results import RunResults
from sft.experiments.tracking import (finish_mlflow, finish_trackers, in_sweep, job_overrides, log_hparams, name_the_run, start_mlflow)

if TYPE_CHECKING:
    from sft.data.load import SFTData
    from sft.training.trainer import WeightedLossTrainer

log = logging.getLogger("sft")
register()


class TrainingStopped(RuntimeError):
    """A controller stopped the run as failed (the guard, after too many bad steps); the message says why."""


@dataclass
class Recipe:
    """What `build` makes from a config: the trainer and the parts the rest of the run needs."""

    trainer: WeightedLossTrainer
    data: SFTData
    tokenizer: object
    clip_policy: object
    controllers: dict


# --- the recipe ---------------------------------------------------------------------------------------


def train(cfg: DictConfig) -> RunResults:
    """Run the recipe for a checked config; return the results written to `results.json`."""
    from sft.training.checkpoints import find_checkpoint
    from sft.training.preemption import Preemption

    started = time.time()
    slurm_distributed_env()
    set_cpu_threads(log)
    name_the_run()
    run_dir = HydraConfig.get().runtime.output_dir
    output_dir = cfg.trainer.output_dir or run_dir
    locks = lock_run_dirs(run_dir, output_dir)
    try:
        checkpoint = find_checkpoint(cfg.resume, output_dir, cfg.resume_force)
        check_fsdp_resume(cfg, checkpoint)
        changes = continue_or_claim(cfg, output_dir, checkpoint)
        recipe = build(cfg, run_dir, checkpoint)
        track_checkpoints(recipe, cfg, checkpoint, changes)
        start_mlflow(cfg, run_dir)
        preemption = Preemption(cfg.signal_grace_s, recipe.trainer.step_control)
        recipe.trainer.add_callback(preemption)
        preemption.install()
        try:
            train_output = train_with_advice(recipe.trainer, cfg, checkpoint)
        finally:
            preemption.uninstall()
        if preemption.stopped_at is not None:
            stop_preempted(recipe.trainer, preemption, run_dir, started)
        raise_if_failed(recipe.controllers)
        final_eval = evaluate_and_save(recipe, cfg, run_dir)
        results = collect_results(recipe, final_eval, train_output, run_dir, checkpoint, started)
        log_hparams(cfg, run_dir, results.to_json(), recipe.trainer.args)
        finish_trackers()
        if recipe.trainer.is_world_process_zero():
            results.write(run_dir)
        finish_mlflow(run_dir, "FINISHED")
    except BaseException as e:
        from sft.training.preemption import Preempted

        with contextlib.suppress(Exception):  # the run's own error is the one to report
            finish_mlflow(run_dir, "KILLED" if isinstance(e, Preempted) else "FAILED")
        raise
    finally:
        for lock in locks:
            lock.release()
    end_process_group()
    return results


def lock_run_dirs(run_dir: str, output_dir: str) -> list:
    """Rank 0 holds the run dir (and the checkpoint dir, if another) for the run (`sft.training.run_dir.RunDirLock`):
    a second run started into it refuses to start."""
    from sft.training.run_dir import RunDirLock

    if os.environ.get("RANK", "0") != "0":
        return []
    locks = []
    try:
        for folder in dict.fromkeys([run_dir, output_dir]):
            locks.append(RunDirLock(folder))
            locks[-1].acquire()
    except ConfigError:
        for lock in locks:
            lock.release()
        raise
    return locks


def continue_or_claim(cfg: DictConfig, output_dir: str, checkpoint: str | None) -> list:
    """A resume continues the checkpoint's run: the settings that differ from its config are logged, and
    refused where the checkpoint cannot follow them (`check_resume_config`); returns them. A new run may not
    start over another run's outputs (`sft.training.run_dir.claim`, `overwrite=true`)."""
    from sft.training.checkpoints import check_resume_config, inside
    from sft.training.run_dir import claim

    if cfg.resume != "auto" and not inside(checkpoint, output_dir):
        claim(output_dir, cfg.overwrite, sweep_job=in_sweep())
    if checkpoint is None:
        return []
    return check_resume_config(checkpoint, OmegaConf.to_container(cfg, resolve=True), cfg.resume_force)


def check_fsdp_resume(cfg: DictConfig, checkpoint: str | None) -> None:
    """Refuse, before any model is built, an FSDP resume that torch cannot load: `set_optimizer_state_dict`
    needs a tensor in the saved optimizer state, and plain SGD (no momentum) keeps none (torch 2.13)."""
    if checkpoint is None or cfg.fsdp is None or cfg.trainer.optim != "sgd":
        return
    args = dict(kv.split("=", 1) for kv in (cfg.trainer.optim_args or "").replace(" ", "").split(",") if "=" in kv)
    try:
        momentum = float(args.get("momentum", 0))
    except ValueError:
        return  # transformers reports a bad value itself
    if momentum == 0:
        raise ConfigError("resume", checkpoint, "FSDP cannot reload plain SGD's optimizer state, which holds no "
                          "tensor (torch's set_optimizer_state_dict needs one), so this run cannot be resumed; "
                          'train FSDP runs with momentum (trainer.optim_args="momentum=0.9") or another optimizer')


def stop_preempted(trainer, preemption, run_dir: str, started: float) -> None:
    """After a signal (`sft.training.preemption`): `results.json` says preempted and where the checkpoint is; raise
    `Preempted`."""
    from sft.training.preemption import Preempted

    checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{preemption.stopped_at}")
    if trainer.is_world_process_zero():
        RunResults(status="preempted", checkpoint=checkpoint, global_step=preemption.stopped_at,
                   resumed_from=None, wall_time_s=round(time.time() - started, 1)).write(run_dir)
    finish_trackers()
    end_process_group()
    raise Preempted(f"{preemption.signal} at step {preemption.stopped_at}: saved {checkpoint}; continue with "
                    f"the same command plus resume=auto hydra.run.dir={run_dir}", checkpoint)


def build(cfg: DictConfig, run_dir: str, checkpoint: str | None = None) -> Recipe:
    """Training arguments (before the model, as ZeRO-3 requires), tokenizer, loss, data, model (+ LoRA),
    controllers, collator and trainer, for a checked config."""
    from hydra.utils import instantiate
    from transformers import set_seed

    from sft.training.controllers import build_controllers
    from sft.data.weights import scores_used_by
    from sft.loss.base import build_loss
    from sft.training.trainer import WeightedLossTrainer

    clip_policy = instantiate(cfg.clip)
    # Positive, so that Trainer hands every step to WeightedLossTrainer._clip_grad_norm (sft.training.step_control).
    max_grad_norm = clip_policy.initial_threshold() or 1.0
    args = training_arguments(cfg, run_dir, resuming=checkpoint is not None, max_grad_norm=max_grad_norm)
    set_seed(args.seed)

    tokenizer = instantiate(cfg.tokenizer)
    loss = build_loss(cfg.loss)
    controllers = build_controllers(cfg.controllers)
    with args.main_process_first(desc="preprocessing"):
        # A partial, then the objects: passed to instantiate, the loss (a dataclass) would become a config node.
        data = instantiate(cfg.data, _partial_=True)(
            tokenizer=tokenizer, loss=loss, scores_needed_by=scores_used_by(loss, controllers),
            rejected_file=os.path.join(run_dir, "rejected.jsonl") if args.process_index == 0 else None)
    log.info("data %s: %d train rows, %d eval rows", data.data_hash, len(data.train), len(data.eval or []))

    # Seeded again: tokenising (a cold data cache) draws random numbers and a warm one does not, which would
    # give the LoRA adapters (or a random-init model) other initial weights on the second run of a config.
    set_seed(args.seed)
    model = build_model(cfg, args.activation_checkpointing)
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
        sources=[str(part.train) for part in data.parts],
        tasks=data.tasks,
        throughput=instantiate(cfg.throughput),
        eval_generation=eval_generation(cfg, data),
    )
    return Recipe(trainer, data, tokenizer, clip_policy, controllers)


# --- the steps of `build` and `train` -----------------------------------------------------------------


def training_arguments(cfg: DictConfig, run_dir: str, resuming: bool, max_grad_norm: float):
    """`TrainingArguments` from the `trainer` group, plus what the recipe decides itself."""
    import torch
    from transformers import TrainingArguments

    fields = OmegaConf.to_container(cfg.trainer, resolve=True)
    fields["output_dir"] = fields["output_dir"] or run_dir
    fields["save_total_limit"] = None  # sft.training.checkpoints rotates, counting complete checkpoints only
    on_gpu = torch.cuda.is_available()
    fields["dataloader_pin_memory"] &= on_gpu  # pinning without a GPU only warns
    has_eval = evaluates(cfg)
    if not has_eval:
        fields["eval_strategy"] = "no"
    fields.update(process_fields(deepspeed=bool(cfg.deepspeed), fsdp=cfg.fsdp is not None, on_gpu=on_gpu))
    if cfg.fsdp is not None:
        fields.update(fsdp_fields(cfg.fsdp, fields["activation_checkpointing"]))
    try:
        return TrainingArguments(
            **fields,
            max_grad_norm=max_grad_norm,  # the clip policy's; sft.training.step_control moves it as the policy says
            remove_unused_columns=False,  # loss_weights must reach compute_loss; the collator drops the rest
            label_names=["labels"],
            include_num_input_tokens_seen="non_padding",
            eval_on_start=has_eval and not resuming,
            activation_checkpointing_kwargs={"use_reentrant": False} if fields["activation_checkpointing"] else None,
            deepspeed=OmegaConf.to_container(cfg.deepspeed, resolve=True) if cfg.deepspeed else None,
        )
    except ValueError as e:
        raise ConfigError("trainer", None, str(e).splitlines()[0]) from e


def fsdp_fields(fsdp: DictConfig, activation_checkpointing: bool) -> dict:
    """TrainingArguments' FSDP2 fields for the `fsdp` node. Activation checkpointing becomes FSDP's own
    (each layer wrapped before sharding): Trainer's would gather every layer's weights once more in backward."""
    config = {"version": 2, "reshard_after_forward": fsdp.reshard_after_forward, "cpu_offload": fsdp.cpu_offload,
              "activation_checkpointing": activation_checkpointing, "state_dict_type": "FULL_STATE_DICT"}
    if fsdp.layers is not None:
        config["transformer_layer_cls_to_wrap"] = list(fsdp.layers)
    return {"fsdp": True, "fsdp_config": config, "activation_checkpointing": False}


def build_model(cfg: DictConfig, activation_checkpointing: bool):
    """The model (+ LoRA) of the `model` and `lora` groups, with the attention packed batches need."""
    from hydra.utils import instantiate

    attn = cfg.model.attn_implementation
    if cfg.data.packing and attn == "sdpa":  # sdpa would attend across the whole packed row, under a mask
        attn = "sdpa_varlen"
        log.info("data.packing: attention sdpa_varlen (sdpa per sample of the packed row)")
    model = instantiate(cfg.model, attn_implementation=attn)
    if cfg.lora is not None:
        from peft import prepare_model_for_kbit_training

        if cfg.model.quantization:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=activation_checkpointing)
        model = apply_lora(model, cfg.lora)
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # ZeRO-3 shards
    total, trainable = sum(n for n, _ in sizes), sum(n for n, grad in sizes if grad)
    log.info("model: %d parameters, %d trainable (%.2f%%)", total, trainable, 100 * trainable / total)
    return model


def apply_lora(model, lora_node: DictConfig):
    """PEFT's LoRA as the `lora` node says, with its targets checked against the model."""
    from hydra.utils import instantiate
    from peft import get_peft_model

    lora = instantiate(lora_node, _convert_="all")
    check_lora_targets(model, lora.target_modules)
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        if "lora_dropout" not in str(e):
            raise
        raise ConfigError("lora.lora_dropout", lora.lora_dropout, "this model's fused expert weights (mixture of "
                          "experts) take LoRA through PEFT's parameter wrappers, which have no dropout: set "
                          "lora.lora_dropout=0") from e


def check_lora_targets(model, targets) -> None:
    """Each module name of `lora.target_modules` must name a linear layer of this model (PEFT would wrap
    the others and train a subset without a word)."""
    import torch

    if isinstance(targets, str):  # "all-linear", or a regex PEFT matches itself
        return
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ConfigError("lora.target_modules", list(targets), f"{', '.join(missing)} name no linear layer of "
                          f"{type(model).__name__}; its linear layers: {', '.join(linear)} (or all-linear)")


def track_checkpoints(recipe: Recipe, cfg: DictConfig, checkpoint: str | None, changes: list) -> None:
    """Every checkpoint gets `sft_state.json` (run info, each stateful part's state); on resume that state
    comes back, once the data is checked to be the checkpoint's, and a new learning rate takes effect."""
    import uuid
    from importlib.metadata import version

    from sft.training.checkpoints import CheckpointState, LearningRateChange, check_resume_data, git_commit

    trainer, data = recipe.trainer, recipe.data
    stateful = {"clip": recipe.clip_policy, "trainer": trainer, **recipe.controllers}
    if len(stateful) < 2 + len(recipe.controllers):
        raise ConfigError("controllers", None, "a controller cannot be named clip or trainer")
    saved = check_resume_data(checkpoint, data.identity, cfg.resume_force) if checkpoint else None
    run_info = {"config": OmegaConf.to_container(cfg, resolve=True), "data_hash": data.data_hash,
                "data": data.identity, "sft_version": version("sft"), "git_commit": git_commit(),
                # a resume goes on with the run it resumes: rotation deletes only that run's checkpoints
                "run_id": saved.get("run_id") if saved is not None else uuid.uuid4().hex[:12]}
    trainer.add_callback(CheckpointState(run_info, stateful, cfg.trainer.save_total_limit, checkpoint,
                                         checksum_all=cfg.checkpoint_checksums == "all"))
    for name, state in (saved or {}).get("controllers", {}).items():
        if name in stateful:
            stateful[name].load_state_dict(state)
    for key, old, new in changes:
        if key == "trainer.learning_rate" and old:
            trainer.add_callback(LearningRateChange(old, new))


def train_with_advice(trainer, cfg: DictConfig, checkpoint: str | None):
    """`trainer.train`, turning a CUDA out-of-memory error into the settings that lower memory, and a full
    disk while saving into one line (`TrainingStopped`) saying so."""
    import torch

    try:
        return trainer.train(resume_from_checkpoint=checkpoint)
    except torch.OutOfMemoryError as e:  # a RuntimeError: before the disk-full clause
        t = cfg.trainer
        in_use = (f"trainer.per_device_train_batch_size={t.per_device_train_batch_size}, "
                  f"data.max_length={cfg.data.max_length}, trainer.activation_checkpointing={t.activation_checkpointing}, "
                  f"lora={'on' if cfg.lora is not None else 'off'}, "
                  f"deepspeed stage={(cfg.deepspeed or {}).get('zero_optimization', {}).get('stage', 'none')}, "
                  f"fsdp={'off' if cfg.fsdp is None else 'offload' if cfg.fsdp.cpu_offload else 'on'}")
        raise torch.OutOfMemoryError(
            f"CUDA out of memory with {in_use}. To lower memory, in this order: "
            "1) a smaller trainer.per_device_train_batch_size with a larger trainer.gradient_accumulation_steps "
            "(the loss is unchanged); 2) a smaller data.max_length; 3) trainer.activation_checkpointing=true; "
            "4) lora=default instead of full fine-tuning; 5) deepspeed=zero3 (or fsdp=full_shard), then "
            "deepspeed=zero3_offload (or fsdp=full_shard_offload). "
            f"Original error: {str(e).splitlines()[0]}") from e
    except (OSError, RuntimeError) as e:
        if checkpoint and "size mismatch" in str(e):  # the config matched (or resume_force), the weights do not
            mismatch = next(line.strip() for line in str(e).splitlines() if "size mismatch" in line)
            raise ConfigError("resume", checkpoint, f"its weights do not fit this model ({mismatch}): a checkpoint "
                              "of another model or LoRA shape") from e
        if not disk_full(e):
            raise
        raise TrainingStopped(disk_full_message(trainer.args.output_dir, trainer.state.global_step)) from e


def disk_full(error: BaseException) -> bool:
    """Whether an error while training is a full disk: ENOSPC, or how torch.save reports a short write."""
    import errno

    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return "No space left on device" in text or "unexpected pos" in text or "file write failed" in text


def disk_full_message(output_dir: str, step: int) -> str:
    """The disk is full: where, how much is free, about how much a checkpoint takes, and how to go on."""
    import shutil

    from sft.training.checkpoints import latest_complete

    free = shutil.disk_usage(output_dir).free / 2**20
    last = latest_complete(output_dir)
    needed = (f"; {last.name} took {sum(f.stat().st_size for f in last.rglob('*') if f.is_file()) / 2**20:,.0f} MiB"
              if last else "")
    return (f"the disk is full: saving checkpoint-{step} in {output_dir} failed with {free:,.0f} MiB free{needed}. "
            "That checkpoint is incomplete, so no resume uses it, and the earlier ones are untouched: free space "
            "(or lower trainer.save_total_limit), then run again with resume=auto")


def raise_if_failed(controllers: dict) -> None:
    """A controller that stopped training as a failure ends the run with its reason."""
    for controller in controllers.values():
        reason = controller.failure()
        if reason:
            raise TrainingStopped(reason)


def evaluate_and_save(recipe: Recipe, cfg: DictConfig, run_dir: str) -> dict:
    """The final evaluation (and exact match, if configured), row by row in `eval_rows.jsonl`; the model
    saved into `<run dir>/model`."""
    from sft.eval.generation import hardest_bucket_exact_match
    from sft.experiments.results import write_eval_rows

    trainer = recipe.trainer
    final_eval = final_evaluation(trainer) if evaluates(cfg) else {}
    if final_eval and trainer.is_world_process_zero():
        write_eval_rows(run_dir, trainer.last_eval_rows, trainer.eval_scores, trainer.tasks)
    trainer.save_model(os.path.join(run_dir, "model"))
    if cfg.exact_match is not None and recipe.data.eval is not None:
        final_eval["eval_exact_match_hardest"] = hardest_bucket_exact_match(
            trainer, recipe.tokenizer, read_eval_rows(cfg, recipe.data), list(cfg.eval_buckets),
            cfg.exact_match.max_rows, cfg.exact_match.max_new_tokens)
    return final_eval


def eval_generation(cfg: DictConfig, data: SFTData):
    """`sft.eval.samples.EvalGeneration` with its prompts chosen, where `eval_generation` is set and the run
    evaluates; else None."""
    from hydra.utils import instantiate

    if cfg.eval_generation is None or not evaluates(cfg):
        return None
    samples = instantiate(cfg.eval_generation, _convert_="all")
    samples.choose(read_eval_rows(cfg, data), list(cfg.eval_buckets))
    return samples


def read_eval_rows(cfg: DictConfig, data: SFTData) -> list[dict]:
    """The eval rows that the run evaluates on (those its data stage kept: valid, labelled, with a score where
    the run needs one), as validation reads them (`sft.data.rows.scan_source`): of `data.eval_file`, or of every
    eval source of a mixture, in its order."""
    from sft.data.formats import RowFormat
    from sft.data.split import row_keys
    from sft.data.rows import scan_source

    kept = set(row_keys(data.eval)) if data.eval is not None else set()
    rows = []
    for number, part in enumerate(data.parts):
        if part.eval is not None:
            found, _ = scan_source(part.eval, cfg.data.default_score, score_required=False,
                                   row_format=RowFormat(part.format, part.columns))
            rows += [r for r in found if (number, r["source_line"]) in kept]
    return rows


def evaluates(cfg: DictConfig) -> bool:
    """Whether the run evaluates at all: it has eval data and `trainer.eval_strategy` is not `no`."""
    return has_eval_data(cfg.data) and cfg.trainer.eval_strategy != "no"


def has_eval_data(data: DictConfig) -> bool:
    """Whether the `data` node names eval rows: `eval_file`, or a mixture source's."""
    return data.eval_file is not None or any(e.eval_file is not None for e in data.mixture)


def final_evaluation(trainer) -> dict:
    """The final model's eval metrics: those of the evaluation Trainer ran at the last step, where it ran one
    in this process (evaluating again would repeat it, and log the step twice), else a new evaluation."""
    last = next((e for e in reversed(trainer.state.log_history) if "eval_loss" in e), None)
    if (last is not None and last["step"] == trainer.state.global_step and trainer.last_eval_rows
            and not trainer.args.load_best_model_at_end):  # else the model evaluated last is not the final one
        return {k: v for k, v in last.items() if k.startswith("eval_")}
    return trainer.evaluate()


def collect_results(recipe: Recipe, final_eval: dict, train_output, run_dir: str, checkpoint: str | None,
                    started: float) -> RunResults:
    """The run's `RunResults`: final metrics, training figures, and what each controller reports."""
    trainer = recipe.trainer
    decided = {}
    for controller in recipe.controllers.values():
        decided.update(controller.results())
    return RunResults(
        eval_loss_initial=initial_eval_loss(trainer, run_dir),
        eval_loss=final_eval.get("eval_loss"),
        eval_ce=final_eval.get("eval_ce"),
        eval_token_accuracy=final_eval.get("eval_token_accuracy"),
        eval_loss_buckets=RunResults.buckets(final_eval),
        eval_tasks=RunResults.tasks(final_eval),
        train_loss=train_output.training_loss,
        global_step=trainer.state.global_step,
        train_tokens_per_second=trainer.throughput.tokens_per_second,
        loss_impl=trainer.loss_impl,
        train_runtime=train_output.metrics.get("train_runtime"),
        data_hash=recipe.data.data_hash,
        resumed_from=checkpoint,
        eval_exact_match_hardest=final_eval.get("eval_exact_match_hardest"),
        wall_time_s=round(time.time() - started, 1),
        eval_history=[{k: e[k] for k in ("step", "eval_loss", "eval_ce") if k in e}
                      for e in trainer.state.log_history if "eval_loss" in e],
        **decided,
    )


def initial_eval_loss(trainer, run_dir: str) -> float | None:
    """Eval loss before any training: from this session's first evaluation, or the saved one on resume."""
    import json

    saved = Path(run_dir, "eval_initial.json")
    first = next((e for e in trainer.state.log_history if "eval_loss" in e), None)
    if first is not None and first.get("step") == 0:
        if trainer.is_world_process_zero():
            saved.write_text(json.dumps(first) + "\n")
        return first["eval_loss"]
    return json.loads(saved.read_text())["eval_loss"] if saved.exists() else None


# --- the command line ---------------------------------------------------------------------------------


def fail(message: str, code: int = 2) -> None:
    """From an `except` block: stop with the reason and `code` (a traceback with HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from hydra.errors import InstantiationException

    from sft.data.rows import DataError
    from sft.training.preemption import PREEMPTED_EXIT_CODE, Preempted

    started = time.time()
    finished = start_sweep_job(cfg) if in_sweep() else None
    if finished is not None:
        return finished.eval_ce
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
        if isinstance(reason, Preempted):  # also inside a sweep: the machine is going away, so is the sweep
            print(f"preempted: {reason}", file=sys.stderr)
            sys.exit(PREEMPTED_EXIT_CODE)
        raise
    if os.environ.get("RANK", "0") == "0":
        print(f"run dir: {HydraConfig.get().runtime.output_dir}")
    return results.eval_ce  # the objective of sweeps: comparable across loss weights, unlike eval_loss


def start_sweep_job(cfg: DictConfig) -> RunResults | None:
    """A job of a multirun records its overrides in its dir; with `sweep.resume`, a job that finished before
    returns its results (it is not run again) and the others resume from their newest complete checkpoint."""
    from sft.experiments.sweep import start_job

    hydra_cfg = HydraConfig.get()
    try:
        finished = start_job(hydra_cfg.runtime.output_dir, hydra_cfg.job.num, job_overrides(), cfg.sweep.resume)
    except ConfigError as e:  # the sweep dir is another sweep's: no job of this one may write into it
        fail(f"config: {e}")
    if finished is not None:
        log.info("sweep.resume: this job finished before (results.json ok): skipped")
    elif cfg.sweep.resume:
        cfg.resume = "auto"
    return finished


def record_failure(error: BaseException, wall_time_s: float) -> None:
    """A failed job of a sweep: its error in `results.json` and the log; the sweep goes on."""
    failed = RunResults.failed(error, wall_time_s)
    log.error("job failed (sweep.continue_on_error=true, the sweep goes on): %s", failed.error)
    if os.environ.get("RANK", "0") == "0":
        failed.write(HydraConfig.get().runtime.output_dir)


def cli() -> None:
    """The `python -m sft.train` entry point: settle the multi-process details, then run `main`."""
    if {"--help", "-h"} & set(sys.argv[1:]):
        from sft.config import help_text

        text = help_text([a for a in sys.argv[1:] if a not in ("--help", "-h")])
        if text is not None:  # else Hydra's own --help (a pkg:// search path, or an error to report)
            print(text, end="")
            return
    # before Hydra, whose errors would not name the knob
    if refused := owned_field_override(sys.argv[1:]) or key_of_engine_left_off(sys.argv[1:]):
        print(f"error: config: {refused}", file=sys.stderr)
        sys.exit(2)
    refuse_multirun_in_launch(sys.argv[1:])
    share_run_dir()
    sys.argv.extend(rank_overrides())
    main()


if __name__ == "__main__":
    cli()
