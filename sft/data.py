"""Chat data: JSONL reading and validation, tokenisation with assistant-only labels, caching, collation.

A row is `{"messages": [{"role": ..., "content": ...}, ...], "difficulty_score": 2.5}`. The whole chat is
rendered with the tokenizer's chat template; labels are -100 except on assistant turns (their content
and end-of-turn token, in every turn), each located as the model writes it (`chat_views`: a turn the
template rewrites once later turns follow is trained from its own rendering). Tokenised splits are
cached under the sft cache keyed by the data hash (file bytes, preprocessing settings, tokenizer), so a
second run with the same inputs skips the work; preprocessing streams rows through Arrow files on every
core, never holding a source in memory (`_tokenized_split`). A mixture's sources (`sft.mixture`) are each
tokenised so and then drawn into one split. The loss's static weights (`sft.losses.WeightedTokenLoss`)
are added as columns: per-token `token_weights`, which need the rendered text, while tokenising (their
knobs are part of the cache key), and the per-row `loss_weight` after the cache; the collator puts
their product on the assistant tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from sft.batch import IGNORE_INDEX
from sft.cache import building, cache_dir
from sft.chat_template import ChatRenderer, Refused, chat_settings, chat_views
from sft.formats import FormatError, RowFormat
from sft.mixture import Part, draw_counts, drawn_sequences, log_mixture, parts_of
from sft.sources import Source, SourceError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
PREPROCESS_VERSION = 4  # bump when tokenisation or labelling changes, to invalidate caches
MAX_ERRORS_SHOWN = 10
PARALLEL_ROWS = 20000  # data.num_proc=null tokenises files of this many rows on every core
PARALLEL_BYTES = 8 << 20  # and validates JSONL files this large (other sources: of PARALLEL_ROWS) on every core


class DataError(ValueError):
    """Bad rows in a data file; the message lists `file:line: field: reason` for the first ones. Rows with the
    same problem (`Rejected.kind`) in one file are one line, with how many and which:

        train.jsonl:1: difficulty_score: missing (used by loss.alpha=1: ...), and in 998 more rows (lines 2, 3, ...)
    """

    def __init__(self, problems: list, total: int | None = None, header: str | None = None):
        total = len(problems) if total is None else total
        lines = _summarised(problems)
        shown = "\n".join(f"  {p}" for p in lines[:MAX_ERRORS_SHOWN])
        more = (f"\n  ... and {len(lines) - MAX_ERRORS_SHOWN} more problems" if len(lines) > MAX_ERRORS_SHOWN else "")
        super().__init__(f"{header or f'{total} bad row(s) in the data'}:\n{shown}{more}")
        self.problems, self.total = [str(p) for p in problems], total


def _summarised(problems: list) -> list[str]:
    """The problems as lines, those of `Rejected` rows grouped by file and kind (in the order they come)."""
    groups: dict = {}
    for p in problems:
        key = (p.file, p.kind) if isinstance(p, Rejected) else (id(p), None)
        groups.setdefault(key, []).append(p)
    lines = []
    for group in groups.values():
        first = group[0]
        if len(group) == 1:
            lines.append(str(first))
            continue
        numbers = [r.line for r in group[1:]]
        listed = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
        lines.append(f"{first}; the same in {len(numbers)} more row(s) (lines {listed})")
    return lines


# --- reading and validation ---------------------------------------------------------------------------


def _check_row(row, default_score: float | None, score_required: bool = True) -> tuple[str, str] | None:
    """Return (field, reason) for the first problem of a parsed row, or None when it is valid. A missing
    `difficulty_score` is one only if `score_required` and there is no `default_score`."""
    if not isinstance(row, dict):
        return "row", f"must be a JSON object, got {type(row).__name__}"
    messages = row.get("messages")
    if messages is None:
        return "messages", "missing"
    if not isinstance(messages, list) or not messages:
        return "messages", "must be a non-empty list of {role, content} objects"
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "tools", "must be a list of tool definitions (JSON objects), as the chat template takes them"
    pending = None  # the ids and function names of the tool calls whose results may follow
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            return where, "must be an object with role and content"
        if "role" not in m:
            return f"{where}.role", (f"missing (the turn has {', '.join(sorted(map(str, m))) or 'no keys'}; a turn is "
                                     "{role, content}, or ShareGPT's {from, value})")
        if m["role"] not in ROLES:
            return f"{where}.role", f"unknown role {m['role']!r} (expected one of {', '.join(ROLES)})"
        calls_only = bool(m.get("tool_calls")) and m.get("content") is None  # OpenAI's form of a call-only turn
        if "content" not in m and not calls_only:
            return f"{where}.content", "missing"
        if not calls_only and not isinstance(m["content"], str):
            return f"{where}.content", f"must be a string, got {type(m['content']).__name__}"
        for key in ("content", "reasoning_content"):
            surrogate = _lone_surrogate(m.get(key))
            if surrogate is not None:
                return f"{where}.{key}", f"not valid Unicode (a lone surrogate at character {surrogate})"
        if m.get("tool_calls") is not None:
            problem = _check_tool_calls(m, where)
            if problem:
                return problem
            pending = {c.get("id") for c in m["tool_calls"]}, {c["function"]["name"] for c in m["tool_calls"]}
        if m["role"] == "tool":
            problem = _check_tool_result(m, where, pending)
            if problem:
                return problem
        elif m["role"] != "assistant" or not m.get("tool_calls"):
            pending = None  # a call's results follow it directly
        if m["role"] == "assistant" and not (m.get("content") or "").strip() and not m.get("tool_calls"):
            return f"{where}.content", "empty assistant content"
        reasoning = m.get("reasoning_content")
        if reasoning is not None and (m["role"] != "assistant" or not isinstance(reasoning, str)):
            return f"{where}.reasoning_content", "only an assistant turn has reasoning, as a string"
        if "weight" in m and not _finite_number(m["weight"], nonnegative=True):
            return f"{where}.weight", f"must be a finite number >= 0, got {m['weight']!r}"
        if "train" in m and not isinstance(m["train"], bool):
            return f"{where}.train", f"must be true or false, got {m['train']!r}"
    if messages[0]["role"] == "assistant":
        return "messages[0].role", "a chat must start with a system or user turn"
    if not any(m["role"] == "assistant" for m in messages):
        return "messages", "no assistant turn (nothing to train on)"
    if not any(turn_weight(m) > 0 for m in messages if m["role"] == "assistant"):
        return "messages", "every assistant turn has weight 0 or train false (nothing to train on)"
    score = row.get("difficulty_score")
    if score is None:
        if default_score is None and score_required:
            return "difficulty_score", "missing (set data.default_score to use a default)"
    elif isinstance(score, int) and not isinstance(score, bool) and abs(score) > 2 ** 1023:
        return "difficulty_score", (f"must be a finite number >= 0, got an integer too large for a float "
                                    f"({len(str(abs(score)))} digits)")
    elif not _finite_number(score, nonnegative=True):
        return "difficulty_score", f"must be a finite number >= 0, got {score!r}"
    return None


def _check_tool_calls(message: dict, where: str) -> tuple[str, str] | None:
    """An assistant turn's `tool_calls`: OpenAI's form, [{"id"?, "type": "function", "function": {"name",
    "arguments": an object or its JSON}}]."""
    calls = message["tool_calls"]
    if message["role"] != "assistant":
        return f"{where}.tool_calls", "only an assistant turn calls tools"
    if not isinstance(calls, list) or not calls:
        return f"{where}.tool_calls", "must be a non-empty list of {type, function: {name, arguments}} objects"
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return f"{at}.function", "missing (a call is {type: function, function: {name, arguments}})"
        if not isinstance(function.get("name"), str) or not function["name"]:
            return f"{at}.function.name", "must be a non-empty string"
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                return f"{at}.function.arguments", f"not JSON ({e.msg} at column {e.colno})"
        if not isinstance(arguments, dict):
            return f"{at}.function.arguments", "must be a JSON object (or its text)"
        if call.get("type", "function") != "function":
            return f"{at}.type", f"must be function, got {call['type']!r}"
    return None


def _check_tool_result(message: dict, where: str, pending) -> tuple[str, str] | None:
    """A `tool` turn: the result of a call of the assistant turn before it (by `tool_call_id` or `name`)."""
    if pending is None:
        return f"{where}.role", "a tool result without a tool call before it (an assistant turn with tool_calls)"
    ids, names = pending
    call_id, name = message.get("tool_call_id"), message.get("name")
    if call_id is not None and ids - {None} and call_id not in ids:
        return f"{where}.tool_call_id", f"{call_id!r} names no call of the assistant turn before it"
    if name is not None and name not in names:
        return f"{where}.name", f"{name!r} is no function called by the assistant turn before it"
    return None


def turn_weight(message: dict) -> float:
    """A message's own weight: its `weight` (default 1), 0 with `train: false`."""
    return 0.0 if message.get("train") is False else float(message.get("weight", 1.0))


