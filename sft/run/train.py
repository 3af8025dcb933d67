"""A run of the recipe, top to bottom (`train`): find the checkpoint to resume from; build the run (`sft.run.build`);
restore the checkpoint's state; train (evaluating before, during and after); save the model and `results.json`
in the run dir (`sft.run.finish`). A signal stops it with a checkpoint and a record of where to continue."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sft.experiments.results import RunResults
from sft.experiments.summary import summary_text, write_summary
from sft.experiments.tracking import finish_mlflow, finish_trackers, in_sweep, log_hparams, name_the_run, start_mlflow
from sft.ranks import is_rank_zero
from sft.run.build import Recipe, build
from sft.run.finish import benchmark_after_training, collect_results, evaluate_and_save
from sft.training.arguments import resolve_learning_rate
from sft.training.checkpoints.run_dir import lock_run_dirs
from sft.training.checkpoints.sharded import format_of_checkpoint
from sft.training.observability.advice import raise_if_failed, train_with_advice
from sft.training.observability.metrics_file import read_metrics
from sft.training.processes.distributed import end_process_group, set_cpu_threads, slurm_distributed_env

log = logging.getLogger("sft")


def train(cfg: DictConfig) -> RunResults:
    """Run the recipe for a checked config; return the results written to `results.json`."""
    from sft.training.checkpoints.store import find_checkpoint, step_of
    from sft.training.observability.step_log import MetricsFile, no_bars_without_a_terminal
    from sft.training.step.preemption import Preempted, Preemption

    started = time.time()
    no_bars_without_a_terminal()
    slurm_distributed_env()
    set_cpu_threads(log)
    resolve_learning_rate(cfg)  # null: the model's kind of rate, which checkpoints and a resume then record
    name_the_run()
    run_dir = HydraConfig.get().runtime.output_dir
    output_dir = cfg.trainer.output_dir or run_dir
    locks = lock_run_dirs(run_dir, output_dir)  # one run in a dir at a time
    before = RunResults.read(run_dir)  # a stopped attempt's record: its preemptions go on into this one's
    if (finished := continue_slurm_job(cfg, run_dir, output_dir, before)) is not None:
        for lock in locks:
            lock.release()
        return finished
    preemption = Preemption(grace_s=cfg.signal_grace_s)
    preemption.install()  # a signal now stops the start-up; in training, after a checkpoint; after it, once finished
    try:
        checkpoint = find_checkpoint(cfg.resume, output_dir, cfg.resume_force, cfg.trust_checkpoint)
        format_of_checkpoint(cfg, checkpoint)
        changes = continue_or_claim(cfg, output_dir, checkpoint)
        recipe = build(cfg, run_dir, checkpoint, preemption)
        recipe.trainer.add_callback(MetricsFile(Path(run_dir, "metrics.jsonl"), step_of(checkpoint) if checkpoint
                                                else None))  # every number of every log
        preemptions = before.preemptions if before is not None and checkpoint else []
        track_checkpoints(recipe, cfg, checkpoint, changes)
        start_mlflow(cfg, run_dir)
        preemption.on_exit = lambda: record_preempted(recipe.trainer, run_dir, started, preemptions=preemptions,
                                                      signal=preemption.signal)
        train_output = train_with_advice(recipe.trainer, cfg, checkpoint)
        if checkpoint and recipe.trainer.state.global_step == step_of(checkpoint):  # (then nothing trained)
            log.info("resume: %s holds every step of the run (%d): nothing trained; the final evaluation and "
                     "model/ again", checkpoint, recipe.trainer.state.global_step)
        preemption.training_done = True
        if preemption.stopped_at is not None:
            stop_preempted(recipe.trainer, preemption, run_dir, started, preemptions)
        raise_if_failed(recipe.controllers)
        final_eval = evaluate_and_save(recipe, cfg, run_dir)
        final_eval.update(benchmark_after_training(recipe, cfg, run_dir, final_eval))
        results = collect_results(recipe, final_eval, train_output, run_dir, checkpoint, started)
        results.preemptions, results.slurm_job = preemptions, slurm_job_id()
        log_hparams(cfg, run_dir, results.to_json(), recipe.trainer.args)
        finish_trackers()
        if recipe.trainer.is_world_process_zero():
            results.write(run_dir)
            picture_and_summary(cfg, run_dir, results)
        finish_mlflow(run_dir, "FINISHED")
    except BaseException as e:
        if isinstance(e, Preempted) and e.at_start:  # nothing trained: results.json says so, with what to resume
            record_preempted(None, run_dir, started, output_dir, signal=preemption.signal,
                             preemptions=before.preemptions if before is not None else [])
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


def continue_slurm_job(cfg: DictConfig, run_dir: str, output_dir: str, before: RunResults | None) -> RunResults | None:
    """A requeued SLURM job's next attempt (`sft.training.processes.slurm`) continues its run, without the user adding
    `resume=auto`: a run that finished stays finished (its results returned, nothing trained); one stopped at a signal
    goes on from its newest complete checkpoint; one whose checkpoint is gone is refused (it would train its steps
    twice)."""
    from sft.config.schema import ConfigError
    from sft.training.processes.slurm import SlurmJob

    job = SlurmJob.current()
    if job is None or not job.continuation:
        return None
    if before is not None and before.status == "ok":
        log.info("SLURM job %s, attempt %d: this run finished before (%s/results.json): nothing to train", job.id,
                 job.restart + 1, run_dir)
        return before
    if before is not None and before.checkpoint and not Path(before.checkpoint).is_dir():
        start_over = (f"to train this job of the sweep again from the start, delete {run_dir} and "
                      "run the sweep again with sweep.resume=true (its finished jobs are kept)" if in_sweep() else
                      "submit it anew with overwrite=true to start over")
        raise ConfigError("resume", "auto", f"SLURM job {job.id}, attempt {job.restart + 1}: the checkpoint this run "
                          f"stopped at ({before.checkpoint}, results.json) is gone, so it cannot go on without "
                          f"training its steps again: {start_over}")
    if cfg.resume is None:
        cfg.resume = "auto"
    log.info("SLURM job %s, attempt %d: continuing the run in %s (resume=%s)", job.id, job.restart + 1, output_dir,
             cfg.resume)
    return None


def slurm_job_id() -> str | None:
    from sft.training.processes.slurm import SlurmJob

    job = SlurmJob.current()
    return job.id if job else None


def preemption_record(signal: str, step: int, checkpoint: str | None) -> dict:
    """One stop at a signal, as `results.json`'s `preemptions` lists it."""
    from sft.training.processes.slurm import SlurmJob

    job = SlurmJob.current()
    return {"signal": signal, "step": step, "checkpoint": checkpoint, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **({"slurm_job": job.id, "attempt": job.restart + 1} if job else {})}


