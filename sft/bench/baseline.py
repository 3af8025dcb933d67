"""The labelling of sft 0.1 (data version 3), kept as it was: `python -m sft.bench`'s baseline for the tokenising
ratio (`tokenize_vs_baseline`), and the reference `tests/data/test_labels.py` holds `sft.data.tokens.labels.tokenize_batch` to.

It renders the chat template through `apply_chat_template` 2 x (trained turns) + 1 times a row and converts
every token's character offsets to numpy; `sft.data.tokens.labels.tokenize_batch` gives the same rows faster (see its docstring).
"""

from __future__ import annotations

import json
from typing import Callable

import numpy as np

from sft.data.chat.template import Refused
from sft.data.chat.text import divergence, tool_name
from sft.data.tokens.batch import IGNORE_INDEX
from sft.data.tokens.labels import _bad_token_weights, fit_window, row_fields, token_reach, tokenized_part


def render(tokenizer, messages: list[dict], **kwargs) -> str:
    """The chat template's text for `messages`; a template's own refusal (`raise_exception`) is `Refused`."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateError as e:
        raise Refused("messages", f"the chat template refuses this chat: {e}") from e


def chat_views(tokenizer, messages: list[dict], rewritten_turns: str = "split",
               tools: list[dict] | None = None) -> list[tuple[str, list[tuple[int, int, float]]]]:
    """`sft.data.chat.turns.chat_views`, each prefix of the chat rendered through `apply_chat_template`."""
    weights = [m.get("weight", 1.0) if m["role"] == "assistant" else 0.0 for m in messages]
    messages = [{k: _objects(json.loads(v)) if k == "tool_calls" and isinstance(v, str) else v for k, v in m.items()
                 if v is not None and k != "weight"} for m in messages]
    full = render(tokenizer, messages, tools=tools)
    missing = [name for name in map(tool_name, tools or []) if name and name not in full]
    if missing:
        raise Refused("tools", f"the chat template does not render the tool definitions ({missing[0]!r} "
                      "is not in the chat's text): the model would learn to call tools it is never shown; set "
                      "tokenizer.chat_template to one that renders tools")
    whole_chat, own_texts = [], []
    for i, m in enumerate(messages):
        if weights[i] == 0:  # context: not trained
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        through = render(tokenizer, messages[: i + 1], tools=tools)
        end = len(through.rstrip())
        if not through.startswith(prompt) or end <= len(prompt):
            raise Refused(f"messages[{i}]", "the chat template renders the chat before this turn differently "
                          f"once the turn is added ({divergence(prompt, through)}), so the turn cannot be "
                          "located; set tokenizer.chat_template to a template that keeps earlier text unchanged")
        for call in m.get("tool_calls") or []:
            if call["function"]["name"] not in through[len(prompt):end]:
                raise Refused(f"messages[{i}].tool_calls", "the chat template does not render this turn's tool call "
                              f"({call['function']['name']!r}): the turn would train without it; set "
                              "tokenizer.chat_template to one that renders tool calls")
        end_in_full = _end_in_whole_chat(through[:end], full, tokenizer.eos_token)
        if end_in_full is not None:
            whole_chat.append((len(prompt), end_in_full, weights[i]))
        elif rewritten_turns == "refuse":
            raise Refused(f"messages[{i}]", "the chat template renders this turn differently once later turns "
                          f"follow ({divergence(through, full)}); data.rewritten_turns=split trains it from its "
                          "own rendering, skip leaves it untrained")
        elif rewritten_turns == "split":
            own_texts.append((through, [(len(prompt), end, weights[i])]))
    return ([(full, whole_chat)] if whole_chat else []) + own_texts


def _objects(calls: list[dict]) -> list[dict]:
    """Tool calls with their `arguments` an object, as sft 0.1 stored them."""
    return [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            if isinstance(c["function"].get("arguments"), str) else c for c in calls]


def _end_in_whole_chat(turn: str, full: str, eos: str | None) -> int | None:
    """Where `turn` (the chat rendered through an assistant turn) ends in the whole chat's rendering, if
    that shows it unchanged; else None. A final `eos` that a template adds at the end of a chat is not
    part of a turn that later turns follow."""
    if full.startswith(turn):
        return len(turn)
    if eos and turn.endswith(eos) and full.startswith(head := turn[: -len(eos)].rstrip()):
        return len(head)
    return None


def tokenize_batch(batch: dict, tokenizer, max_length: int, overlong: str = "truncate",
                   rewritten_turns: str = "split", token_weights: Callable | None = None,
                   turn_weighted: bool = False) -> dict:
    """`sft.data.tokens.labels.tokenize_batch` as it was: a dict of Python lists, every token's offsets in numpy."""
    out = {"input_ids": [], "labels": [], "difficulty_score": [], "source_line": [], "extra": [], "view": [],
           "truncated": [], "overlong": [], "refused": []}
    weighted = token_weights is not None or turn_weighted
    if weighted:
        out["token_weights"] = []
    extras = batch.get("extra") or [""] * len(batch["messages"])

    def emit(k, ids, labels, view, truncated=False, too_long=False, refused="", weights=None):
        for key, value in (("input_ids", ids), ("labels", labels), ("difficulty_score", batch["difficulty_score"][k]),
                           ("source_line", batch["source_line"][k]), ("extra", extras[k]), ("view", view),
                           ("truncated", truncated), ("overlong", too_long), ("refused", refused)):
            out[key].append(value)
        if weighted:
            out["token_weights"].append(np.ones(len(ids), dtype=np.float32) if weights is None else weights)

    texts, pieces, where = [], [], []  # every text of the batch, the part of it tokenised, its row and spans
    reach = token_reach(tokenizer, max_length)
    all_tools = batch.get("tools") or [""] * len(batch["messages"])
    for k, messages in enumerate(batch["messages"]):
        try:
            views = chat_views(tokenizer, messages, rewritten_turns, json.loads(all_tools[k]) if all_tools[k] else None)
        except Refused as e:
            emit(k, [], [], 0, refused=f"{e.field}\t{e.reason}")
            continue
        for view, (text, spans) in enumerate(views):
            lo, hi = tokenized_part(len(text), spans[-1][0], reach)
            texts.append(text)
            pieces.append(text[lo:hi] if (lo, hi) != (0, len(text)) else text)
            where.append((k, view, spans, lo))
    enc = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True, truncation=False) if texts else None
    refused_rows = set()
    for n, (k, view, spans, lo) in enumerate(where):
        if k in refused_rows:
            continue
        ids = enc["input_ids"][n]
        offsets = np.asarray(enc["offset_mapping"][n], dtype=np.int64).reshape(-1, 2) + lo  # into the whole text
        starts = offsets[:, 0]
        trained = np.zeros(len(ids), dtype=bool)
        turn = np.ones(len(ids), dtype=np.float32) if turn_weighted else None
        for a, b, w in spans:
            in_turn = (starts >= a) & (starts < b)
            trained |= in_turn
            if turn is not None:
                turn[in_turn] = w
        weights = turn
        if token_weights is not None:
            weights = token_weights(texts[n], offsets, row_fields(batch["difficulty_score"][k], extras[k]))
            weights = np.ones(len(ids), dtype=np.float32) if weights is None else weights
            problem = _bad_token_weights(weights, len(ids))
            if problem:
                refused_rows.add(k)
                emit(k, [], [], 0, refused=f"loss.token_weights\t{problem}")
                continue
            weights = np.asarray(weights, dtype=np.float32) * (1.0 if turn is None else turn)
        too_long = len(ids) > max_length
        if too_long and overlong == "drop":
            continue
        if too_long and overlong == "truncate":
            answer_start = int(np.searchsorted(starts, spans[-1][0]))
            lo, hi = fit_window(len(ids), answer_start, max_length)
            ids, trained = ids[lo:hi], trained[lo:hi]
            weights = None if weights is None else weights[lo:hi]
        labels = np.where(trained, np.asarray(ids), IGNORE_INDEX)
        if not (labels[1:] != IGNORE_INDEX).any():  # position 0 is never a prediction target
            continue
        emit(k, list(ids), labels.tolist(), view, too_long and overlong == "truncate", too_long, weights=weights)
    return out
