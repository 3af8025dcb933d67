"""Chat data: JSONL reading and validation, tokenisation with assistant-only labels, caching, collation.

A row is `{"messages": [{"role": ..., "content": ...}, ...], "difficulty_score": 2.5}`. The whole chat is
rendered with the tokenizer's chat template; labels are -100 except on assistant turns (their content
and end-of-turn token, in every turn). Tokenised splits are cached under the sft cache keyed by the data
hash (file bytes, preprocessing settings, tokenizer), so a second run with the same inputs skips the
work. `loss_weights` (the sample's loss weight on its assistant tokens, 0 elsewhere) is added after the
cache, since it depends on the loss config rather than on the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from transformers import DataCollatorForSeq2Seq

from sft.model import cache_dir

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
PREPROCESS_VERSION = 1  # bump when tokenisation or labelling changes, to invalidate caches
MAX_ERRORS_SHOWN = 10


class DataError(ValueError):
    """Bad rows in a data file; the message lists `file:line: field: reason` for the first ones."""

    def __init__(self, problems: list[str], total: int | None = None):
        total = len(problems) if total is None else total
        shown = "\n".join(f"  {p}" for p in problems[:MAX_ERRORS_SHOWN])
        more = f"\n  ... and {total - MAX_ERRORS_SHOWN} more" if total > MAX_ERRORS_SHOWN else ""
        super().__init__(f"{total} bad row(s) in the data:\n{shown}{more}")
        self.problems, self.total = problems, total


# --- reading and validation ---------------------------------------------------------------------------


def _check_row(row, default_score: float | None) -> tuple[str, str] | None:
    """Return (field, reason) for the first problem of a parsed row, or None when it is valid."""
    if not isinstance(row, dict):
        return "row", f"must be a JSON object, got {type(row).__name__}"
    messages = row.get("messages")
    if messages is None:
        return "messages", "missing"
    if not isinstance(messages, list) or not messages:
        return "messages", "must be a non-empty list of {role, content} objects"
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            return where, "must be an object with role and content"
        if "role" not in m:
            return f"{where}.role", "missing"
        if m["role"] not in ROLES:
            return f"{where}.role", f"unknown role {m['role']!r} (expected one of {', '.join(ROLES)})"
        if "content" not in m:
            return f"{where}.content", "missing"
        if not isinstance(m["content"], str):
            return f"{where}.content", f"must be a string, got {type(m['content']).__name__}"
        if m["role"] == "assistant" and not m["content"].strip():
            return f"{where}.content", "empty assistant content"
    if messages[0]["role"] == "assistant":
        return "messages[0].role", "a chat must start with a system or user turn"
    if not any(m["role"] == "assistant" for m in messages):
        return "messages", "no assistant turn (nothing to train on)"
    score = row.get("difficulty_score")
    if score is None:
        if default_score is None:
            return "difficulty_score", "missing (set data.default_score to use a default)"
    elif isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) or score < 0:
        return "difficulty_score", f"must be a finite number >= 0, got {score!r}"
    return None


def read_jsonl(path: str | os.PathLike, default_score: float | None = None) -> list[dict]:
    """Read and validate a chat JSONL file; raise `DataError` naming file, line and field of bad rows.

    A UTF-8 BOM, CRLF line ends and blank lines are accepted. Each returned row carries `source_line`.
    """
    path = Path(path)
    rows, problems = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                problems.append(f"{path}:{lineno}: row: not UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not text:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{lineno}: row: invalid JSON ({e.msg} at column {e.colno})")
                continue
            problem = _check_row(row, default_score)
            if problem:
                problems.append(f"{path}:{lineno}: {problem[0]}: {problem[1]}")
                continue
            score = row.get("difficulty_score")
            rows.append({
                "messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]],
                "difficulty_score": float(default_score if score is None else score),
                "source_line": lineno,
            })
    if problems:
        raise DataError(problems)
    if not rows:
        raise DataError([f"{path}: file: no rows (the file is empty)"])
    return rows


# --- tokenisation -------------------------------------------------------------------------------------


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a chat and return its text with the character spans of every assistant turn.

    A span covers the turn's content and its end-of-turn token (trailing whitespace excluded). It is
    found by rendering the chat up to each turn, which needs a template whose renderings of a chat's
    prefixes are prefixes of its full rendering (true of ChatML/Qwen2.5 and most chat templates).
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False).rstrip()
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template does not render a chat's prefixes as prefixes of the whole chat, so "
                "assistant turns cannot be located; set tokenizer.chat_template to one that does"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_batch(batch: dict, tokenizer, max_length: int) -> dict:
    """`datasets.map` function: input_ids and assistant-only labels; rows left with no label are dropped."""
    rendered = [assistant_char_spans(tokenizer, messages) for messages in batch["messages"]]
    enc = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True, truncation=False
    )
    out = {"input_ids": [], "labels": [], "difficulty_score": [], "source_line": [], "truncated": []}
    for k, (ids, offsets, (_, spans)) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], rendered)):
        starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        trained = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            trained |= (starts >= a) & (starts < b)
        labels = np.where(trained, np.asarray(ids), IGNORE_INDEX)[:max_length]
        if not (labels[1:] != IGNORE_INDEX).any():  # position 0 is never a prediction target
            continue
        out["input_ids"].append(ids[:max_length])
        out["labels"].append(labels.tolist())
        out["difficulty_score"].append(batch["difficulty_score"][k])
        out["source_line"].append(batch["source_line"][k])
        out["truncated"].append(len(ids) > max_length)
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides tokenisation: vocabulary and merges, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = json.dumps(
        {
            "tokenizer": backend.to_str() if backend is not None else repr(tokenizer.get_vocab()),
            "special": tokenizer.all_special_tokens,
            "template": tokenizer.chat_template,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def data_identity(train_file: str, eval_file: str | None, tokenizer, max_length: int,
                  default_score: float | None) -> dict:
    """What decides the preprocessed data, part by part: file contents, preprocessing settings, tokenizer."""
    def file_hash(path):
        return None if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]

    return {
        "train_file": file_hash(train_file),
        "eval_file": file_hash(eval_file),
        "max_length": max_length,
        "default_score": default_score,
        "tokenizer": tokenizer_fingerprint(tokenizer)[:16],
        "preprocess_version": PREPROCESS_VERSION,
    }


def data_hash(identity: dict) -> str:
    """One short hash of a `data_identity`."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _tokenized_split(path: str, tokenizer, max_length: int, default_score, num_proc, key: str):
    """Tokenise one file, or load it from the cache written by an earlier run with the same key."""
    from datasets import Dataset, load_from_disk

    target = cache_dir() / "datasets" / f"{key}-{Path(path).stem}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    if target.exists():
        log.info("data: %s from cache %s", path, target)
        return load_from_disk(str(target))
    rows = read_jsonl(path, default_score)
    ds = Dataset.from_list(rows).map(
        tokenize_batch,
        batched=True,
        batch_size=256,
        num_proc=num_proc,
        remove_columns=["messages"],
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
        keep_in_memory=True,
        desc=f"tokenising {Path(path).name}",
    )
    dropped = len(rows) - len(ds)
    truncated = sum(ds["truncated"])
    if dropped or truncated:
        log.warning(
            "data: %s: %d row(s) truncated to data.max_length=%d; %d dropped with no assistant token left",
            path, truncated, max_length, dropped,
        )
    if len(ds) == 0:
        raise DataError([f"{path}: file: every row lost its assistant tokens at data.max_length={max_length}"])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".writing-", dir=target.parent)
    try:
        ds.save_to_disk(tmp)
        os.rename(tmp, target)  # atomic: a later run sees a complete cache or none
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ds