def continue_or_claim(cfg: DictConfig, output_dir: str, checkpoint: str | None) -> list:
    """A resume continues the checkpoint's run: the settings that differ from its config are logged, and
    refused where the checkpoint cannot follow them (`check_resume_config`); returns them. On another number of
    processes the trainer's batch fields change to keep the step's rows (`check_resume_processes`). A new run may not
    start over another run's outputs (`sft.training.checkpoints.run_dir.claim`, `overwrite=true`)."""
    from sft.training.checkpoints.resume import check_resume_config
    from sft.training.checkpoints.run_dir import claim
    from sft.training.checkpoints.store import inside

    if cfg.resume != "auto" and not inside(checkpoint, output_dir):
        claim(output_dir, cfg.overwrite, sweep_job=in_sweep())
    if checkpoint is None:
        return []
    changes, batch = check_resume_config(checkpoint, saved_config(cfg), cfg.resume_force)
    cfg.trainer.merge_with(batch)  # another number of processes: the step keeps its rows
    return changes


def saved_config(cfg: DictConfig) -> dict:
    """The config as checkpoints keep it: resolved, its secrets masked (`sft.config.secrets`)."""
    from sft.config.secrets import masked

    return masked(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


def track_checkpoints(recipe: Recipe, cfg: DictConfig, checkpoint: str | None, changes: list) -> None:
    """Every checkpoint gets `sft_state.json` (run info, each stateful part's state); on resume that state
    comes back, once the data is checked to be the checkpoint's, and a new learning rate takes effect."""
    import uuid

    from sft import version
    from sft.training.checkpoints.resume import LearningRateChange, check_resume_data
    from sft.training.checkpoints.store import CheckpointState, git_commit

    trainer, data = recipe.trainer, recipe.data
    stateful = {"clip": recipe.clip_policy, "trainer": trainer, **recipe.controllers}  # build refuses those names
    saved = check_resume_data(checkpoint, data.identity, cfg.resume_force) if checkpoint else None
    run_info = {"config": saved_config(cfg), "data_hash": data.data_hash, "world_size": trainer.args.world_size,
                "data": data.identity, "sft_version": version(), "git_commit": git_commit(),
                # a resume goes on with the run it resumes: rotation deletes only that run's checkpoints
                "run_id": saved.get("run_id") if saved is not None else uuid.uuid4().hex[:12]}
    trainer.add_callback(CheckpointState(run_info, stateful, cfg.trainer.save_total_limit, checkpoint,
                                         checksum_all=cfg.checkpoint_checksums == "all", writer=trainer.shard_writer))
    for name, state in (saved or {}).get("controllers", {}).items():
        if name in stateful:
            stateful[name].load_state_dict(state)
    for key, old, new in changes:
        if key == "trainer.learning_rate" and old:
            trainer.add_callback(LearningRateChange(old, new))


def stop_preempted(trainer, preemption, run_dir: str, started: float, preemptions: list) -> None:
    """After a signal (`sft.training.step.preemption`): `results.json` says preempted and where the checkpoint is; raise
    `Preempted`."""
    from sft.training.step.preemption import Preempted

    checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{preemption.stopped_at}")
    continue_with = f"the same command plus resume=auto hydra.run.dir={run_dir}"
    if trainer.is_world_process_zero():
        results = RunResults(status="preempted", checkpoint=checkpoint, global_step=preemption.stopped_at,
                             resumed_from=None, wall_time_s=round(time.time() - started, 1),
                             preemptions=[*preemptions, preemption_record(preemption.signal, preemption.stopped_at,
                                                                          checkpoint)], slurm_job=slurm_job_id())
        results.write(run_dir)
        write_summary(run_dir, summary_text(run_dir, read_metrics(Path(run_dir, "metrics.jsonl")), "preempted",
                                            preemption.stopped_at, results.wall_time_s, continue_with=continue_with))
    finish_trackers()
    end_process_group()
    raise Preempted(f"{preemption.signal} at step {preemption.stopped_at}: saved {checkpoint}; continue with "
                    f"{continue_with}", checkpoint)


def picture_and_summary(cfg: DictConfig, run_dir: str, results: RunResults) -> None:
    """The run as a picture (`curves.png`), its summary (`summary.txt`), from its `metrics.jsonl`, and its page
    (`report.html`, `sft.experiments.pages`)."""
    from sft.experiments.curves import draw

    metrics = read_metrics(Path(run_dir, "metrics.jsonl"))
    if metrics:
        draw({Path(run_dir).name: metrics}, Path(run_dir, "curves.png"))
    model = str(cfg.model.get("gguf_file") or cfg.model.get("name_or_path") or "the model")
    write_summary(run_dir, summary_text(run_dir, metrics, "finished", results.global_step, results.wall_time_s,
                                        tokens_per_second=results.train_tokens_per_second,
                                        adapter=cfg.lora is not None, model_name=model,
                                        eval_rows=cfg.data.get("eval_file")))
    write_page(run_dir)


def write_page(run_dir: str) -> None:
    """The run's `report.html`; a page that cannot be written is said, the run's results stand."""
    from sft.experiments.pages import write_run_page
    from sft.run.recipe import recipe_or_none

    try:
        write_run_page(run_dir, recipe_or_none(run_dir))
    except OSError as e:
        log.warning("report.html could not be written (%s): sft report %s --html writes it later", e, run_dir)


def record_preempted(trainer, run_dir: str, started: float, output_dir: str | None = None,
                     preemptions: list | None = None, signal: str | None = None) -> None:
    """A run that exits at a signal without finishing (in its start-up, `trainer` None; a second signal, or past
    `signal_grace_s`; also after training): `results.json` says preempted, with the newest complete checkpoint to
    continue from."""
    from sft.training.checkpoints.store import latest_complete, step_of

    if is_rank_zero():
        last = latest_complete(output_dir or trainer.args.output_dir)
        step = trainer.state.global_step if trainer is not None else (step_of(last) if last else 0)
        results = RunResults(status="preempted", checkpoint=str(last) if last else None, global_step=step,
                             resumed_from=None, wall_time_s=round(time.time() - started, 1),
                             preemptions=[*(preemptions or []),
                                          preemption_record(signal or "a signal", step, str(last) if last else None)],
                             slurm_job=slurm_job_id())
        results.write(run_dir)
        # the summary too (a summary.txt of an earlier run in this dir would otherwise be printed as this one's)
        continue_with = f"the same command plus resume=auto hydra.run.dir={run_dir}" if last else None
        write_summary(run_dir, summary_text(run_dir, read_metrics(Path(run_dir, "metrics.jsonl")), "preempted", step,
                                            results.wall_time_s, continue_with=continue_with))
