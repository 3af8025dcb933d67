"""Fine-tune a chat model: `python -m sft.train [group=option] [key=value ...]` (see conf/train.yaml).

The recipe, top to bottom (`train`): find the checkpoint to resume from; build the training arguments
(before the model, as DeepSpeed ZeRO-3 requires), tokenizer, loss, controllers, model (+ LoRA), data,
collator and trainer (`build`, which the bench's cases share); restore the checkpoint's state; train
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

from sft.config.registry import CONF_DIR, register
from sft.config.schema import ConfigError
from sft.config.secrets import mask_saved_config, secrets_to_environment
from sft.config.validate import check
from sft.experiments.results import RunResults
from sft.experiments.tracking import (finish_mlflow, finish_trackers, in_sweep, job_overrides, log_hparams,
                                      name_the_run, start_mlflow)
from sft.files import own_path, write_text
from sft.training.advice import TrainingStopped, raise_if_failed, stop_on_full_disk, train_with_advice
from sft.training.arguments import evaluates, training_arguments
from sft.training.sequence_parallel import sequence_parallel_size
from sft.training.distributed import (end_process_group, exit_without_teardown, rank_overrides,
                                      refuse_multirun_in_launch, set_cpu_threads, share_run_dir, slurm_distributed_env)
from sft.training.engines import check_fsdp_layers, check_fsdp_resume
from sft.training.run_dir import lock_run_dirs

if TYPE_CHECKING:
    from sft.data.load import SFTData
    from sft.training.trainer import WeightedLossTrainer

log = logging.getLogger("sft")
register()


# Names a controller of yours cannot take: what every run puts under them in each checkpoint's state.
RESERVED_NAMES = {"preemption": "the controller every run has (SIGTERM: save and stop; signal_grace_s)",
                  "clip": "the clip policy's state in every checkpoint", "trainer": "Trainer's state in every checkpoint"}


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
    from sft.training.checkpoints import find_checkpoint, step_of
    from sft.training.preemption import Preempted, Preemption
    from sft.training.step_log import no_bars_without_a_terminal

    started = time.time()
    no_bars_without_a_terminal()
    slurm_distributed_env()
    set_cpu_threads(log)
    name_the_run()
    run_dir = HydraConfig.get().runtime.output_dir
    output_dir = cfg.trainer.output_dir or run_dir
    locks = lock_run_dirs(run_dir, output_dir)  # one run in a dir at a time
    preemption = Preemption(grace_s=cfg.signal_grace_s)
    preemption.install()  # a signal now stops the start-up; in training, after a checkpoint; after it, once finished
    try:
        checkpoint = find_checkpoint(cfg.resume, output_dir, cfg.resume_force, cfg.trust_checkpoint)
        check_fsdp_resume(cfg, checkpoint)
        changes = continue_or_claim(cfg, output_dir, checkpoint)
        recipe = build(cfg, run_dir, checkpoint, preemption)
        track_checkpoints(recipe, cfg, checkpoint, changes)
        start_mlflow(cfg, run_dir)
        preemption.on_exit = lambda: record_preempted(recipe.trainer, run_dir, started)
        train_output = train_with_advice(recipe.trainer, cfg, checkpoint)
        if checkpoint and recipe.trainer.state.global_step == step_of(checkpoint):  # (then nothing trained)
            log.info("resume: %s holds every step of the run (%d): nothing trained; the final evaluation and "
                     "model/ again", checkpoint, recipe.trainer.state.global_step)
        preemption.training_done = True
        if preemption.stopped_at is not None:
            stop_preempted(recipe.trainer, preemption, run_dir, started)
        raise_if_failed(recipe.controllers)
        final_eval = evaluate_and_save(recipe, cfg, run_dir)
        final_eval.update(benchmark_after_training(recipe, cfg, run_dir, final_eval))
        results = collect_results(recipe, final_eval, train_output, run_dir, checkpoint, started)
        log_hparams(cfg, run_dir, results.to_json(), recipe.trainer.args)
        finish_trackers()
        if recipe.trainer.is_world_process_zero():
            results.write(run_dir)
        finish_mlflow(run_dir, "FINISHED")
    except BaseException as e:
        if isinstance(e, Preempted) and e.at_start:  # nothing trained: results.json says so, with what to resume
            record_preempted(None, run_dir, started, output_dir)
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            finish_mlflow(run_dir, "KILLED" if isinstance(e, Preempted) else "FAILED")
        raise
    finally:
        preemption.uninstall()
        for lock in locks:
            lock.release()
    end_process_group()
    if preemption.signal is not None and in_sweep():  # a signal after training: this job finished, the sweep stops
        raise Preempted(f"{preemption.signal} after training: this job finished ({run_dir}); the sweep stops here "
                        "(the same command with sweep.resume=true goes on)", None)
    return results


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
    return check_resume_config(checkpoint, saved_config(cfg), cfg.resume_force)


def saved_config(cfg: DictConfig) -> dict:
    """The config as checkpoints keep it: resolved, its secrets masked (`sft.config.secrets`)."""
    from sft.config.secrets import masked

    return masked(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


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


def record_preempted(trainer, run_dir: str, started: float, output_dir: str | None = None) -> None:
    """A run that exits at a signal without finishing (in its start-up, `trainer` None; a second signal, or past
    `signal_grace_s`; also after training): `results.json` says preempted, with the newest complete checkpoint to
    continue from."""
    from sft.training.checkpoints import latest_complete, step_of

    if os.environ.get("RANK", "0") == "0":
        last = latest_complete(output_dir or trainer.args.output_dir)
        step = trainer.state.global_step if trainer is not None else (step_of(last) if last else 0)
        RunResults(status="preempted", checkpoint=str(last) if last else None, global_step=step,
                   resumed_from=None, wall_time_s=round(time.time() - started, 1)).write(run_dir)


def build(cfg: DictConfig, run_dir: str, checkpoint: str | None = None, preemption=None) -> Recipe:
    """Training arguments (before the model: ZeRO-3), tokenizer, loss, controllers, model, data, collator, trainer."""
    from hydra.utils import instantiate
    from transformers import set_seed

    from sft.data.load import load_sft_datasets
    from sft.data.weights import scores_used_by
    from sft.loss.base import build_loss
    from sft.training.controllers import build_controllers
    from sft.training.preemption import Preemption
    from sft.training.trainer import WeightedLossTrainer

    clip_policy = instantiate(cfg.clip)
    # 0 for a policy that does not clip (at first): Trainer then calls no clipping, and the step still goes to
    # WeightedLossTrainer._get_grad_norm (sft.training.step_control)
    args = training_arguments(cfg, run_dir, resuming=checkpoint is not None,
                              max_grad_norm=clip_policy.initial_threshold())
    set_seed(args.seed)

    tokenizer = instantiate(cfg.tokenizer)
    loss = build_loss(cfg.loss)
    controllers = build_controllers(cfg.controllers)
    for name in RESERVED_NAMES.keys() & controllers.keys():  # each is a key of the checkpoints' state
        raise ConfigError(f"controllers.{name}", None, f"is the name of {RESERVED_NAMES[name]}: name yours otherwise")
    # The model before the data: what it refuses (packed rows it cannot keep apart, sft.model.packing) is refused
    # before any data is read. Seeded again: building a cached artefact (the tiny model, on first use) draws random
    # numbers, which would give the adapters (or a random-init model) other initial weights on the next run.
    set_seed(args.seed)
    model = build_model(cfg, args.activation_checkpointing)
    check_fsdp_layers(cfg.fsdp, model)
    spec = instantiate(cfg.data, _convert_="object")  # a DataSpec
    with args.main_process_first(desc="preprocessing"):
        data = load_sft_datasets(spec, tokenizer, loss, scores_needed_by=scores_used_by(loss, controllers),
                                 rejected_file=os.path.join(run_dir, "rejected.jsonl") if args.process_index == 0
                                 else None)
    controllers["preemption"] = preemption or Preemption(grace_s=cfg.signal_grace_s)
    log.info("data %s: %s", data.data_hash, data.counts())

    sequence_parallel = sequence_parallel_size(cfg)
    trainer = WeightedLossTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=instantiate(cfg.collator, tokenizer=tokenizer, sequence_parallel=sequence_parallel),
        processing_class=tokenizer,
        loss=loss,
        clip_policy=clip_policy,
        controllers=controllers,
        eval_buckets=cfg.eval_buckets,
        sources=[str(part.train) for part in data.parts],
        tasks=data.tasks,
        throughput=instantiate(cfg.throughput),
        eval_generation=eval_generation(cfg, data),
        eval_harness=instantiate(cfg.eval_harness, _convert_="all") if cfg.eval_harness is not None else None,
        sequence_parallel=sequence_parallel,
    )
    return Recipe(trainer, data, tokenizer, clip_policy, controllers)


# --- the steps of `build` and `train` -----------------------------------------------------------------


def build_model(cfg: DictConfig, activation_checkpointing: bool):
    """The model (+ LoRA) of the `model` and `lora` groups, with the attention packed batches need."""
    from hydra.utils import instantiate

    from sft.model.lora import apply_lora
    from sft.model.packing import check_packing

    attn = cfg.model.attn_implementation
    if cfg.data.packing and attn == "sdpa":  # sdpa would attend across the whole packed row, under a mask
        attn = "sdpa_varlen"
        log.info("data.packing: attention sdpa_varlen (sdpa per sample of the packed row)")
    model = instantiate(cfg.model, attn_implementation=attn, sequence_parallel=sequence_parallel_size(cfg))
    if cfg.data.packing:
        check_packing(model)
    if cfg.lora is not None:
        from peft import prepare_model_for_kbit_training

        if cfg.model.quantization:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=activation_checkpointing)
        model = apply_lora(model, cfg.lora)
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # ZeRO-3 shards
    total, trainable = sum(n for n, _ in sizes), sum(n for n, grad in sizes if grad)
    log.info("model: %d parameters, %d trainable (%.2f%%)", total, trainable, 100 * trainable / total)
    return model


def track_checkpoints(recipe: Recipe, cfg: DictConfig, checkpoint: str | None, changes: list) -> None:
    """Every checkpoint gets `sft_state.json` (run info, each stateful part's state); on resume that state
    comes back, once the data is checked to be the checkpoint's, and a new learning rate takes effect."""
    import uuid

    from sft import version
    from sft.training.checkpoints import CheckpointState, LearningRateChange, check_resume_data, git_commit

    trainer, data = recipe.trainer, recipe.data
    stateful = {"clip": recipe.clip_policy, "trainer": trainer, **recipe.controllers}  # build refuses those names
    saved = check_resume_data(checkpoint, data.identity, cfg.resume_force) if checkpoint else None
    run_info = {"config": saved_config(cfg), "data_hash": data.data_hash, "world_size": trainer.args.world_size,
                "data": data.identity, "sft_version": version(), "git_commit": git_commit(),
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


def evaluate_and_save(recipe: Recipe, cfg: DictConfig, run_dir: str) -> dict:
    """The final evaluation (and exact match, if configured), row by row in `eval_rows.jsonl`; the model
    saved into `<run dir>/model`."""
    from sft.eval.generation import bucket_exact_match
    from sft.experiments.results import write_eval_rows
    from sft.model.serving import chat_defaults_saved, set_generation_stops

    trainer = recipe.trainer
    final_eval = final_evaluation(trainer) if evaluates(cfg) else {}
    if final_eval and trainer.is_world_process_zero():
        write_eval_rows(run_dir, trainer.last_eval_rows, trainer.eval_scores, trainer.tasks)
    model_dir = str(own_path(os.path.join(run_dir, "model")))
    model = trainer.accelerator.unwrap_model(trainer.model)
    set_generation_stops(model, recipe.tokenizer)  # a server stops where answers were trained to end
    # a server renders prompts as training did: the run's template kwargs become the saved template's defaults
    with stop_on_full_disk(run_dir, "the final model (model/)"), chat_defaults_saved(recipe.tokenizer):
        trainer.save_model(model_dir)
        if hasattr(model, "get_base_model") and trainer.is_world_process_zero():  # an adapter: its stops beside it
            model.get_base_model().generation_config.save_pretrained(model_dir)
    if cfg.exact_match is not None and recipe.data.eval is not None:
        final_eval.update(bucket_exact_match(trainer, recipe.tokenizer, recipe.data.eval_rows(), list(cfg.eval_buckets),
                                             cfg.exact_match.max_rows, cfg.exact_match.max_new_tokens,
                                             each=cfg.exact_match.buckets == "each"))
    return final_eval


def benchmark_after_training(recipe: Recipe, cfg: DictConfig, run_dir: str, final_eval: dict) -> dict:
    """`eval_harness` on the final model, logged at the last step (unless the final evaluation ran it): the model in
    memory, or, where ZeRO-3 or FSDP shard it over the ranks, the saved `model/` (rank 0 loads it)."""
    from hydra.utils import instantiate

    trainer = recipe.trainer
    if trainer.eval_harness is None or any(k.startswith("eval_harness/") for k in final_eval):
        return {}
    model, saved = trainer.accelerator.unwrap_model(trainer.model), os.path.join(run_dir, "model")
    if trainer.shards_parameters and trainer.is_world_process_zero():
        from peft import PeftModel

        model = (PeftModel.from_pretrained(instantiate(cfg.model), saved) if cfg.lora is not None
                 else instantiate(cfg.model, name_or_path=saved, gguf_file=None))
    metrics = trainer.benchmark(model)
    trainer.log(dict(metrics))
    return metrics


def eval_generation(cfg: DictConfig, data: SFTData):
    """`sft.eval.samples.EvalGeneration` with its prompts chosen, where `eval_generation` is set and the run
    evaluates; else None."""
    from hydra.utils import instantiate

    if cfg.eval_generation is None or not evaluates(cfg):
        return None
    samples = instantiate(cfg.eval_generation, _convert_="all")
    samples.choose(data.eval_rows(), list(cfg.eval_buckets))
    return samples


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
    results = RunResults(
        eval_loss_initial=initial_eval_loss(trainer, run_dir),
        eval_loss=final_eval.get("eval_loss"),
        eval_ce=final_eval.get("eval_ce"),
        eval_token_accuracy=final_eval.get("eval_token_accuracy"),
        eval_loss_buckets=RunResults.buckets(final_eval),
        eval_tasks=RunResults.tasks(final_eval),
        eval_extra={k: v for k, v in RunResults.extra_metrics(final_eval).items() if not k.endswith("/seconds")},
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
    )
    for name, controller in recipe.controllers.items():
        try:
            results.add_controller_results(name, controller.results())
        except ValueError as e:
            raise TrainingStopped(str(e)) from None
    return results


def initial_eval_loss(trainer, run_dir: str) -> float | None:
    """Eval loss before any training: from this session's first evaluation, or the saved one on resume."""
    import json

    saved = Path(run_dir, "eval_initial.json")
    first = next((e for e in trainer.state.log_history if "eval_loss" in e), None)
    if first is not None and first.get("step") == 0:
        if trainer.is_world_process_zero():
            write_text(own_path(saved), json.dumps(first) + "\n")
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
    if os.environ.get("RANK", "0") == "0":
        mask_saved_config(HydraConfig.get().runtime.output_dir)
    finished = start_sweep_job(cfg) if in_sweep() else None
    if finished is not None:
        return finished.eval_ce
    try:
        check(cfg)
        results = train(cfg)
    except Exception as e:
        # instantiate wraps what the built function raised; the user needs that reason, not the wrapper.
        reason = e.__cause__ if isinstance(e, InstantiationException) else e
        if isinstance(reason, Preempted):  # also inside a sweep: the machine is going away, so is the sweep
            print(f"preempted: {reason}", file=sys.stderr)
            sys.exit(PREEMPTED_EXIT_CODE)
        if in_sweep() and cfg.sweep.continue_on_error:
            RunResults.failed(reason, time.time() - started).record(HydraConfig.get().runtime.output_dir)
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


def cli() -> None:
    """The `python -m sft.train` entry point: settle the multi-process details, then run `main`."""
    if {"--help", "-h"} & set(sys.argv[1:]):
        from sft.config.help import help_answer

        try:
            text = help_answer(sys.argv[1:])
        except ConfigError as e:
            fail(f"config: {e}")
        if text is not None:  # else Hydra's own --help (a pkg:// search path, or an error to report)
            print(text, end="")
            return
    from sft.config.argv import check_only, refused_override
    from sft.training.run_dir import unlink_planted, unwritable_dir

    sys.argv[1:] = secrets_to_environment(sys.argv[1:])  # before Hydra writes or W&B records the command line
    if "--check" in sys.argv[1:]:  # compose and check only (./launch.sh, before several processes)
        sys.exit(check_only([a for a in sys.argv[1:] if a != "--check"]))

    # before Hydra, whose errors would not name the knob, and which writes into the run dir first
    if refused := refused_override(sys.argv[1:]) or unwritable_dir(sys.argv[1:]):
        print(f"error: config: {refused}", file=sys.stderr)
        sys.exit(2)
    unlink_planted(sys.argv[1:])
    refuse_multirun_in_launch(sys.argv[1:])
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        from sft.sweep import start_multirun

        start_multirun(sys.argv[1:])
    share_run_dir()
    sys.argv.extend(rank_overrides())
    main()


if __name__ == "__main__":
    cli()
    exit_without_teardown()  # not in `cli`: tests call that in their own process
