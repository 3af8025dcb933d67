"""Chat data: JSONL reading and validation, tokenisation with assistant-only labels, caching, collation.

A row is `{"messages": [{"role": ..., "content": ...}, ...], "difficulty_score": 2.5}`. The whole chat is
rendered with the tokenizer's chat template; labels are -100 except on assistant turns (their content
and end-of-turn token, in every turn). Tokenised splits are cached under the sft cache keyed by the data
hash (file bytes, preprocessing settings, tokenizer), so a second run with the same inputs skips the
work. `loss_weight` (the sample's loss weight, one number per row) is added after the cache, since it
depends on the loss config rather than on the data; the collator spreads it over the assistant tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from sft.batch import IGNORE_INDEX
from sft.cache import building, cache_dir

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
PREPROCESS_VERSION = 1  # bump when tokenisation or labelling changes, to invalidate caches
MAX_ERRORS_SHOWN = 10
PARALLEL_ROWS = 20000  # data.num_proc=null tokenises files of this many rows on every core


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


@dataclass
class Rejected:
    """A row that failed validation: where, which field, why, and the raw line."""

    file: str
    line: int
    field: str
    reason: str
    raw: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.reason}"

    @property
    def kind(self) -> str:
        """The reason without row-specific details, for counting."""
        return re.sub(r"\[\d+\]", "[]", self.field) + ": " + re.split(r" \(|, got", self.reason)[0]


def scan_jsonl(path: str | os.PathLike, default_score: float | None = None) -> tuple[list[dict], list[Rejected]]:
    """Read a chat JSONL file: the valid rows (each with `source_line`) and the rejected ones.

    A UTF-8 BOM, CRLF line ends and blank lines are accepted.
    """
    path = Path(path)
    rows, rejected = [], []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError([f"{path}: file: cannot be read ({e.strerror})"]) from e
    with f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]

            def reject(field: str, reason: str) -> None:
                rejected.append(Rejected(str(path), lineno, field, reason, raw.decode("utf-8", "replace").rstrip()))

            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                reject("row", f"not UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not text:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                reject("row", f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            problem = _check_row(row, default_score)
            if problem:
                reject(*problem)
                continue
            score = row.get("difficulty_score")
            rows.append({
                "messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]],
                "difficulty_score": float(default_score if score is None else score),
                "source_line": lineno,
            })
    if not rows and not rejected:
        raise DataError([f"{path}: file: no rows (the file is empty)"])
    return rows, rejected


def read_jsonl(path: str | os.PathLike, default_score: float | None = None) -> list[dict]:
    """Read and validate a chat JSONL file; raise `DataError` naming file, line and field of bad rows."""
    rows, rejected = scan_jsonl(path, default_score)
    if rejected:
        raise DataError([str(r) for r in rejected])
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


def fit_window(n_tokens: int, answer_start: int, max_length: int) -> tuple[int, int]:
    """The [start, end) token window kept of an over-long row by `overlong=truncate`.

    The prompt is cut from the left first, so the last assistant answer and its end token are kept
    whenever they fit in `max_length`; an answer longer than that keeps a quarter of the window for
    the prompt before it and loses its end.
    """
    if n_tokens <= max_length:
        return 0, n_tokens
    if n_tokens - answer_start <= max_length:
        return n_tokens - max_length, n_tokens
    start = max(0, answer_start - max_length // 4)
    return start, start + max_length


def tokenize_batch(batch: dict, tokenizer, max_length: int, overlong: str = "truncate") -> dict:
    """`datasets.map` function: input_ids and assistant-only labels, fitted to `max_length`.

    `overlong`: `truncate` (see `fit_window`), `drop` (over-long rows are left out) or `error` (they are
    kept whole and flagged in `overlong`, for the caller to report). Rows left with no trainable token
    are dropped.
    """
    rendered = [assistant_char_spans(tokenizer, messages) for messages in batch["messages"]]
    enc = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True, truncation=False
    )
    out = {"input_ids": [], "labels": [], "difficulty_score": [], "source_line": [], "truncated": [],
           "overlong": []}
    for k, (ids, offsets, (_, spans)) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], rendered)):
        starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        trained = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            trained |= (starts >= a) & (starts < b)
        too_long = len(ids) > max_length
        if too_long and overlong == "drop":
            continue
        if too_long and overlong == "truncate":
            answer_start = int(np.searchsorted(starts, spans[-1][0]))
            lo, hi = fit_window(len(ids), answer_start, max_length)
            ids, trained = ids[lo:hi], trained[lo:hi]
        labels = np.where(trained, np.asarray(ids), IGNORE_INDEX)
        if not (labels[1:] != IGNORE_INDEX).any():  # position 0 is never a prediction target
            continue
        out["input_ids"].append(list(ids))
        out["labels"].append(labels.tolist())
        out["difficulty_score"].append(batch["difficulty_score"][k])
        out["source_line"].append(batch["source_line"][k])
        out["truncated"].append(too_long and overlong == "truncate")
        out["overlong"].append(too_long)
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


def _tokenized_split(path: str, tokenizer, max_length: int, default_score, num_proc, key: str,
                     on_error: str, overlong: str):
    """Tokenise one file, or load it from the cache an earlier run wrote with the same key.

    Returns the dataset and the rejected rows (kept in the cache too, so every run can report them).
    """
    from datasets import Dataset, load_from_disk

    target = cache_dir() / "datasets" / f"{key}-{Path(path).stem}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    if target.exists():
        log.info("data: %s from cache %s", path, target)
        rejected = [Rejected(**r) for r in json.loads((target / "rejected.json").read_text())]
        return load_from_disk(str(target / "rows")), rejected
    rows, rejected = scan_jsonl(path, default_score)
    if rejected and on_error == "raise":
        raise DataError([str(r) for r in rejected])
    if not rows:
        raise DataError([f"{path}: file: no valid row (all {len(rejected)} rejected)"])
    if num_proc is None:  # one process per core where there is enough work to pay for starting them
        num_proc = min(os.cpu_count() or 1, 8) if len(rows) >= PARALLEL_ROWS else None
    ds = Dataset.from_list(rows).map(
        tokenize_batch,
        batched=True,
        batch_size=256,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=["messages"],
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "overlong": overlong},
        keep_in_memory=True,
        desc=f"tokenising {Path(path).name}",
    )
    flagged = column(ds, "overlong") if overlong == "error" else []
    if any(flagged):
        lines = [line for line, flag in zip(column(ds, "source_line"), flagged) if flag]
        raise DataError([f"{path}:{line}: row: longer than data.max_length={max_length} tokens "
                         "(data.overlong=truncate or drop to accept it)" for line in lines])
    dropped, truncated = len(rows) - len(ds), sum(column(ds, "truncated"))
    if dropped or truncated:
        log.warning("data: %s: %d row(s) truncated to data.max_length=%d; %d dropped (over-long with "
                    "data.overlong=drop, or no assistant token left)", path, truncated, max_length, dropped)
    if len(ds) == 0:
        raise DataError([f"{path}: file: no row left with an assistant token at data.max_length={max_length}"])
    ds = ds.remove_columns("overlong")
    with building(target) as tmp:
        ds.save_to_disk(str(tmp / "rows"))
        (tmp / "rejected.json").write_text(json.dumps([vars(r) for r in rejected]))
    return ds, rejected


def column(ds: datasets.Dataset, name: str) -> list:
    """A whole column as a list, read from Arrow in one go (with any `select`/`shuffle` applied).

    `ds[name]` in datasets 5 iterates row by row: about 2 s per column at 100k rows.
    """
    return ds.with_format("arrow").select_columns([name])[:][name].to_pylist()


def row_scores(dataset) -> dict[int, float]:
    """`difficulty_score` by `source_line`: names a row's difficulty in reports and eval buckets."""
    return dict(zip(column(dataset, "source_line"), column(dataset, "difficulty_score")))


