"""Exact-match accuracy of generated answers: does greedy decoding reproduce the reference answer?

Used after training on the eval set's difficulty buckets (`exact_match` config node): the hardest one
(`eval_exact_match_hardest`) or each of them (`exact_match.buckets=each`: `eval_exact/bucket_<k>` and `eval_exact/all`).
The prompt is the chat up to its last assistant turn, the answer is compared to that turn's content after stripping.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass

from sft.config.schema import Choice, Schema, config_schema, knob
from sft.data.chat.template import prompt_text, stop_token_ids


class Buckets(Choice):
    hardest = "hardest"
    each = "each"


@config_schema("exact_match", "exact_match")
@dataclass
class ExactMatchConfig(Schema):
    """Greedy-decoding exact match on the eval buckets after training: the hardest (`eval_exact_match_hardest`), or each
    (`eval_exact/bucket_<k>`, `eval_exact/all`, the hardest's too)."""

    max_rows: int = knob(100, "rows of each bucket compared (the first of the eval set's)")
    max_new_tokens: int = knob(32, "the longest answer generated")
    buckets: Buckets = knob(Buckets.hardest, "hardest: the hardest bucket's rows; each: every bucket's, each reported")

    def check(self, cfg=None):
        self.require("max_rows", self.max_rows >= 1, "must be >= 1")
        self.require("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1")

log = logging.getLogger("sft")


def bucket_rows(rows: list[dict], bucket_edges: list[float], max_rows: int) -> dict[int, list[dict]]:
    """The eval rows (`sft.data.rows.reading.read_jsonl`'s) of each non-empty difficulty bucket (bucket k: scores from edge
    k-1 up to edge k), in their order, at most `max_rows` each; a row without a score counts as 0."""
    buckets: dict[int, list[dict]] = {}
    for r in rows:
        buckets.setdefault(bisect.bisect_right(bucket_edges, r.get("difficulty_score") or 0.0), []).append(r)
    return {k: buckets[k][:max_rows] for k in sorted(buckets)}


def greedy_answers(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 32,
                   synced_gpus: bool = False) -> list[str]:
    """Each row's greedy answer to its chat up to the last assistant turn, prompted as the labelling renders it
    (`sft.data.chat.template.prompt_text`) and ended by the tokens answers are trained to end with (left-padded
    batches; the model's train/eval mode and the tokenizer's padding side are restored), special tokens left out."""
    return [tokenizer.decode(ids, skip_special_tokens=True)
            for ids in greedy_ids(model, tokenizer, rows, max_new_tokens, batch_size, synced_gpus)]


def greedy_ids(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 32,
               synced_gpus: bool = False) -> list[list[int]]:
    """The token ids of `greedy_answers`, each up to (not including) its first stop token: special tokens kept,
    for reading tool calls (some templates open them with a special token)."""
    import torch

    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    answers = []
    try:
        stops = stop_token_ids(tokenizer)  # the tokens answers are trained to end with
        ends = set(stops or [tokenizer.eos_token_id])
        for start in range(0, len(rows), batch_size):
            prompts = [prompt_text(tokenizer, r["messages"][:-1], _tools(r)) for r in rows[start:start + batch_size]]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, synced_gpus=synced_gpus,
                                     eos_token_id=stops or tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            for generated in out[:, enc["input_ids"].shape[1]:].tolist():  # (padding follows a stop token only)
                answers.append(generated[:next((i for i, token in enumerate(generated) if token in ends),
                                               len(generated))])
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers


def _tools(row: dict) -> list | None:
    """A validated row's tool definitions (`sft.data` keeps them as JSON text)."""
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) and tools else (tools or None)


def reference(row: dict) -> str:
    """The answer a row's chat ends with (a call-only turn's null content: empty)."""
    return row["messages"][-1].get("content") or ""


def exact_match(answer: str, reference: str) -> float:
    """1.0 where the answer equals the reference, surrounding white space aside; 0.0 for an empty reference (a turn
    that only calls tools, scored by its calls): an empty answer is no match of nothing."""
    return float(bool(reference.strip()) and answer.strip() == reference.strip())


def warn_if_cut(what: str, lengths: list[int], max_new_tokens: int, knob: str) -> int:
    """Log a warning where answers reached `max_new_tokens` before their stop token (each then scores as wrong);
    return how many did."""
    cut = sum(n >= max_new_tokens for n in lengths)
    if cut:
        log.warning("%s: %d of %d answers reached %s=%d before their stop token, cut there (scored as they are): "
                    "raise it if the answers are longer", what, cut, len(lengths), knob, max_new_tokens)
    return cut


def bucket_exact_match(trainer, tokenizer, eval_rows: list[dict], bucket_edges: list[float], max_rows: int,
                       max_new_tokens: int, each: bool = False) -> dict[str, float]:
    """Exact match of greedy answers after training (every rank generates; rank 0 reports): on the hardest eval
    bucket (`eval_exact_match_hardest`), and with `each` on every bucket (`eval_exact/bucket_<k>`) and all of those
    rows together (`eval_exact/all`)."""
    buckets = bucket_rows(eval_rows, bucket_edges, max_rows)
    if not each:
        buckets = {max(buckets): buckets[max(buckets)]}
    rows = [r for chosen in buckets.values() for r in chosen]
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped if trainer.is_zero3 else trainer.model)
    ids = greedy_ids(model, tokenizer, rows, max_new_tokens, synced_gpus=trainer.shards_parameters)
    warn_if_cut("exact_match", [len(i) for i in ids], max_new_tokens, "exact_match.max_new_tokens")
    answers = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    hits = iter([exact_match(a, reference(r)) for a, r in zip(answers, rows)])
    scores = {k: [next(hits) for _ in chosen] for k, chosen in buckets.items()}
    metrics = {"eval_exact_match_hardest": sum(scores[max(scores)]) / len(scores[max(scores)])}
    if each:
        metrics.update({f"eval_exact/bucket_{k}": sum(v) / len(v) for k, v in scores.items()})
        metrics["eval_exact/all"] = sum(map(sum, scores.values())) / len(rows)
    log.info("exact match of greedy answers: %s", ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
