"""Labels: each text a chat trains as (`sft.data.chat.turns.chat_views`) tokenised, its trained spans turned
into token labels, fitted to `data.max_length`, gathered as Arrow columns (`tokenize_batch`)."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Callable

import numpy as np
import pyarrow as pa

from sft.data.chat.template import ChatRenderer, Refused
from sft.data.chat.turns import LABELLING, chat_views
from sft.data.rows.reading import finite_number
from sft.data.spec import Labelling
from sft.data.tokens.batch import IGNORE_INDEX

if TYPE_CHECKING:
    pass



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


def tokenize_batch(batch: dict, tokenizer, labelling: Labelling = LABELLING, token_weights: Callable | None = None,
                   turn_weighted: bool = False) -> pa.Table:
    """`datasets.map` function: input_ids and assistant-only labels of each text a chat trains as
    (`chat_views`; `view` 0 is the whole chat, 1... turns a template rewrites later), fitted to
    `labelling.max_length`, as an Arrow table (`SEQUENCE_COLUMNS`).

        {"messages": [[user "1+1?", assistant "2"]], ...}, Labelling(max_length=2048)  ->
            one sequence: input_ids of the rendered chat, labels -100 but on "2<|im_end|>"

    `labelling.overlong`: `truncate` (see `fit_window`), `drop` (over-long rows are left out) or `error` (they are
    kept whole and flagged in `overlong`, for the caller to report). Rows left with no trainable token
    are dropped. A chat the template cannot label (`Refused`) becomes one empty row whose `refused` says
    why, for the caller to report with its line. `token_weights` (a loss's static per-token weights,
    `WeightedTokenLoss.token_weights`) adds a `token_weights` column; weights that are not finite numbers
    >= 0, one per token, refuse the row. `turn_weighted` (some message has a weight other than 1) puts
    each turn's weight on its tokens, in `token_weights` too (times the loss's, where it has them).
    `labelling.rewritten_turns` and `labelling.prefill`: see `chat_views`. A row's first sequence counts in
    `untrained_reasoning` the trained turns whose reasoning the template does not render.

    A token is trained when its first character lies in a trained span. Where a span begins and ends is
    found by bisecting the tokens' start offsets in the tokenizer's own encoding (`TokenStarts`): every
    token's offsets become Python numbers only where the loss's token weights read them. Where an answer begins
    inside a token of the whole text (Qwen3.5's prompt ends `<think>\n`, its answers begin `\n</think>`: one `\n\n`
    token), the text is tokenised in parts at the answer's start (`split_at_answers`), as inference sees it: the
    prompt's tokens, then the answer's, every one of its characters trained.
    """
    max_length, overlong = labelling.max_length, labelling.overlong
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
            views = chat_views(tokenizer, messages, json.loads(all_tools[k]) if all_tools[k] else None, labelling,
                               render)
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
        encoding = split_at_answers(tokenizer, encodings[n], pieces[n], [a - lo for a, _, _ in spans])
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


class SplitEncoding:
    """The ids and offsets of a text tokenised in parts (`split_at_answers`), read as an `Encoding` is here."""

    def __init__(self, parts: list, starts: list[int]):
        self.ids = [i for part in parts for i in part.ids]
        self.offsets = [(a + lo, b + lo) for part, lo in zip(parts, starts) for a, b in part.offsets]

    def token_to_chars(self, i: int) -> tuple[int, int]:
        return self.offsets[i]


def split_at_answers(tokenizer, encoding, text: str, answer_starts: list[int]):
    """`encoding` of `text`, unless an answer starts inside one of its tokens (a token that begins before the answer
    and ends after its start): then the text tokenised in parts cut at every such start (`SplitEncoding`), so that
    each answer's first token is its own, as generation after the prompt makes it.

        prompt "...<think>\n" + answer "\n</think>..."  ->  [..., "<think>", "\n"] + ["\n", "</think>", ...]
    """
    starts = TokenStarts(encoding)
    cuts = []
    for a in answer_starts:
        i = starts(a)  # the first token starting at or after the answer: the one before it may straddle it
        if 0 < a < len(text) and i > 0 and encoding.token_to_chars(i - 1)[1] > a:
            cuts.append(a)
    if not cuts:
        return encoding
    bounds = [0, *sorted(set(cuts)), len(text)]
    parts = encode(tokenizer, [text[lo:hi] for lo, hi in zip(bounds, bounds[1:])])
    return SplitEncoding(parts, bounds[:-1])


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
    bad = next((i for i, w in enumerate(weights.tolist()) if not finite_number(w, nonnegative=True)), None)
    if bad is None:  # an object array of usable numbers
        return None
    return f"the loss returned {weights.tolist()[bad]!r} for token {bad}: weights must be finite numbers >= 0"
