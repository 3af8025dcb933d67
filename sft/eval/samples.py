"""Generation samples during evaluation (`eval_generation=default`): what the model answers, as training goes.

At every `every`-th evaluation, greedy answers to a fixed set of eval prompts (`prompts`, chosen once from
the eval file, spread over the difficulty buckets) are generated on every rank (synced under ZeRO-3), scored
by each metric in `metrics` (name -> the import path of a function `(answer, reference) -> float`) and
logged as `eval_gen/<name>` (their mean), `eval_gen/cut_answers` (the share that reached `max_new_tokens` before
their stop token, with a warning: they score as cut) and `eval_gen/seconds` with the evaluation's other metrics; the
table (step, prompt, reference, answer) goes to TensorBoard as text and to W&B as a table.

    metrics={exact_match: sft.eval.samples.exact_match}, answers ["4", "5 "], references ["4", "5"]
      ->  eval_gen/exact_match 1.0
"""

from __future__ import annotations

import bisect
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Dict

from sft.config.schema import ConfigError, Schema, config_schema, import_target, knob, missing
from sft.eval.generation import exact_match

# the default metric, by the import path configs name it with: sft.eval.samples.exact_match
DEFAULT_METRICS = {exact_match.__name__: f"{__name__}.{exact_match.__name__}"}

log = logging.getLogger("sft")