def report_rejected(rejected: list[Rejected], rejected_file: str | None) -> None:
    """Log the count of skipped rows per reason and write them, with their reasons, to `rejected_file`."""
    if not rejected:
        return
    counts: dict[str, int] = {}
    for r in rejected:
        counts[r.kind] = counts.get(r.kind, 0) + 1
    log.warning("data: skipped %d invalid row(s) (data.on_error=skip): %s", len(rejected),
                "; ".join(f"{kind} x{n}" for kind, n in sorted(counts.items())))
    if rejected_file:
        with open(rejected_file, "w", encoding="utf-8") as f:
            for r in rejected:
                f.write(json.dumps({"file": r.file, "line": r.line, "field": r.field, "reason": r.reason,
                                    "row": r.raw}, ensure_ascii=False) + "\n")
        log.warning("data: the skipped rows and their reasons are in %s", rejected_file)


@dataclass
class SFTData:
    train: datasets.Dataset
    eval: datasets.Dataset | None
    identity: dict  # see data_identity
    packing: bool = False  # how the collator forms batches (data.packing)

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
    on_error: str = "raise",
    overlong: str = "truncate",
    rejected_file: str | None = None,
    packing: bool = False,
) -> SFTData:
    """Validated, tokenised train and eval splits with a per-row `loss_weight` column.

    `on_error`: `raise` stops at the first bad rows with `DataError`; `skip` trains on the valid rows
    and reports the others (`report_rejected`). `overlong`: see `tokenize_batch`. `packing` changes only
    how batches are formed (`WeightedDataCollator`); it is kept with the data settings it describes.
    """
    identity = data_identity(train_file, eval_file, tokenizer, max_length, default_score)
    identity["overlong"] = overlong
    key = data_hash(identity)

    splits, rejected = [], []
    for path in (train_file, eval_file):
        if path is None:
            splits.append(None)
            continue
        ds, bad = _tokenized_split(path, tokenizer, max_length, default_score, num_proc, key, on_error, overlong)
        rejected += bad
        # Fingerprinted by the weights' bytes, which datasets would otherwise do by pickling the list.
        weights = np.array([sample_weight(score) for score in column(ds, "difficulty_score")], dtype=np.float64)
        fingerprint = hashlib.sha256(ds._fingerprint.encode() + weights.tobytes()).hexdigest()[:16]
        splits.append(ds.remove_columns("truncated").add_column("loss_weight", weights.tolist(),
                                                                new_fingerprint=fingerprint))
    report_rejected(rejected, rejected_file)
    return SFTData(train=splits[0], eval=splits[1], identity=identity, packing=packing)