def turn_weights(messages: list[dict], train_on: str = "all") -> list[float]:
    """Each message's weight in training: assistant turns their `turn_weight` (`train_on=last`: the last
    assistant turn only), every other turn 0 (context, never trained: system, user, tool results).

        [user, assistant weight 2, user, assistant], train_on=all  ->  [0, 2, 0, 1]
        the same, train_on=last  ->  [0, 0, 0, 1]
    """
    weights = [turn_weight(m) if m["role"] == "assistant" else 0.0 for m in messages]
    if train_on == "last":
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        weights = [w if i == last else 0.0 for i, w in enumerate(weights)]
    return weights


def _lone_surrogate(text) -> int | None:
    """The position of the first lone surrogate (a JSON escape like \\ud800 that no UTF-8 can encode) in
    `text`, or None."""
    if not isinstance(text, str) or text.isascii():
        return None
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


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


def scan_jsonl(path: str | os.PathLike, default_score: float | None = None, score_required: bool = True,
               row_format: RowFormat | None = None, train_on: str = "all") -> tuple[list[dict], list[Rejected]]:
    """Read a chat JSONL file: the valid rows (each with `source_line`, and its other fields as a JSON
    object in `extra`, for the loss's hooks) and the rejected ones. Without `score_required`, a row with no
    `difficulty_score` (and no `default_score`) gets NaN: no score. `row_format` turns each row into
    messages first (`sft.formats`; default: auto-detected); each message gets its `weight` in training
    (`turn_weights`, by `train_on`).

    A UTF-8 BOM, CRLF line ends and blank lines are accepted. `iter_jsonl` reads it row by row.
    """
    rejected: list[Rejected] = []
    rows = list(iter_jsonl(path, rejected, default_score, score_required, row_format, train_on))
    return rows, rejected


def iter_jsonl(path: str | os.PathLike, rejected: list[Rejected], default_score: float | None = None,
               score_required: bool = True, row_format: RowFormat | None = None, train_on: str = "all",
               span: tuple[int, int, int] | None = None):
    """`scan_jsonl`'s valid rows one at a time, the rejected ones appended to `rejected`: a file of any size
    is read in the memory of one line. `span` (start byte, end byte, number of the line at start): only the
    lines of that stretch (`write_rows_in_parallel`'s)."""
    path = Path(path)
    row_format = row_format or RowFormat()
    found = False
    start, end, first_line = span or (0, None, 1)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError([f"{path}: file: cannot be read ({e.strerror})"]) from e
    with f:
        f.seek(start)
        position = start
        for lineno, raw in enumerate(f, start=first_line):
            if end is not None and position >= end:
                break
            position += len(raw)
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
            found = True
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as e:
                reject("row", f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            except RecursionError:
                reject("row", "nested too deeply to be a chat (JSON arrays or objects inside each other)")
                continue
            accepted = _accept(parsed, lineno, reject, default_score, score_required, row_format, train_on)
            if accepted is not None:
                yield accepted
    if span is None:
        if not found and not rejected:
            raise DataError([f"{path}: file: no rows (the file is empty)"])
        _log_format(path, row_format)


def scan_table(source: Source, default_score: float | None = None, score_required: bool = True,
               row_format: RowFormat | None = None, train_on: str = "all") -> tuple[list[dict], list[Rejected]]:
    """`scan_jsonl` for a source `datasets` reads (Parquet, CSV, JSON, Arrow, a save_to_disk folder, the hub):
    rows are named by their number from 1. A column a row lacks (Arrow gives it as null) counts as absent."""
    rejected: list[Rejected] = []
    rows = list(iter_table(source, rejected, default_score, score_required, row_format, train_on))
    return rows, rejected


def iter_table(source: Source, rejected: list[Rejected], default_score: float | None = None,
               score_required: bool = True, row_format: RowFormat | None = None, train_on: str = "all",
               span: tuple[int, int, int] | None = None):
    """`scan_table`'s valid rows one at a time (the table is memory-mapped), the rejected ones appended to
    `rejected`. `span` (first row index, end index, the first row's number): only those rows."""
    row_format = row_format or RowFormat()
    table = _table(source)
    start, end, first = span or (0, len(table), 1)
    rows = table if span is None else table.select(range(start, end))
    for number, row in enumerate(rows, start=first):
        def reject(field: str, reason: str) -> None:
            rejected.append(Rejected(str(source), number, field, reason, json.dumps(row, ensure_ascii=False,
                                                                                     default=str)))

        accepted = _accept(_without_nulls(row), number, reject, default_score, score_required, row_format, train_on)
        if accepted is not None:
            yield accepted
    if span is None:
        if not len(table):
            raise DataError([f"{source}: source: no rows"])
        _log_format(str(source), row_format)


def _without_nulls(value):
    """A table row without its null values, at any depth (Arrow fills a struct's missing keys with null)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _accept(parsed, number: int, reject: Callable, default_score, score_required: bool, row_format: RowFormat,
            train_on: str) -> dict | None:
    """One parsed row as a row of the split (or None, rejected through `reject(field, reason)`)."""
    try:
        row = row_format(parsed)
    except FormatError as e:
        reject(e.field, e.reason)
        return None
    problem = _check_row(row, default_score, score_required)
    if problem:
        reject(*problem)
        return None
    score = row.get("difficulty_score")
    extra = {k: v for k, v in row.items() if k not in ("messages", "difficulty_score", "tools")}
    weights = turn_weights(row["messages"], train_on)
    return {
        # tool calls and definitions as JSON text: Arrow would unify their argument objects' keys over all rows
        "messages": [{"role": m["role"], "content": m.get("content"), "reasoning_content": m.get("reasoning_content"),
                      "tool_calls": None if m.get("tool_calls") is None else json.dumps(_stored_calls(m["tool_calls"])),
                      "tool_call_id": m.get("tool_call_id"), "name": m.get("name"), "weight": w}
                     for m, w in zip(row["messages"], weights)],
        "tools": "" if row.get("tools") is None else json.dumps(row["tools"]),
        "difficulty_score": float(math.nan if score is None and default_score is None
                                  else default_score if score is None else score),
        "source_line": number,
        "extra": json.dumps(extra, default=str) if extra else "",  # ASCII: a lone surrogate stays an escape
    }


def _stored_calls(calls: list[dict]) -> list[dict]:
    """Tool calls as chat templates take them: `type` function, the `arguments` in the row's own form (an object or
    its JSON text; `ChatRenderer.prepare` gives a template the other where it needs it)."""
    return [{**call, "type": "function"} for call in calls]


def _log_format(name: str, row_format: RowFormat) -> None:
    if row_format.fmt == "auto" and row_format.chosen not in (None, "messages"):
        log.info("data: %s: format %s (data.format=auto, from the columns of its first row)", name, row_format.chosen)


def scan_source(source: Source, *args, **kwargs) -> tuple[list[dict], list[Rejected]]:
    """The valid and rejected rows of a source: `scan_jsonl` for a JSONL file, else `scan_table`."""
    return scan_jsonl(source.spec, *args, **kwargs) if source.kind == "jsonl" else scan_table(source, *args, **kwargs)


def iter_source(source: Source, rejected: list[Rejected], *args, **kwargs):
    """`scan_source` row by row: `iter_jsonl` or `iter_table` (with their `span`, a stretch of rows)."""
    if source.kind == "jsonl":
        return iter_jsonl(source.spec, rejected, *args, **kwargs)
    return iter_table(source, rejected, *args, **kwargs)


def raw_rows(source: Source, numbers: set[int]) -> dict[int, str]:
    """Rows of a source by line (JSONL) or number, as `Rejected.raw` holds them."""
    return _raw_lines(source.spec, numbers) if source.kind == "jsonl" else source.raw(numbers)


def _raw_lines(path: str, lines: set[int]) -> dict[int, str]:
    """The text of the given (1-based) lines of a file, as `Rejected.raw` holds it."""
    with open(path, "rb") as f:
        return {n: raw.decode("utf-8", "replace").lstrip("\ufeff").rstrip() for n, raw in enumerate(f, start=1)
                if n in lines}


def read_jsonl(path: str | os.PathLike, default_score: float | None = None, fmt: str = "auto",
               columns: dict | None = None, split: str | None = None, hub_name: str | None = None,
               hub_revision: str | None = None) -> list[dict]:
    """Read and validate a chat source (a JSONL file, or any `sft.sources.Source`, of any row format); raise
    `DataError` naming source, line (row) and field of bad rows."""
    try:
        source = Source(str(path), split, hub_name, hub_revision)
    except SourceError as e:
        raise DataError([str(e)], header="the data cannot be read") from None
    rows, rejected = scan_source(source, default_score, row_format=RowFormat(fmt, columns))
    if rejected:
        raise DataError(rejected)
    return rows


# --- tokenisation -------------------------------------------------------------------------------------


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


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (its string's length: bytes for byte-level
    BPE, which is at least the characters)."""
    return max(16, max(map(len, tokenizer.get_vocab())))