def rouge_l(answer: str, reference: str) -> float:
    """ROUGE-L F1 (`pip install rouge-score`)."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"]).score(reference, answer)["rougeL"].fmeasure


rouge_l.requires = "rouge_score rouge-score"  # checked with the config ("module pip-name"), not mid-training


def spread_over_buckets(rows: list[dict], bucket_edges: list[float], n: int) -> list[dict]:
    """`n` rows taken in turn from each difficulty bucket (in file order within each), so every bucket is
    represented; rows without a score form a group of their own.

        scores [1, 1, 1, 3, 3], edges [2], n=3  ->  the rows scored 1, 3, 1
    """
    groups: dict = {}
    for row in rows:
        score = row.get("difficulty_score")
        key = -1 if score is None else bisect.bisect_right(bucket_edges, score)
        groups.setdefault(key, []).append(row)
    queues = [groups[k] for k in sorted(groups)]
    chosen, depth = [], 0
    while len(chosen) < n and any(depth < len(q) for q in queues):
        chosen += [q[depth] for q in queues if depth < len(q)][: n - len(chosen)]
        depth += 1
    return chosen


@config_schema("eval_generation", "eval_generation")
@dataclass(eq=False, kw_only=True)
class EvalGeneration(Schema):
    """Greedy answers to fixed eval prompts at evaluations, scored and logged."""

    _target_: str = "sft.eval.samples.EvalGeneration"
    prompts: int = knob(8, "prompts chosen once from the eval file, spread over the difficulty buckets")
    every: int = knob(1, "at every k-th evaluation (the first included)")
    max_new_tokens: int = knob(64, "the longest answer generated")
    metrics: Dict[str, str] = knob(help="name -> import path of a function (answer, reference) -> float; logged as "
                                   "eval_gen/<name> (the mean)",
                                   factory=lambda: dict(DEFAULT_METRICS))
    tool_calls: bool = knob(True, "score the calls of prompts whose reference answer makes tool calls, read in the "
                            "chat template's own form: eval_gen/tool_call_accuracy (per call), "
                            "eval_gen/tool_turn_accuracy (per turn), eval_gen/tool_calls_malformed")

    def check(self, cfg=None):
        for key in ("prompts", "every", "max_new_tokens"):
            self.require(key, getattr(self, key) >= 1, "must be >= 1")
        for name, path in self.metrics.items():
            try:
                scorer = import_target(path)
            except ConfigError as e:
                raise ConfigError(f"metrics.{name}", path, e.reason) from None
            if not callable(scorer):
                raise ConfigError(f"metrics.{name}", path, "is not a function (answer, reference) -> float")
            if (needs := getattr(scorer, "requires", None)) and (absent := missing(needs)):
                raise ConfigError(f"metrics.{name}", path, f"needs {absent[0]}: pip install {absent[1]}")
        if cfg is not None:
            has_eval = cfg.data.eval_file is not None or any(e.eval_file for e in cfg.data.mixture)
            self.require("prompts", has_eval and cfg.trainer.eval_strategy != "no",
                         "generation samples are taken at evaluations: set data.eval_file and an eval_strategy")

    def __post_init__(self):
        self.check()  # the metrics' imports, before they are imported
        self.scorers = {name: import_target(path) for name, path in self.metrics.items()}
        self.rows: list[dict] = []
        self.evaluations = 0

    def choose(self, rows: list[dict], bucket_edges: list[float]) -> None:
        """Fix the prompts for the whole run (a resumed run chooses the same ones) among the eval rows (as
        `sft.data.rows.reading.read_jsonl` reads them)."""
        self.rows = spread_over_buckets(rows, bucket_edges, self.prompts)

    def due(self) -> bool:
        """Counts an evaluation; whether this one generates."""
        self.evaluations += 1
        return bool(self.rows) and (self.evaluations - 1) % self.every == 0

    def generate(self, model, tokenizer, synced_gpus: bool) -> tuple[dict[str, float], list[list[str]]]:
        """The metrics (`eval_gen/<name>`, the tool calls', `eval_gen/seconds`) and the table rows (prompt, reference,
        answer)."""
        from sft.eval.generation import greedy_ids, reference, warn_if_cut

        started = time.perf_counter()
        ids = greedy_ids(model, tokenizer, self.rows, self.max_new_tokens, batch_size=len(self.rows),
                         synced_gpus=synced_gpus)
        answers = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        references = [reference(r) for r in self.rows]
        cut = warn_if_cut("eval_generation", [len(i) for i in ids], self.max_new_tokens,
                          "eval_generation.max_new_tokens")
        metrics = {f"eval_gen/{name}": sum(score(a, ref) for a, ref in zip(answers, references)) / len(answers)
                   for name, score in self.scorers.items()}
        prompts_shown = [r["messages"][-2].get("content") or "" for r in self.rows]  # the last user turn
        table = [list(t) for t in zip(prompts_shown, references, answers)]
        if self.tool_calls:
            metrics.update(self._score_calls(tokenizer, [tokenizer.decode(i) for i in ids], table))
        metrics["eval_gen/cut_answers"] = cut / len(answers)  # reached max_new_tokens before their stop
        metrics["eval_gen/seconds"] = time.perf_counter() - started
        return metrics, table

    def _score_calls(self, tokenizer, texts: list[str], table: list[list[str]]) -> dict[str, float]:
        """Tool-call accuracy over the prompts whose reference answer makes calls (`sft.eval.tool_calls`); their rows
        of the table show the reference calls and the answer as generated, marked where a call is malformed."""
        from sft.eval.tool_calls import CallFormat, reference_calls, score

        calling = [k for k, r in enumerate(self.rows) if reference_calls(r["messages"][-1])]
        if not calling:
            return {}
        if not hasattr(self, "call_format"):
            self.call_format = CallFormat.of(tokenizer)
        right = total = turns = malformed = 0
        for k in calling:
            expected = reference_calls(self.rows[k]["messages"][-1])
            generated, bad = self.call_format.parse(texts[k]) if self.call_format else ([], 0)
            hits, turn = score(generated, expected)
            right, total, turns, malformed = right + hits, total + len(expected), turns + turn, malformed + bad
            table[k][1] = json.dumps([{"name": c.name, "arguments": c.arguments} for c in expected],
                                     ensure_ascii=False)
            table[k][2] = texts[k] + (f"  [{bad} malformed call(s)]" if bad else "")
        return {"eval_gen/tool_call_accuracy": right / total, "eval_gen/tool_turn_accuracy": turns / len(calling),
                "eval_gen/tool_calls_malformed": float(malformed)}


def markdown_table(step: int, table: list[list[str]]) -> str:
    """The samples as a Markdown table, which TensorBoard's text tab renders."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| step | prompt | reference | answer |", "|---|---|---|---|"]
    lines += [f"| {step} | {cell(p)} | {cell(r)} | {cell(a)} |" for p, r, a in table]
    return "\n".join(lines)


def log_samples(callbacks, step: int, table: list[list[str]]) -> None:
    """The samples to TensorBoard (through Trainer's own writer, into the run's event file) and W&B."""
    from transformers.integrations import TensorBoardCallback

    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
            callback.tb_writer.add_text("eval_gen/samples", markdown_table(step, table), step)
            callback.tb_writer.flush()
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.log({"eval_gen/samples": wandb.Table(columns=["step", "prompt", "reference", "answer"],
                                                       data=[[step, *row] for row in table])}, commit=False)