# --- collation ----------------------------------------------------------------------------------------


class WeightedDataCollator(DataCollatorForSeq2Seq):
    """`DataCollatorForSeq2Seq` that also builds per-token `loss_weights` and keeps each row's `source_line`.

    A row's `loss_weight` goes on its assistant tokens (labels other than -100), 0 elsewhere. With
    `packing`, the micro-batch becomes one row without padding (`DataCollatorWithFlattening`):
    `position_ids` restart at 0 for every sample, which is how the model's attention (a block-diagonal
    mask for sdpa and eager) and the loss tell the samples apart, and the samples' boundaries
    (`cu_seq_lens_q/k`, `max_length_q/k`) go to the attention for flash attention's varlen kernels and
    `sdpa_varlen` (`sft.attention`); there is no `attention_mask`.

    The batch holds what the model's forward takes plus `labels`, `loss_weights` and `source_lines`,
    which the trainer pops before the forward.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None, packing: bool = False):
        super().__init__(tokenizer=tokenizer, padding=True, pad_to_multiple_of=pad_to_multiple_of,
                         label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
        self.packing = packing
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True) if packing else None

    def __call__(self, features, return_tensors=None):
        lines = torch.as_tensor([f["source_line"] for f in features], dtype=torch.long)
        weights = torch.as_tensor([f["loss_weight"] for f in features], dtype=torch.float32)
        features = [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
        if self.packing:
            batch = self.flatten(features)
            lengths = torch.as_tensor([len(f["input_ids"]) for f in features])
            row_weights = weights.repeat_interleave(lengths)[None, :]
        else:
            batch = super().__call__(features, return_tensors)
            row_weights = weights[:, None]
        batch["loss_weights"] = torch.where(batch["labels"] != IGNORE_INDEX, row_weights, 0.0)
        batch["source_lines"] = lines
        return batch
