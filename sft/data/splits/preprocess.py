"""Preprocessing: a source's rows validated into an Arrow file and tokenised from it on every core, the
result cached under the sft cache by what decides it (`_tokenized_split`), in bounded memory at any size."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pyarrow.compute as pc

from sft.cache import building, cache_dir
from sft.data.chat.settings import chat_settings
from sft.data.chat.template import ChatRenderer
from sft.data.chat.turns import LABELLING
from sft.data.rows.formats import RowFormat
from sft.data.rows.reading import DataError, Rejected, iter_source, log_format, raw_rows, table_of, without_nulls
from sft.data.rows.sources import Source
from sft.data.spec import Labelling
from sft.data.tokens.columns import column
from sft.data.tokens.labels import tokenize_batch
from sft.data.tokens.weights import missing_score_reason

if TYPE_CHECKING:
    import datasets

    from sft.data.spec import DataSpec



log = logging.getLogger(__name__)


PREPROCESS_VERSION = 5  # bump when tokenisation or labelling changes, to invalidate caches


PARALLEL_ROWS = 20000  # data.num_proc=null tokenises files of this many rows on every core


PARALLEL_BYTES = 8 << 20  # and validates JSONL files this large (other sources: of PARALLEL_ROWS) on every core


def log_template_profile(tokenizer, labelling: Labelling = LABELLING) -> None:
    """What the chat template does around an answer, where a user should know it (`TemplateProfile.notes`). A
    template that does not compile, or that jinja's sandbox stops on a plain chat, is one config error, not a refusal
    of every row; so is a labelling that would train an answer without the token the model stops at
    (`untrained_stop`), which a template with no such token only warns of (in the notes)."""
    prefill = str(labelling.prefill)
    from jinja2 import TemplateSyntaxError
    from jinja2.exceptions import SecurityError

    from sft.config.schema import ConfigError

    render = ChatRenderer(tokenizer)
    try:
        render.compile()
    except TemplateSyntaxError as e:
        raise ConfigError("tokenizer.chat_template", None, f"{chat_settings(tokenizer).template_name} does not "
                          f"compile: {e.message} (line {e.lineno})") from None
    try:
        render._render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], None, False)
    except SecurityError as e:
        raise ConfigError("tokenizer.chat_template", None, f"{chat_settings(tokenizer).template_name} is stopped by "
                          f"jinja's sandbox on a plain chat ({e}): a template may not reach Python internals") from None
    except Exception:  # noqa: BLE001 - a template may refuse such a chat: the rows' own refusals say why
        pass
    profile = render.profile
    if profile.stops and not profile.no_end and (problem := untrained_stop(tokenizer, labelling)):
        raise ConfigError("tokenizer.chat_template", None, f"{chat_settings(tokenizer).template_name}: {problem}")
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
    from sft.config.secrets import masked

    given = ", ".join(f"{k}={v!r}" for k, v in masked(chat_settings(tokenizer).kwargs).items())
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


def untrained_stop(tokenizer, labelling: Labelling = LABELLING) -> str | None:
    """Why an answer would train without a stop token, or None: a probe chat of two answers is labelled as every
    row is, and each trained stretch must end with one of the stop tokens (`stop_token_ids`: the model's, or the
    template's own end of turn). A template that refuses the probe (a prefill under `data.prefill=refuse`) is left
    to the rows to report."""
    from sft.data.chat.template import PROBE_ANSWER, stop_token_ids

    chat = [{"role": "user", "content": "Probe question 1?"}, {"role": "assistant", "content": PROBE_ANSWER},
            {"role": "user", "content": "Probe question 2?"}, {"role": "assistant", "content": PROBE_ANSWER}]
    from sft.data.tokens import labels

    table = labels.tokenize_batch({"messages": [json.dumps(chat)], "difficulty_score": [1.0], "source_line": [0]},
                                  tokenizer, replace(labelling, max_length=max(labelling.max_length, 512)))
    if "refused" in table.column_names and any(table.column("refused").to_pylist()):
        return None
    stops = set(stop_token_ids(tokenizer))
    for ids, row_labels in zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist()):
        for end in (i for i, label in enumerate(row_labels) if label != -100 and (i + 1 == len(row_labels)
                                                                                 or row_labels[i + 1] == -100)):
            if ids[end] not in stops:
                tail = tokenizer.decode(ids[max(0, end - 3):end + 1])
                names = ", ".join(tokenizer.convert_ids_to_tokens(sorted(stops)))
                return (f"an answer would train ending {tail!r}, without a token the model stops at ({names}): the "
                        "model would not learn to stop. Set tokenizer.stop_tokens to the template's end-of-turn token")
    return None


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


def tokenized_split(source: Source, spec: DataSpec, tokenizer, key: str, row_format: RowFormat | None = None,
                    token_weights: Callable | None = None, scores_needed_by: list[str] | None = None):
    """Tokenise one file as `spec` says (its labelling, `default_score`, `num_proc`, `on_error`, `train_on`), or
    load it from the cache an earlier run wrote with the same key.

    Returns the dataset, the rejected rows and the `SplitSummary` (all three kept in the cache, so every
    run can report them). The rows are streamed to an Arrow file, tokenised from it on every core (files of
    `PARALLEL_ROWS` rows and more, `data.num_proc`), and the tokenised files become the cache as they are
    (`rows.json` lists them): this process reads the tokens of no row, so a million rows preprocess in the
    memory of a few columns of numbers. A JSONL file of `PARALLEL_BYTES` and more is validated on every core
    too (`write_rows_in_parallel`).
    """
    from datasets import Dataset, concatenate_datasets

    default_score, on_error, train_on, num_proc = spec.default_score, spec.on_error, spec.train_on, spec.num_proc
    labelling = spec.labelling()
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
                 else len(table_of(source)) >= PARALLEL_ROWS)
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
        with _environ_kept():
            ds = concatenate_datasets([Dataset.from_file(str(f)) for f in files]).map(
                tokenize_batch,
                batched=True,
                batch_size=256,
                num_proc=num_proc if num_proc and num_proc > 1 else None,
                remove_columns=["messages", "tools"],
                fn_kwargs={"tokenizer": tokenizer, "labelling": labelling, "token_weights": token_weights,
                           "turn_weighted": turn_weighted},
                cache_file_name=str(work / "tokenised.arrow"),
                desc=f"tokenising {Path(path).name}",
            )
        keep, summary = _checked(ds, source, n_rows, rejected, on_error, labelling, token_weights)
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
        log_format(str(source), logged)
    return [job[2] for job in jobs], count, any(weighted for _, weighted, _, _ in done)


@contextlib.contextmanager
def _environ_kept():
    """`Dataset.map(num_proc=...)` ends by rebinding `os.environ` to a copy it took before (datasets 5.2), which cuts
    off whoever holds the original (pytest's monkeypatch restores that one, so a test's variable leaked into every
    later one): the original object is put back, holding the copy's contents."""
    environ = os.environ
    try:
        yield
    finally:
        if os.environ is not environ:
            replaced, os.environ = os.environ, environ
            for key in set(environ) - set(replaced):
                del environ[key]
            environ.update(replaced)


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
    from sft.data.rows.formats import detect

    if row_format.fmt != "auto":
        return None
    if source.kind != "jsonl":
        found = ((number, detect(without_nulls(row), row_format.columns))
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
             labelling: Labelling, token_weights) -> tuple[list[int] | None, SplitSummary]:
    """Which sequences of a freshly tokenised split to keep (None: all): the rows the template refused are left
    out (`on_error=skip`; reported in `rejected`); and its `SplitSummary`. Refused rows (`on_error=raise`) and
    over-long ones (`overlong=error`) are a `DataError`."""
    path, overlong, max_length = str(source), labelling.overlong, labelling.max_length
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
