"""Benchmarks of the fine-tuned model through EleutherAI's lm-evaluation-harness (`+eval_harness=...`, `pip install
-e '.[eval]'`): after training, and optionally at every k-th evaluation.

Tasks are the harness's own names (`gsm8k`, `ifeval`: their data come from the hub, or its cache when offline), the
path of a task YAML of yours (its data files on disk), or one bundled on the sample data's eval additions
(`sft/eval/tasks/*.yaml`, which lm-eval reads too: `lm_eval --include_path sft/eval/tasks` from the repo root):
`sft_sample_addition` (answers generated with the chat template, exact match), `sft_sample_addition_choice` (the
reference answer against three slipped sums, by log-likelihood) and `sft_sample_addition_ppl` (the reference
answers' per-byte perplexity). The model is the run's own, in memory,
prompted with its chat template and the run's `tokenizer.chat_template_kwargs`; under ZeRO-3 or FSDP, whose ranks
hold shards of it, rank 0 evaluates the saved `model/` after training instead. Rank 0 runs the harness, the other
ranks wait; its metrics, as `eval_harness/<task>/<metric>` (`exact_match`, `acc`, ... with the filter's name where it is
not `none`), go to the logs and trackers with the evaluation's, and the final ones to `results.json` and a sweep's
report.

    EvalHarness(tasks=["sft_sample_addition"], limit=32).run(model, tokenizer)
        -> {"eval_harness/sft_sample_addition/exact_match": 0.59, "eval_harness/seconds": 41.2}
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional
from unittest import mock

from sft.config.schema import ConfigError, Schema, config_schema, knob, missing

log = logging.getLogger("sft")

TASKS_DIR = Path(__file__).parent / "tasks"  # the bundled tasks, as task YAML files lm-eval reads (include_path)
SAMPLE_TASKS = ("sft_sample_addition", "sft_sample_addition_choice", "sft_sample_addition_ppl")


def sample_task(name: str) -> dict:
    """A bundled task (`sft/eval/tasks/<name>.yaml`, read as lm-eval reads it) on the sample data's eval rows, its data
    file's path made absolute: `sft_sample_addition`, exact match of the greedy answer; `sft_sample_addition_choice`,
    the reference against three slipped sums by log-likelihood (accuracy; chance 0.25); `sft_sample_addition_ppl`,
    the reference answers' per-byte perplexity (measures of every model, trained on the answers' format or not)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from sft import sample_data

    task = load_yaml(TASKS_DIR / f"{name}.yaml")
    task["dataset_kwargs"]["data_files"]["test"] = str(sample_data.EVAL_FILE)
    return task