@dataclass
class SFTData:
    train: "datasets.Dataset"  # noqa: F821
    eval: "datasets.Dataset | None"  # noqa: F821
    identity: dict  # see data_identity

    @property
    def data_hash(self) -> str:
        return data_hash(self.identity)


def load_sft_datasets(
    tokenizer,
    sample_weight: Callable,
    train_file: str,
    eval_file: str | None = None,
    max_length: int = 2048,
    default_score: float | None = None,
    num_proc: int | None = None,
) -> SFTData:
    """Validated, tokenised train and eval splits with a per-token `loss_weights` column."""
    identity = data_identity(train_file, eval_file, tokenizer, max_length, default_score)
    key = data_hash(identity)

    def add_weights(batch):
        weights = []
        for labels, score in zip(batch["labels"], batch["difficulty_score"]):
            w = float(sample_weight(score))
            weights.append([w if label != IGNORE_INDEX else 0.0 for label in labels])
        return {"loss_weights": weights}

    splits = []
    for path in (train_file, eval_file):
        if path is None:
            splits.append(None)
            continue
        ds = _tokenized_split(path, tokenizer, max_length, default_score, num_proc, key)
        splits.append(ds.map(add_weights, batched=True, keep_in_memory=True).remove_columns("truncated"))
    return SFTData(train=splits[0], eval=splits[1], identity=identity)


# --- collation ----------------------------------------------------------------------------------------


class WeightedDataCollator(DataCollatorForSeq2Seq):
    """`DataCollatorForSeq2Seq` that also pads `loss_weights` (with 0) and keeps each row's `source_line`.

    The batch holds what the model's forward takes plus `labels`, `loss_weights` and `source_lines`,
    which the trainer pops before the forward.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = 8):
        super().__init__(tokenizer=tokenizer, padding=True, pad_to_multiple_of=pad_to_multiple_of,
                         label_pad_token_id=IGNORE_INDEX, return_tensors="pt")

    def __call__(self, features, return_tensors=None):
        import torch

        weights = [f["loss_weights"] for f in features]
        lines = [f["source_line"] for f in features]
        features = [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
        batch = super().__call__(features, return_tensors)
        padded = torch.zeros(batch["labels"].shape, dtype=torch.float32)
        for i, w in enumerate(weights):
            padded[i, : len(w)] = torch.as_tensor(w, dtype=torch.float32)
        batch["loss_weights"] = padded
        batch["source_lines"] = torch.as_tensor(lines, dtype=torch.long)
        return batch