def token_reach(tokenizer, max_length: int) -> int:
    """How many characters `max_length` tokens (and one cut token on either side) can cover, at most."""
    return (max_length + 2) * _longest_token_chars(tokenizer) + 64


def tokenized_part(n_chars: int, answer_start: int, reach: int) -> tuple[int, int]:
    """The [lo, hi) characters of a text to tokenise: all of it, unless it is longer than twice `reach`
    (`token_reach`: then it is certainly over-long), when `reach` either side of the last trained answer's
    start. `fit_window` keeps tokens within that: the last `max_length` of a tail that fits, else a quarter
    window before the answer and the rest after it. So a 50 MB row costs the memory of a few `max_length`
    windows, not of 50 MB of tokens, and keeps the same tokens as tokenising it whole (but for a text that
    is one giant word, where the tokeniser's merges around the cut may differ).

        n_chars=10_000_000, answer_start=9_000_000, reach=300_000 -> (8_700_000, 9_300_000)
    """
    if n_chars <= 2 * reach:
        return 0, n_chars
    return max(0, answer_start - reach), min(n_chars, answer_start + reach)


def row_fields(score: float, extra: str) -> dict:
    """A row's columns as the loss's hooks see them: `difficulty_score` and its other fields (`extra`)."""
    return {**(json.loads(extra) if extra else {}), "difficulty_score": score}


def tokenize_batch(batch: dict, tokenizer, max_length: int, overlong: str = "truncate",
                   rewritten_turns: str = "split", token_weights: Callable | None = None,
                   turn_weighted: bool = False, prefill: str = "refuse") -> pa.Table:
    """`datasets.map` function: input_ids and assistant-only labels of each text a chat trains as
    (`chat_views`; `view` 0 is the whole chat, 1... turns a template rewrites later), fitted to `max_length`,
    as an Arrow table (`SEQUENCE_COLUMNS`).

    `overlong`: `truncate` (see `fit_window`), `drop` (over-long rows are left out) or `error` (they are
    kept whole and flagged in `overlong`, for the caller to report). Rows left with no trainable token
    are dropped. A chat the template cannot label (`Refused`) becomes one empty row whose `refused` says
    why, for the caller to report with its line. `token_weights` (a loss's static per-token weights,
    `WeightedTokenLoss.token_weights`) adds a `token_weights` column; weights that are not finite numbers
    >= 0, one per token, refuse the row. `turn_weighted` (some message has a weight other than 1) puts
    each turn's weight on its tokens, in `token_weights` too (times the loss's, where it has them).
    `rewritten_turns` and `prefill`: see `chat_views`. A row's first sequence counts in `untrained_reasoning` the
    trained turns whose reasoning the template does not render.

    A token is trained when its first character lies in a trained span. Where a span begins and ends is
    found by bisecting the tokens' start offsets in the tokenizer's own encoding (`TokenStarts`): every
    token's offsets become Python numbers only where the loss's token weights read them.
    """
    columns = SequenceColumns(batch, weighted=token_weights is not None or turn_weighted)
    texts, pieces, where = [], [], []  # every text of the batch, the part of it tokenised, its row and spans
    reach = token_reach(tokenizer, max_length)
    render = ChatRenderer(tokenizer)
    render.profile  # the template's probes, once a batch (not inside a row's labelling)
    all_tools = batch.get("tools") or [""] * len(batch["messages"])
    for k, messages in enumerate(batch["messages"]):
        if isinstance(messages, str):  # as `write_rows` stores them
            messages = json.loads(messages)
        try:
            views = chat_views(tokenizer, messages, rewritten_turns, json.loads(all_tools[k]) if all_tools[k] else None,
                               render, prefill)
        except Refused as e:
            columns.emit(k, NO_TOKENS, NO_TOKENS, 0, refused=f"{e.field}\t{e.reason}")
            continue
        columns.untrained_reasoning[k] = views.untrained_reasoning
        for view, (text, spans) in enumerate(views):
            lo, hi = tokenized_part(len(text), spans[-1][0], reach)
            texts.append(text)
            pieces.append(text[lo:hi] if (lo, hi) != (0, len(text)) else text)
            where.append((k, view, spans, lo))
    encodings = encode(tokenizer, pieces) if pieces else []
    refused_rows = set()
    for n, (k, view, spans, lo) in enumerate(where):
        if k in refused_rows:
            continue
        encoding = encodings[n]
        ids = np.asarray(encoding.ids, dtype=np.int32)
        first = TokenStarts(encoding, lo)
        trained = np.zeros(len(ids), dtype=bool)
        turn = np.ones(len(ids), dtype=np.float32) if turn_weighted else None
        for a, b, w in spans:
            start, end = first(a), first(b)
            trained[start:end] = True
            if turn is not None:
                turn[start:end] = w
        weights = turn
        if token_weights is not None:
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + lo  # into the whole text
            weights = token_weights(texts[n], offsets, row_fields(batch["difficulty_score"][k], columns.extras[k]))
            weights = np.ones(len(ids), dtype=np.float32) if weights is None else weights
            problem = _bad_token_weights(weights, len(ids))
            if problem:
                refused_rows.add(k)
                columns.emit(k, NO_TOKENS, NO_TOKENS, 0, refused=f"loss.token_weights\t{problem}")
                continue
            weights = np.asarray(weights, dtype=np.float32) * (1.0 if turn is None else turn)
        too_long = len(ids) > max_length
        if too_long and overlong == "drop":
            continue
        if too_long and overlong == "truncate":
            start, end = fit_window(len(ids), first(spans[-1][0]), max_length)
            ids, trained = ids[start:end], trained[start:end]
            weights = None if weights is None else weights[start:end]
        labels = np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
        if not trained[1:].any():  # position 0 is never a prediction target
            continue
        columns.emit(k, ids, labels, view, too_long and overlong == "truncate", too_long, weights=weights,
                     trained=trained)
    return columns.table()


NO_TOKENS = np.zeros(0, dtype=np.int32)
# The columns of a tokenised split, as `tokenize_batch` returns them (`token_weights` and `reweighted_tokens`
# only where weighted). `trained_tokens`: labelled tokens after the first position (`assistant_tokens`);
# `reweighted_tokens`: those of them whose token weight is not 1. Counted here, so that no later step reads
# every token again (a million rows' tokens are gigabytes).
SEQUENCE_COLUMNS = {"input_ids": pa.list_(pa.int32()), "labels": pa.list_(pa.int32()),
                    "difficulty_score": pa.float64(), "source_line": pa.int64(), "extra": pa.string(),
                    "view": pa.int64(), "truncated": pa.bool_(), "overlong": pa.bool_(), "refused": pa.string(),
                    "trained_tokens": pa.int32(), "token_weights": pa.list_(pa.float32()),
                    "reweighted_tokens": pa.int32(), "untrained_reasoning": pa.int32()}