@config_schema("eval_harness", "eval_harness")
@dataclass(eq=False, kw_only=True)
class EvalHarness(Schema):
    """lm-evaluation-harness tasks on the trained model."""

    _target_: str = "sft.eval.harness.EvalHarness"
    tasks: List[str] = knob(help="the harness's task names, paths of task YAML files, or the bundled "
                            "sft_sample_addition (exact match), sft_sample_addition_choice (accuracy among slipped "
                            "sums), sft_sample_addition_ppl (per-byte perplexity)", factory=list)
    limit: Optional[int] = knob(None, "examples per task (null: all of them)")
    num_fewshot: Optional[int] = knob(None, "few-shot examples (null: each task's own)")
    batch_size: int = knob(8, "prompts per forward pass")
    every: int = knob(0, "also at every k-th evaluation (0: after training only); not under ZeRO-3 or FSDP")
    apply_chat_template: bool = knob(True, "prompt with the model's chat template, as a chat model is served")
    system_instruction: Optional[str] = knob(None, "a system prompt before every prompt")
    seed: int = knob(1234, "the harness's seeds (few-shot sampling, any sampling)")

    def check(self, cfg=None):
        if absent := missing("lm_eval lm-eval"):
            raise ConfigError("tasks", None, f"needs lm-evaluation-harness: pip install -e '.[eval]' ({absent[1]})")
        self.require("tasks", len(self.tasks) > 0, "name at least one task")
        for task in self.tasks:
            if task.endswith((".yaml", ".yml")):
                self.require("tasks", Path(task).is_file(), f"{task}: no such task file")
        if named := [t for t in self.tasks if t not in SAMPLE_TASKS and not t.endswith((".yaml", ".yml"))]:
            import difflib

            from lm_eval.tasks import TaskManager  # indexes the harness's tasks (seconds): before training, not after

            known = TaskManager().all_tasks
            for task in named:
                close = difflib.get_close_matches(task, known, n=1, cutoff=0.7)
                self.require("tasks", task in known, f"{task}: lm-evaluation-harness has no such task"
                             + (f" (did you mean {close[0]}?)" if close else "") + "; the bundled: "
                             + ", ".join(SAMPLE_TASKS) + "; or the path of a task YAML of yours")
        self.require("limit", self.limit is None or self.limit >= 1, "must be >= 1 (or null: every example)")
        self.require("batch_size", self.batch_size >= 1, "must be >= 1")
        self.require("every", self.every >= 0, "must be >= 0")
        if cfg is not None and self.every:
            sharded = cfg.fsdp is not None or (cfg.deepspeed or {}).get("zero_optimization", {}).get("stage") == 3
            self.require("every", not sharded, "evaluating during training needs the whole model on rank 0, which "
                         "ZeRO-3 and FSDP shard: 0 (after training, on the saved model)")

    def __post_init__(self):
        self.evaluations = 0
        self.task_manager = None

    def due(self) -> bool:
        """Counts an evaluation; whether the harness runs at this one."""
        self.evaluations += 1
        return self.every > 0 and (self.evaluations - 1) % self.every == 0

    def run(self, model, tokenizer) -> dict[str, float]:
        """The tasks' metrics for `model` (a transformers model, a PEFT model: its adapters active) and `tokenizer`
        (its chat template and the run's kwargs), as `eval_harness/<task>/<metric>`, and `eval_harness/seconds`."""
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        from sft.data.chat.settings import chat_settings

        started = time.perf_counter()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA layers stay in it
        was_training = base.training
        kwargs = chat_settings(tokenizer).kwargs
        lm = HFLM(pretrained=base, tokenizer=tokenizer, batch_size=self.batch_size, device=str(base.device),
                  chat_template_args=dict(kwargs) or None)
        files = [Path(t) for t in self.tasks if t.endswith((".yaml", ".yml"))]
        if self.task_manager is None:  # it indexes every task of the harness: seconds, once a run
            self.task_manager = TaskManager(include_path=sorted({str(f.parent.resolve()) for f in files}) or None)
        tasks = [sample_task(t) if t in SAMPLE_TASKS else _task_name(Path(t)) if t.endswith((".yaml", ".yml"))
                 else t for t in self.tasks]
        # lm-eval records the machine through torch's collect_env, subprocesses (`pip list`, which asks PyPI for a
        # newer pip, ...) run with no timeout: minutes, or for ever, on a node with no route out. Only metrics are kept.
        try:
            with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None):
                out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=self.num_fewshot, limit=self.limit,
                                              task_manager=self.task_manager,
                                              apply_chat_template=self.apply_chat_template,
                                              system_instruction=self.system_instruction, log_samples=False,
                                              random_seed=self.seed, numpy_random_seed=self.seed,
                                              torch_random_seed=self.seed, fewshot_random_seed=self.seed)
        finally:
            base.train(was_training)
        metrics = harness_metrics(out["results"])
        metrics["eval_harness/seconds"] = time.perf_counter() - started
        log.info("eval_harness: %s", ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics


def harness_metrics(results: dict) -> dict[str, float]:
    """The harness's per-task results as `eval_harness/<task>/<metric>`: `exact_match,none` -> `exact_match`,
    `exact_match,flexible-extract` -> `exact_match_flexible-extract`; standard errors and aliases left out."""
    metrics = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, where = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not metric.endswith("_stderr") \
                    and key not in ("alias", "sample_len"):
                metrics[f"eval_harness/{task}/{metric}{'' if where in ('', 'none') else '_' + where}"] = float(value)
    return metrics


def _task_name(path: Path) -> str:
    """The `task:` name a task YAML declares (read as text: a task's YAML may hold the harness's own tags)."""
    import re

    found = re.search(r"^task:\s*['\"]?([^'\"\s#]+)", path.read_text(), re.M)
    if found is None:
        raise ConfigError("eval_harness.tasks", str(path), "declares no `task:` name")
    return found.group(1)
