"""The end of a run: the final evaluation and the model saved for serving (`evaluate_and_save`), benchmarks of the
trained model (`benchmark_after_training`), and the `RunResults` written to `results.json` (`collect_results`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig

from sft.experiments.results import RunResults
from sft.files import own_path, write_text
from sft.run.build import Recipe
from sft.training.arguments import evaluates
from sft.training.observability.advice import TrainingStopped, stop_on_full_disk


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