WEIGHTED_ONLY = ("token_weights", "reweighted_tokens")


class SequenceColumns:
    """The sequences of one `tokenize_batch` call, gathered as numpy arrays and handed over as one Arrow table:
    no Python list of tokens is made, and `datasets` writes the table as it is."""

    def __init__(self, batch: dict, weighted: bool):
        self.batch, self.weighted = batch, weighted
        self.extras = batch.get("extra") or [""] * len(batch["messages"])
        self.names = [name for name in SEQUENCE_COLUMNS if weighted or name not in WEIGHTED_ONLY]
        self.values: dict[str, list] = {name: [] for name in self.names}
        self.untrained_reasoning: dict[int, int] = {}  # by row, until its first sequence carries it

    def emit(self, k: int, ids: np.ndarray, labels: np.ndarray, view: int, truncated: bool = False,
             too_long: bool = False, refused: str = "", weights: np.ndarray | None = None,
             trained: np.ndarray = NO_TOKENS) -> None:
        """One sequence of the batch's row `k` (`trained`: which of its tokens have a label)."""
        row = {"input_ids": ids, "labels": labels, "difficulty_score": self.batch["difficulty_score"][k],
               "source_line": self.batch["source_line"][k], "extra": self.extras[k], "view": view,
               "truncated": truncated, "overlong": too_long, "refused": refused,
               "trained_tokens": int(np.count_nonzero(trained[1:])),
               "untrained_reasoning": self.untrained_reasoning.pop(k, 0)}
        if self.weighted:
            row["token_weights"] = np.ones(len(ids), dtype=np.float32) if weights is None else weights
            row["reweighted_tokens"] = 0 if weights is None else int(np.count_nonzero(trained[1:] & (weights[1:] != 1)))
        for name in self.names:
            self.values[name].append(row[name])

    def table(self) -> pa.Table:
        arrays = []
        for name in self.names:
            kind, values = SEQUENCE_COLUMNS[name], self.values[name]
            if pa.types.is_list(kind):  # one flat array and the offsets where each sequence starts
                dtype = kind.value_type.to_pandas_dtype()
                offsets = np.zeros(len(values) + 1, dtype=np.int32)
                np.cumsum([len(v) for v in values], out=offsets[1:])
                flat = np.concatenate(values).astype(dtype, copy=False) if values else np.zeros(0, dtype=dtype)
                arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=kind.value_type)))
            else:
                arrays.append(pa.array(values, type=kind))
        return pa.Table.from_arrays(arrays, names=self.names)


def encode(tokenizer, texts: list[str]) -> list:
    """The fast tokenizer's `Encoding` of each text, as `tokenizer(texts, add_special_tokens=False)` makes it (no
    truncation, no padding), without converting every token's ids and offsets to Python lists."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:  # what the tokenizer's own call with truncation=False does too
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    return backend.encode_batch(texts, add_special_tokens=False)


class TokenStarts:
    """`first(c)`: the first token of an encoding whose start offset is at or after character `c` of the whole
    text (the encoding is of the text from character `lo` on), by bisection: offsets only rise along a text.

        tokens "ab", "c", "de" of "abcde":  first(0) -> 0, first(1) -> 1, first(2) -> 1, first(5) -> 3
    """

    def __init__(self, encoding, lo: int = 0):
        self.encoding, self.lo, self.n = encoding, lo, len(encoding.ids)

    def __call__(self, c: int) -> int:
        c -= self.lo
        low, high = 0, self.n
        while low < high:
            mid = (low + high) // 2
            if self.encoding.token_to_chars(mid)[0] < c:
                low = mid + 1
            else:
                high = mid
        return low


def _bad_token_weights(weights, n_tokens: int) -> str | None:
    """Why a loss's token weights for a sequence of `n_tokens` cannot be used, or None."""
    weights = np.asarray(weights)
    if weights.shape != (n_tokens,):
        return f"the loss returned {weights.shape} weights for {n_tokens} tokens"
    if np.issubdtype(weights.dtype, np.number) and np.isfinite(weights).all() and (weights >= 0).all():
        return None
    bad = next((i for i, w in enumerate(weights.tolist()) if not _finite_number(w, nonnegative=True)), None)
    if bad is None:  # an object array of usable numbers
        return None
    return f"the loss returned {weights.tolist()[bad]!r} for token {bad}: weights must be finite numbers >= 0"


def log_template_profile(tokenizer, prefill: str = "refuse") -> None:
    """What the chat template does around an answer, where a user should know it (`TemplateProfile.notes`). A
    template that does not compile is one config error, not a refusal of every row."""
    from jinja2 import TemplateSyntaxError

    from sft.config import ConfigError

    render = ChatRenderer(tokenizer)
    try:
        render.compile()
    except TemplateSyntaxError as e:
        raise ConfigError("tokenizer.chat_template", None, f"{chat_settings(tokenizer).template_name} does not "
                          f"compile: {e.message} (line {e.lineno})") from None
    profile = render.profile
    own = ", and the template's own end of turn" if profile.end_of_turn else ""
    log.info("data: answers end at %s (%s%s)", ", ".join(map(repr, profile.stops)) or "no token",
             chat_settings(tokenizer).stops_from, own)
    if profile.prefill:
        log.info("data: the chat template's generation prompt prefills %r (data.prefill=%s for answers that do not "
                 "begin with it)", profile.prefill, prefill)
    for note in profile.notes:
        log.warning("data: %s", note)


def reasoning_hint(tokenizer) -> str:
    """What may make a template render reasoning it drops."""
    given = ", ".join(f"{k}={v!r}" for k, v in chat_settings(tokenizer).kwargs.items())
    return ("a template kwarg may turn thinking on: tokenizer.chat_template_kwargs, e.g. enable_thinking or thinking"
            + (f"; given: {given}" if given else "") + "; or the template renders no reasoning for such turns")


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


def preprocessing_identity(tokenizer, max_length: int, default_score: float | None) -> dict:
    """What decides how any source is preprocessed: the part of `SFTData.identity` beside the sources' contents."""
    return {"max_length": max_length, "default_score": default_score,
            "tokenizer": tokenizer_fingerprint(tokenizer)[:16], "preprocess_version": PREPROCESS_VERSION,
            **chat_settings(tokenizer).identity()}


