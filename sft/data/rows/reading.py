"""Rows: reading a source row by row and validating each as a chat, the rejected ones named by
source, line (row) and field (`DataError`, `Rejected`), counted or refused as `data.on_error` says.

A valid row is `{"messages": [{"role", "content", ...}, ...], "difficulty_score", ...}` (`sft.data.rows.formats` turns
the other formats into it first); each message gets its weight in training (`turn_weights`)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from sft.data.rows.formats import FormatError, RowFormat
from sft.data.rows.sources import Source, SourceError
from sft.files import own_path

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


ROLES = ("system", "user", "assistant", "tool")


MAX_ERRORS_SHOWN = 10


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
        if "weight" in m and not finite_number(m["weight"], nonnegative=True):
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
    elif not finite_number(score, nonnegative=True):
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
    messages first (`sft.data.rows.formats`; default: auto-detected); each message gets its `weight` in training
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
            accepted = accept(parsed, lineno, reject, default_score, score_required, row_format, train_on)
            if accepted is not None:
                yield accepted
    if span is None:
        if not found and not rejected:
            raise DataError([f"{path}: file: no rows (the file is empty)"])
        log_format(path, row_format)


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
    table = table_of(source)
    start, end, first = span or (0, len(table), 1)
    rows = table if span is None else table.select(range(start, end))
    for number, row in enumerate(rows, start=first):
        def reject(field: str, reason: str) -> None:
            rejected.append(Rejected(str(source), number, field, reason, json.dumps(row, ensure_ascii=False,
                                                                                     default=str)))

        accepted = accept(without_nulls(row), number, reject, default_score, score_required, row_format, train_on)
        if accepted is not None:
            yield accepted
    if span is None:
        if not len(table):
            raise DataError([f"{source}: source: no rows"])
        log_format(str(source), row_format)


def without_nulls(value):
    """A table row without its null values, at any depth (Arrow fills a struct's missing keys with null)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def accept(parsed, number: int, reject: Callable, default_score, score_required: bool, row_format: RowFormat,
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


def log_format(name: str, row_format: RowFormat) -> None:
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
    """Read and validate a chat source (a JSONL file, or any `sft.data.rows.sources.Source`, of any row format); raise
    `DataError` naming source, line (row) and field of bad rows."""
    try:
        source = Source(str(path), split, hub_name, hub_revision)
    except SourceError as e:
        raise DataError([str(e)], header="the data cannot be read") from None
    rows, rejected = scan_source(source, default_score, row_format=RowFormat(fmt, columns))
    if rejected:
        raise DataError(rejected)
    return rows


def table_of(source: Source):
    """A table source's rows (`Source.table`); unreadable, a `DataError` naming it."""
    try:
        return source.table()
    except SourceError as e:
        raise DataError([str(e)], header="the data cannot be read") from None


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
        with open(own_path(rejected_file), "w", encoding="utf-8") as f:
            for r in rejected:
                f.write(json.dumps({"file": r.file, "line": r.line, "field": r.field, "reason": r.reason,
                                    "row": r.raw}, ensure_ascii=False) + "\n")
        log.warning("data: the skipped rows and their reasons are in %s", rejected_file)


def finite_number(value, nonnegative: bool = False) -> bool:
    """Whether `value` is a finite real number (not a bool, not a string), >= 0 if `nonnegative`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        return math.isfinite(value) and (value >= 0 or not nonnegative)
    except OverflowError:  # an int too large for a float
        return False