def data_hash(identity: dict) -> str:
    """One short hash of a data identity (`SFTData.identity`)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class SplitSummary:
    """What preprocessing made of one file: counts of rows and of the sequences trained."""

    rows: int = 0  # valid rows read
    rejected: int = 0  # rows refused by validation or by the chat template (reported with their lines)
    dropped: int = 0  # valid rows left out: over-long with data.overlong=drop, or no assistant token left
    truncated: int = 0  # sequences cut to data.max_length
    own_turn_texts: int = 0  # turns a template rewrites later, trained in a text of their own (split)
    sequences: int = 0  # rows of the tokenised split
    tokens: int = 0  # tokens of all sequences
    trained_tokens: int = 0  # tokens with a label (after a sequence's first, which is never a target)
    reweighted_tokens: int = 0  # trained tokens whose static token weight (the loss's token_weights) is not 1
    untrained_reasoning: int = 0  # trained turns with reasoning that the chat template does not render

    def __add__(self, other: SplitSummary) -> SplitSummary:
        """Two sources' counts together (a mixture's, before its draw)."""
        return SplitSummary(**{k: v + getattr(other, k) for k, v in vars(self).items()})


def _tokenized_split(source: Source, tokenizer, max_length: int, default_score, num_proc, key: str,
                     on_error: str, overlong: str, rewritten_turns: str, token_weights: Callable | None = None,
                     row_format: RowFormat | None = None, train_on: str = "all", prefill: str = "refuse",
                     scores_needed_by: list[str] | None = None):
    """Tokenise one file, or load it from the cache an earlier run wrote with the same key.

    Returns the dataset, the rejected rows and the `SplitSummary` (all three kept in the cache, so every
    run can report them). The rows are streamed to an Arrow file, tokenised from it on every core (files of
    `PARALLEL_ROWS` rows and more, `data.num_proc`), and the tokenised files become the cache as they are
    (`rows.json` lists them): this process reads the tokens of no row, so a million rows preprocess in the
    memory of a few columns of numbers. A JSONL file of `PARALLEL_BYTES` and more is validated on every core
    too (`write_rows_in_parallel`).
    """
    from datasets import Dataset, concatenate_datasets

    path = str(source)
    stem = re.sub(r"[^\w.-]", "_", Path(path).stem)  # (a glob's or a hub id's too)
    target = cache_dir() / "datasets" / f"{key}-{stem}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    if target.exists():
        log.info("data: %s from cache %s", path, target)
        rejected = [Rejected(**r) for r in json.loads((target / "rejected.json").read_text())]
        summary = SplitSummary(**json.loads((target / "summary.json").read_text()))
        if rejected and on_error == "raise":  # cached by a run with data.on_error=skip
            raise DataError(rejected)
        return _load_rows(target), rejected, summary
    with building(target) as tmp:
        work = tmp / "work"  # the validated rows and the tokenised ones before they are checked: not kept
        # Rows without a score are kept (NaN), for every run to share the cache: `_require_scores` refuses them
        # where the run uses scores.
        rejected: list[Rejected] = []
        row_format = row_format or RowFormat()
        scanners = num_proc or min(os.cpu_count() or 1, 8)
        large = (os.path.getsize(source.spec) >= PARALLEL_BYTES if source.kind == "jsonl"
                 else len(_table(source)) >= PARALLEL_ROWS)
        unscored: list[int] = []
        if scanners > 1 and large:
            files, n_rows, turn_weighted = write_rows_in_parallel(source, rejected, work, scanners, default_score,
                                                                  False, row_format, train_on, unscored)
        else:
            files = [work / "rows.arrow"]
            n_rows, turn_weighted = write_rows(iter_source(source, rejected, default_score, score_required=False,
                                                           row_format=row_format, train_on=train_on), files[0],
                                               unscored)
        if rejected and on_error == "raise":
            raise DataError(rejected)
        if not n_rows:
            raise DataError(rejected, header=f"{path}: no valid row: all {len(rejected)} rejected")
        if scores_needed_by and unscored and (on_error == "raise" or len(unscored) == n_rows):
            # refused whatever the tokens: said before tokenising them
            reason = missing_score_reason(scores_needed_by)
            raise DataError([Rejected(path, line, "difficulty_score", reason, "") for line in unscored],
                            header=None if on_error == "raise" else f"no row of {path} has a difficulty_score")
        if num_proc is None:  # one process per core where there is enough work to pay for starting them
            num_proc = min(os.cpu_count() or 1, 8) if n_rows >= PARALLEL_ROWS else None
        ds = concatenate_datasets([Dataset.from_file(str(f)) for f in files]).map(
            tokenize_batch,
            batched=True,
            batch_size=256,
            num_proc=num_proc if num_proc and num_proc > 1 else None,
            remove_columns=["messages", "tools"],
            fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "overlong": overlong,
                       "rewritten_turns": rewritten_turns, "token_weights": token_weights,
                       "turn_weighted": turn_weighted, "prefill": prefill},
            cache_file_name=str(work / "tokenised.arrow"),
            desc=f"tokenising {Path(path).name}",
        )
        keep, summary = _checked(ds, source, n_rows, rejected, on_error, overlong, max_length, token_weights)
        _store_rows(ds, keep, tmp)
        (tmp / "rejected.json").write_text(json.dumps([vars(r) for r in rejected]))
        (tmp / "summary.json").write_text(json.dumps(vars(summary)))
        del ds
        shutil.rmtree(work)
    return _load_rows(target), rejected, summary


# columns of the cached files no run reads
CHECK_ONLY = ("overlong", "refused", "reweighted_tokens", "untrained_reasoning")


def _store_rows(ds: datasets.Dataset, keep: list[int] | None, folder: Path) -> None:
    """The tokenised split's Arrow files (`datasets.map`'s, one per process) moved into `folder/rows`, with
    `rows.json` naming them in order and, where rows were left out, `keep.npy` the sequences kept."""
    (folder / "rows").mkdir()
    names = []
    for i, cached in enumerate(ds.cache_files):
        names.append(f"part-{i:05d}.arrow")
        os.replace(cached["filename"], folder / "rows" / names[-1])
    if keep is not None:
        np.save(folder / "keep.npy", np.asarray(keep, dtype=np.int64))
    (folder / "rows.json").write_text(json.dumps({"files": names, "keep": keep is not None}))


def _load_rows(folder: Path) -> datasets.Dataset:
    """A cached tokenised split (`_store_rows`'s files, memory-mapped; an older cache's `save_to_disk` folder)."""
    from datasets import Dataset, concatenate_datasets, load_from_disk

    if not (folder / "rows.json").exists():
        return load_from_disk(str(folder / "rows"))
    manifest = json.loads((folder / "rows.json").read_text())
    ds = concatenate_datasets([Dataset.from_file(str(folder / "rows" / name)) for name in manifest["files"]])
    if manifest["keep"]:
        ds = ds.select(np.load(folder / "keep.npy"))
    return ds.remove_columns([c for c in CHECK_ONLY if c in ds.column_names])


def write_rows_in_parallel(source: Source, rejected: list[Rejected], folder: Path, processes: int,
                           default_score: float | None, score_required: bool, row_format: RowFormat,
                           train_on: str, unscored: list[int] | None = None) -> tuple[list[Path], int, bool]:
    """`write_rows` of a source's valid rows by `processes` processes, each a stretch of its lines (JSONL) or
    rows (a table) into an Arrow file of its own; the rows, their numbers and the rejected rows (appended to
    `rejected`, in order) are those one process finds. With `data.format=auto` every stretch after the
    source's first row of a known format holds that format, as one process would. Returns the files in
    order, the count of rows and whether some turn weighs other than 0 or 1."""
    import copy
    import multiprocessing

    global _STRETCHES
    first = _first_format(source, row_format)
    if source.kind == "jsonl":
        spans = _line_spans(source.spec, processes)
    else:
        n = len(source.table())
        spans = [(n * i // processes, n * (i + 1) // processes, n * i // processes + 1) for i in range(processes)
                 if n * i // processes < n * (i + 1) // processes]
    jobs = []
    for i, span in enumerate(spans):
        stretch = copy.copy(row_format)
        if first is not None and span[2] > first[0]:
            stretch.chosen = first[1]
        jobs.append((source, span, folder / f"rows-{i:05d}.arrow", stretch, default_score, score_required, train_on))
    folder.mkdir(parents=True, exist_ok=True)
    _STRETCHES = jobs  # the forked processes find them here: a table source is not pickled
    try:
        with multiprocessing.get_context("fork").Pool(len(jobs)) as pool:
            done = pool.map(_write_stretch, range(len(jobs)))
    finally:
        _STRETCHES = []
    for _, _, found, lines in done:
        rejected += found
        if unscored is not None:
            unscored += lines
    count = sum(n for n, _, _, _ in done)
    if not count and not rejected:  # blank lines only, or an empty table
        raise DataError([f"{source}: file: no rows (the file is empty)"])
    if first is not None:
        logged = copy.copy(row_format)
        logged.chosen = first[1]
        _log_format(str(source), logged)
    return [job[2] for job in jobs], count, any(weighted for _, weighted, _, _ in done)


_STRETCHES: list = []  # write_rows_in_parallel's jobs, for its forked processes


def _write_stretch(index: int) -> tuple[int, bool, list[Rejected], list[int]]:
    """One process of `write_rows_in_parallel`: a stretch of rows validated and written."""
    source, span, out, row_format, default_score, score_required, train_on = _STRETCHES[index]
    rejected: list[Rejected] = []
    unscored: list[int] = []
    count, weighted = write_rows(iter_source(source, rejected, default_score, score_required, row_format, train_on,
                                             span=span), out, unscored)
    return count, weighted, rejected, unscored


def _line_spans(path: str, n: int) -> list[tuple[int, int, int]]:
    """A file cut into about `n` stretches of whole lines: (start byte, end byte, number of the first line)."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        for i in range(1, n):
            f.seek(max(size * i // n, cuts[-1]))
            f.readline()  # to the start of the next line
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
        cuts.append(size)
        first_lines = [1]
        for a, b in zip(cuts, cuts[1:]):
            f.seek(a)
            newlines, left = 0, b - a
            while left:
                chunk = f.read(min(1 << 24, left))
                newlines, left = newlines + chunk.count(b"\n"), left - len(chunk)
            first_lines.append(first_lines[-1] + newlines)
    return [(a, b, line) for a, b, line in zip(cuts, cuts[1:], first_lines)]


def _first_format(source: Source, row_format: RowFormat) -> tuple[int, str] | None:
    """For `data.format=auto`: the number and format of the source's first row of a known format (None: none,
    or the format is given)."""
    from sft.formats import detect

    if row_format.fmt != "auto":
        return None
    if source.kind != "jsonl":
        found = ((number, detect(_without_nulls(row), row_format.columns))
                 for number, row in enumerate(source.table(), start=1))
        return next(((number, fmt) for number, fmt in found if fmt is not None), None)
    with open(source.spec, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                row = json.loads(raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw)
            except (ValueError, RecursionError):  # not UTF-8, not JSON (a blank line too): rejected, or skipped
                continue
            found = detect(row, row_format.columns) if isinstance(row, dict) else None
            if found is not None:
                return lineno, found
    return None


def _table(source: Source):
    """A table source's rows (`Source.table`); unreadable, a `DataError` naming it."""
    try:
        return source.table()
    except SourceError as e:
        raise DataError([str(e)], header="the data cannot be read") from None


def write_rows(rows, path: Path, unscored: list[int] | None = None) -> tuple[int, bool]:
    """Write validated rows (`iter_source`'s) to an Arrow file as they come, a thousand at a time: the rows
    of a source are never all in memory. Returns how many, and whether some turn weighs other than 0 or 1;
    the lines of rows without a `difficulty_score` are appended to `unscored`. The messages are kept as JSON
    text (`tokenize_batch` reads them back five times faster than `datasets` turns a list of structs into Python)."""
    from datasets.arrow_writer import ArrowWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    count, turn_weighted = 0, False
    with ArrowWriter(features=row_features(), path=str(path), writer_batch_size=1000) as writer:
        for row in rows:
            turn_weighted = turn_weighted or any(m["weight"] not in (0.0, 1.0) for m in row["messages"])
            if unscored is not None and math.isnan(row["difficulty_score"]):
                unscored.append(row["source_line"])
            writer.write({**row, "messages": json.dumps(row["messages"])})
            count += 1
        writer.finalize()
    return count, turn_weighted


def row_features() -> datasets.Features:
    """The types of a validated row as `write_rows` stores it, stated: a batch of rows must not decide them."""
    from datasets import Features, Value

    text = Value("string")
    return Features({"messages": text, "tools": text, "difficulty_score": Value("float64"),
                     "source_line": Value("int64"), "extra": text})


def _checked(ds: datasets.Dataset, source: Source, n_rows: int, rejected: list[Rejected], on_error: str,
             overlong: str, max_length: int, token_weights) -> tuple[list[int] | None, SplitSummary]:
    """Which sequences of a freshly tokenised split to keep (None: all): the rows the template refused are left
    out (`on_error=skip`; reported in `rejected`); and its `SplitSummary`. Refused rows (`on_error=raise`) and
    over-long ones (`overlong=error`) are a `DataError`."""
    path = str(source)
    if len(ds) == 0:  # every row dropped (datasets then keeps the input's columns, not the function's)
        raise DataError([f"{path}: file: no row left with an assistant token at data.max_length={max_length} "
                         f"(data.overlong={overlong})"])
    refused = [(i, line, why.split("\t", 1)) for i, (line, why)
               in enumerate(zip(column(ds, "source_line"), column(ds, "refused"))) if why]
    if refused:
        raw = raw_rows(source, {line for _, line, _ in refused})
        by_template = [Rejected(path, line, field, reason, raw[line]) for _, line, (field, reason) in refused]
        if on_error == "raise":
            raise DataError(by_template)
        rejected += by_template
        refused_lines = {line for _, line, _ in refused}  # with every other text of the row
        keep = [i for i, line in enumerate(column(ds, "source_line")) if line not in refused_lines]
        ds = ds.select(keep)
    flagged = column(ds, "overlong") if overlong == "error" else []
    if any(flagged):
        lines = [line for line, flag in zip(column(ds, "source_line"), flagged) if flag]
        raise DataError([f"{path}:{line}: row: longer than data.max_length={max_length} tokens "
                         "(data.overlong=truncate or drop to accept it)" for line in lines])
    views = column(ds, "view")
    summary = SplitSummary(rows=n_rows, rejected=len(rejected), truncated=sum(column(ds, "truncated")),
                           dropped=n_rows - len(refused) - len(set(column(ds, "source_line"))),
                           own_turn_texts=sum(v > 0 for v in views), sequences=len(ds))
    counts = ds.with_format("arrow").select_columns(["input_ids", "trained_tokens"])[:]  # (the lists' offsets only)
    summary.tokens = int(pc.sum(pc.list_value_length(counts["input_ids"])).as_py() or 0)
    summary.trained_tokens = int(pc.sum(counts["trained_tokens"]).as_py() or 0)
    if token_weights is not None:
        summary.reweighted_tokens = sum(column(ds, "reweighted_tokens"))
    if summary.dropped or summary.truncated:
        log.warning("data: %s: %d sequence(s) truncated to data.max_length=%d; %d row(s) dropped (over-long with "
                    "data.overlong=drop, or no assistant token left)", path, summary.truncated, max_length,
                    summary.dropped)
    if summary.own_turn_texts:
        log.info("data: %s: the chat template rewrites earlier turns: %d turn(s) trained from their own rendering "
                 "(data.rewritten_turns=split)", path, summary.own_turn_texts)
    if "untrained_reasoning" in ds.column_names:
        summary.untrained_reasoning = sum(column(ds, "untrained_reasoning"))
    if len(ds) == 0:
        raise DataError(rejected, header=f"{path}: no valid row left: all {len(rejected)} rejected")
    return (keep if refused else None), summary


def column(ds: datasets.Dataset, name: str) -> list:
    """A whole column as a list, read from Arrow in one go (with any `select`/`shuffle` applied).

    `ds[name]` in datasets 5 iterates row by row: about 2 s per column at 100k rows.
    """
    return ds.with_format("arrow").select_columns([name])[:][name].to_pylist()


def row_keys(dataset) -> list[tuple[int, int]]:
    """Each sequence's row: (source number, source line); the source is 0 but in a mixture (`sft.mixture`)."""
    lines = column(dataset, "source_line")
    sources = column(dataset, "source") if "source" in dataset.column_names else [0] * len(lines)
    return list(zip(sources, lines))


def row_scores(dataset) -> dict[tuple[int, int], float]:
    """`difficulty_score` by row (`row_keys`), for the rows that have one: names a row's difficulty in reports
    and eval buckets."""
    return {key: score for key, score in zip(row_keys(dataset), column(dataset, "difficulty_score"))
            if not math.isnan(score)}


def scores_used_by(loss, controllers: dict | None = None) -> list[str]:
    """What in a run uses the rows' `difficulty_score`: the loss if it weighs by difficulty (`alpha` not 0),
    and controllers that say they need it (`needs_difficulty_score`: the curriculum)."""
    users = [f"loss.alpha={loss.alpha:g}"] if getattr(loss, "alpha", 0) else []
    return users + [f"controllers.{name}" for name, c in (controllers or {}).items()
                    if getattr(c, "needs_difficulty_score", False)]


def _require_scores(ds: datasets.Dataset, source: Source, needed_by: list[str],
                    on_error: str) -> tuple[datasets.Dataset, list[Rejected]]:
    """Where the run uses difficulty scores (`needed_by` names what does), a row without one is refused
    (`on_error=raise`) or left out and reported (`skip`); elsewhere it trains with no score.

        needed_by=["loss.alpha=1"], a row of line 7 without a score  ->
            DataError "train.jsonl:7: difficulty_score: missing (used by loss.alpha=1: set data.default_score=...)"
    """
    path = str(source)
    lines = column(ds, "source_line")
    unscored = sorted({line for line, score in zip(lines, column(ds, "difficulty_score")) if math.isnan(score)})
    if not unscored:
        return ds, []
    if not needed_by:
        log.info("data: %s: %d row(s) without difficulty_score, which this run does not use", path, len(unscored))
        return ds, []
    reason = missing_score_reason(needed_by)
    raw = raw_rows(source, set(unscored))
    missing = [Rejected(path, line, "difficulty_score", reason, raw[line]) for line in unscored]
    if on_error == "raise":
        raise DataError(missing)
    unscored_set = set(unscored)
    kept = ds.select([i for i, line in enumerate(lines) if line not in unscored_set])
    if len(kept) == 0:
        raise DataError([f"{path}: file: no row with a difficulty_score (used by {', '.join(needed_by)})"])
    return kept, missing


def missing_score_reason(needed_by: list[str]) -> str:
    """Why a row without `difficulty_score` is refused, and the knobs that help (`needed_by`: `scores_used_by`'s)."""
    without = [("train without difficulty weights: loss=ce" if user.startswith("loss.") else f"drop it: ~{user}")
               for user in needed_by]
    return (f"missing (used by {', '.join(needed_by)}: set data.default_score=<score> to give every such row one, map "
            f"the file's score column with data.columns.score=<column>, or {' and '.join(without)})")


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
    identity: dict  # what decides the data, part by part: sources' contents, settings, tokenizer (load_sft_datasets)
    packing: bool = False  # how the collator forms batches (data.packing)
    summary: dict[str, SplitSummary] = field(default_factory=dict)  # by split: train, eval
    parts: list[Part] = field(default_factory=list)  # the sources, by the rows' `source` number (sft.mixture)

    @property
    def data_hash(self) -> str:
        return data_hash(self.identity)

    @property
    def tasks(self) -> dict[int, str]:
        """The task of each source that has one, by source number (a mixture's; none without one)."""
        return {i: p.task for i, p in enumerate(self.parts) if p.task is not None}

    def source_name(self, split: str, number: int = 0) -> str:
        """The train or eval source of a row's `source` number, as errors and reports name it."""
        return str(getattr(self.parts[number], split)) if self.parts else "?"


def load_sft_datasets(
    tokenizer,
    loss,
    train_file: str | None,
    eval_file: str | None = None,
    max_length: int = 2048,
    default_score: float | None = None,
    num_proc: int | None = None,
    on_error: str = "raise",
    overlong: str = "truncate",
    rejected_file: str | None = None,
    packing: bool = False,
    rewritten_turns: str = "split",
    prefill: str = "refuse",
    scores_needed_by: list[str] | None = None,
    format: str = "auto",  # noqa: A002 - the config's name (data.format)
    columns: dict | None = None,
    train_on: str = "all",
    train_split: str = "train",
    eval_split: str = "test",
    hub_name: str | None = None,
    hub_revision: str | None = None,
    mixture: list | None = None,
    mixture_seed: int = 0,
) -> SFTData:
    """Validated, tokenised train and eval splits with the loss's static weights: a per-row `loss_weight`
    (`loss.sample_weight`), per-token `token_weights` when the loss has them, and an `aux_<name>` value
    per row for each auxiliary term (`loss.aux`). `loss=None` weighs every row 1.

    `on_error`: `raise` stops at the first bad rows with `DataError`; `skip` trains on the valid rows
    and reports the others (`report_rejected`). `overlong` and `rewritten_turns`: see `tokenize_batch`
    and `chat_views`. `packing` changes only how batches are formed (`WeightedDataCollator`); it is kept
    with the data settings it describes. `scores_needed_by`: what in the run uses `difficulty_score` (by
    default the loss, if its `alpha` is not 0); a row without a score is refused only then. `format` and
    `columns`: the files' row format (`sft.formats`); `train_on`: `all` assistant turns or the `last` only
    (`turn_weights`). `train_file`/`eval_file` are sources (`sft.sources`: JSONL and other files, globs,
    save_to_disk folders, `hub:<id>`), the splits and hub settings for those that have them. `mixture`
    (`data.mixture` entries) replaces them by several sources drawn into one training split (`sft.mixture`),
    each row numbered by its source in a `source` column.
    """
    if scores_needed_by is None:
        scores_needed_by = scores_used_by(loss)
    log_template_profile(tokenizer, prefill)
    token_weights = loss.token_weights if loss is not None and loss.has_token_weights else None
    shared = {**preprocessing_identity(tokenizer, max_length, default_score), "overlong": overlong,
              "rewritten_turns": rewritten_turns, "prefill": prefill}
    if token_weights is not None:
        shared["token_weights"] = loss.token_weight_identity()
    try:
        parts = parts_of(train_file, eval_file, mixture, format, columns, train_split, eval_split, hub_name,
                         hub_revision)
        if mixture:
            sources = [p.identity() for p in parts]  # each source's files hashed once
            identity = {**shared, "train_on": train_on, "mixture": sources, "mixture_seed": mixture_seed}
        else:
            (part,) = parts
            identity = {"train_file": part.train.fingerprint(),
                        "eval_file": None if part.eval is None else part.eval.fingerprint(), **shared}
            if (format, part.columns, train_on) != ("auto", {}, "all"):  # (else as before: earlier caches stand)
                identity.update(format=format, columns=dict(sorted(part.columns.items())), train_on=train_on)
    except SourceError as e:
        raise DataError([str(e)], header="the data cannot be read") from None

    splits, rejected, summaries = {"train": [], "eval": []}, [], {}
    for number, part in enumerate(parts):
        # the tokenised rows of a source are cached by what decides them, whatever mixture they are part of
        key = data_hash(identity) if not mixture else data_hash(
            {**shared, "train_on": train_on, **{k: v for k, v in sources[number].items()
                                                if k in ("train_file", "eval_file", "format", "columns")}})
        for name in ("train", "eval"):
            source = getattr(part, name)
            if source is None:
                continue
            ds, bad, summary = _tokenized_split(source, tokenizer, max_length, default_score, num_proc, key,
                                                on_error, overlong, rewritten_turns, token_weights,
                                                RowFormat(part.format, part.columns), train_on, prefill,
                                                scores_needed_by)
            ds, unscored = _require_scores(ds, source, scores_needed_by, on_error)
            rejected += bad + unscored
            summary.rejected += len(unscored)
            if token_weights is not None and name == "train" and not summary.reweighted_tokens:
                log.warning("loss: its token weights leave every one of the %d trained tokens of %s at 1 (for "
                            "loss.phrases: no phrase occurs in an assistant turn)", summary.trained_tokens, source)
            if summary.untrained_reasoning:
                log.warning("data: %s: %d trained assistant turn(s) have reasoning that the chat template does not "
                            "render: their reasoning is not trained (%s)", source, summary.untrained_reasoning,
                            reasoning_hint(tokenizer))
            summaries[name] = summary if name not in summaries else summaries[name] + summary
            ds = _with_static_weights(ds, loss, str(source), part.loss_weight)
            splits[name].append(ds if not mixture else _numbered(ds, number))
    report_rejected(rejected, rejected_file)
    if not mixture:
        train, evaluation = splits["train"][0], (splits["eval"] or [None])[0]
    else:
        train, evaluation = _mixed(parts, splits["train"], mixture_seed), _concatenated(splits["eval"])
    return SFTData(train=train, eval=evaluation, identity=identity, packing=packing, summary=summaries, parts=parts)


def _numbered(ds: datasets.Dataset, number: int) -> datasets.Dataset:
    """The split with its source's number in a `source` column."""
    fingerprint = hashlib.sha256(f"{ds._fingerprint}-source-{number}".encode()).hexdigest()[:16]
    return ds.add_column("source", [number] * len(ds), new_fingerprint=fingerprint)


def _mixed(parts: list[Part], splits: list[datasets.Dataset], seed: int) -> datasets.Dataset:
    """The training split of a mixture: each source's rows drawn as its ratio or epochs say (`sft.mixture`)."""
    lines = [np.asarray(column(ds, "source_line")) for ds in splits]
    sizes = [len(np.unique(x)) for x in lines]
    counts = draw_counts(sizes, [p.ratio for p in parts], [p.epochs for p in parts])
    for i, (part, count) in enumerate(zip(parts, counts)):
        if count == 0:
            raise DataError([f"data.mixture[{i}] ({part.name}): its share draws no row of its {sizes[i]} (raise its "
                             "ratio or epochs)"], header="the mixture cannot be drawn")
    log_mixture(parts, sizes, counts)
    drawn = [ds.select(drawn_sequences(x, count, np.random.default_rng([seed, i])))
             for i, (ds, x, count) in enumerate(zip(splits, lines, counts))]
    return _concatenated(drawn)


def _concatenated(splits: list[datasets.Dataset]) -> datasets.Dataset | None:
    """Splits of several sources as one; `token_weights` of 1 where a source has none and another has them; the
    columns all have (a source cached by an older version may lack one), of the first's types."""
    from datasets import concatenate_datasets

    if not splits:
        return None
    if any("token_weights" in ds.column_names for ds in splits):
        splits = [ds if "token_weights" in ds.column_names else ds.map(
            lambda b: {"token_weights": [np.ones(len(ids), dtype=np.float32) for ids in b["input_ids"]]},
            batched=True, keep_in_memory=True) for ds in splits]
    common = [c for c in splits[0].column_names if all(c in ds.column_names for ds in splits)]
    splits = [ds.select_columns(common) for ds in splits]
    splits = [ds if ds.features == splits[0].features else ds.cast(splits[0].features) for ds in splits]
    return concatenate_datasets(splits) if len(splits) > 1 else splits[0]


def _with_static_weights(ds: datasets.Dataset, loss, path: str, scale: float = 1.0) -> datasets.Dataset:
    """The split with `loss_weight` (the loss's sample weight of each row, times `scale`: a mixture source's
    `loss_weight`) and the auxiliary terms' row values as columns. A weight that is not a finite number >= 0
    is a `DataError` naming the row."""
    lines = None
    for name, values in _static_values(ds, loss).items():
        is_weight = name == "loss_weight"
        array = np.asarray(values, dtype=np.float64) if isinstance(values, np.ndarray) else None
        if array is not None:
            bad = np.flatnonzero(~np.isfinite(array) | (array < 0 if is_weight else False)).tolist()
        else:
            bad = [i for i, v in enumerate(values) if not _finite_number(v, nonnegative=is_weight)]
        if bad:
            lines = lines or column(ds, "source_line")
            what, need = (("loss weight: the loss's sample_weight", "a finite number >= 0") if is_weight
                          else (f"loss.aux.{name[4:]}: row_value", "a finite number"))
            shown = [values[i] if array is None else float(values[i]) for i in bad]
            raise DataError([f"{path}:{lines[i]}: {what} returned {v!r} (must be {need})" for i, v in zip(bad, shown)])
        # Fingerprinted by the values' bytes, which datasets would otherwise do by pickling the list.
        array = (np.asarray(values, dtype=np.float64) if array is None else array) * (scale if is_weight else 1.0)
        fingerprint = hashlib.sha256(ds._fingerprint.encode() + name.encode() + array.tobytes()).hexdigest()[:16]
        ds = ds.add_column(name, array, new_fingerprint=fingerprint)
    return ds.remove_columns(["truncated", "extra"])


def _static_values(ds: datasets.Dataset, loss) -> dict[str, np.ndarray | list]:
    """Each row's sample weight (`loss_weight`) and auxiliary terms' values (`aux_<name>`). A loss that weighs
    rows by their difficulty alone (the built-in ones but `length`) is computed for all rows at once; else
    each row's columns go to the loss's hooks (`row_fields`, with its `assistant_tokens`)."""
    from sft.losses import WeightedTokenLoss

    aux = dict(getattr(loss, "aux", None) or {})
    if loss is None:
        return {"loss_weight": np.ones(len(ds))}
    if not aux and type(loss).sample_weight is WeightedTokenLoss.sample_weight:
        return {"loss_weight": loss.difficulty_weights(np.asarray(column(ds, "difficulty_score"), dtype=np.float64))}
    rows = [row_fields(score, extra) | {"assistant_tokens": n} for score, extra, n
            in zip(column(ds, "difficulty_score"), column(ds, "extra"), assistant_tokens(ds))]
    values = {"loss_weight": [loss.sample_weight(r) for r in rows]}
    for name, term in aux.items():
        values[f"aux_{name}"] = [term.row_value(r) for r in rows]
    return values


def assistant_tokens(ds: datasets.Dataset) -> np.ndarray:
    """The number of trained tokens (labels other than -100 after the first position) of each row."""
    if "trained_tokens" in ds.column_names:  # counted while tokenising
        return np.asarray(column(ds, "trained_tokens"), dtype=np.int64)
    labels = ds.with_format("arrow").select_columns(["labels"])[:]["labels"].combine_chunks()
    offsets = np.asarray(labels.offsets)
    trained = np.asarray(pc.not_equal(labels.values, pa.scalar(IGNORE_INDEX, labels.type.value_type)), dtype=bool)
    trained[offsets[:-1][offsets[:-1] < offsets[1:]]] = False  # position 0 is never a target
    total = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
    return total[offsets[1:]] - total[offsets[:-1]]


def _finite_number(value, nonnegative: bool = False) -> bool:
    """Whether `value` is a finite real number (not a bool, not a string), >= 0 if `nonnegative`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        return math.isfinite(value) and (value >= 0 or not nonnegative)
    except OverflowError:  # an int too large for a float
        return False


# --- collation ----------------------------------------------------------------------------------------


class WeightedDataCollator(DataCollatorForSeq2Seq):
    """`DataCollatorForSeq2Seq` that also builds per-token `loss_weights` and keeps each row's `source_line`.

    A row's `loss_weight` (times its `token_weights`, where the loss has static token weights) goes on its
    assistant tokens (labels other than -100), 0 elsewhere:

        {labels: [-100, -100, 7, 8], loss_weight: 2.0, token_weights: [1, 1, 3, 1]}  ->  loss_weights [[0, 0, 6, 2]]

    With
    `packing`, the micro-batch becomes one row without padding (`DataCollatorWithFlattening`):
    `position_ids` restart at 0 for every sample, which is how the model's attention (a block-diagonal
    mask for sdpa and eager) and the loss tell the samples apart, and the samples' boundaries
    (`cu_seq_lens_q/k`, `max_length_q/k`) go to the attention for flash attention's varlen kernels and
    `sdpa_varlen` (`sft.attention`); there is no `attention_mask`.

    The batch holds what the model's forward takes plus `labels`, `loss_weights`, `source_lines`,
    `source_views` (which text of its row a sequence is, see `chat_views`), a mixture's `source_ids` (the
    rows' `source`, `sft.mixture`) and each auxiliary term's row values `aux_<name>` ([rows]), which the
    trainer pops before the forward.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None, packing: bool = False):
        super().__init__(tokenizer=tokenizer, padding=True, pad_to_multiple_of=pad_to_multiple_of,
                         label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
        self.packing = packing
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True) if packing else None

    def __call__(self, features, return_tensors=None):
        lines = torch.as_tensor([f["source_line"] for f in features], dtype=torch.long)
        views = torch.as_tensor([f.get("view", 0) for f in features], dtype=torch.long)
        weights = torch.as_tensor([f["loss_weight"] for f in features], dtype=torch.float32)
        aux = {k: torch.as_tensor([f[k] for f in features], dtype=torch.float64)
               for k in features[0] if k.startswith("aux_")}
        token_weights = [torch.as_tensor(f["token_weights"], dtype=torch.float32) * w
                         for f, w in zip(features, weights)] if "token_weights" in features[0] else None
        sources = (torch.as_tensor([f["source"] for f in features], dtype=torch.long) if "source" in features[0]
                   else None)
        features = [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
        if self.packing:
            batch = self.flatten(features)
            if token_weights is None:
                lengths = torch.as_tensor([len(f["input_ids"]) for f in features])
                row_weights = weights.repeat_interleave(lengths)[None, :]
            else:
                row_weights = torch.cat(token_weights)[None, :]
        else:
            batch = super().__call__(features, return_tensors)
            row_weights = weights[:, None]
            if token_weights is not None:
                row_weights = torch.zeros(batch["labels"].shape)
                left = self.tokenizer.padding_side == "left"
                for i, w in enumerate(token_weights):
                    if left:
                        row_weights[i, row_weights.size(1) - len(w):] = w
                    else:
                        row_weights[i, :len(w)] = w
        batch["loss_weights"] = torch.where(batch["labels"] != IGNORE_INDEX, row_weights, 0.0)
        batch["source_lines"], batch["source_views"] = lines, views
        if sources is not None:  # a mixture's: which source each row is of
            batch["source_ids"] = sources
        batch.update(aux)
        return batch
