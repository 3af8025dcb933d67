"""Chats the chat tests share (plain, reasoning, tool-calling) and how they read what a chat trains: the
decoded runs of labelled tokens of each sequence, and each family's answers as its template writes them."""

import json

from chat_templates import FAMILIES, QUIRKS
from conftest import labelled_runs

from sft.data.chat.template import stop_token_ids
from sft.data.spec import Labelling
from sft.data.tokens.labels import tokenize_batch

SYSTEM = {"role": "system", "content": "Be brief."}


TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "3 and 3 make 6."},
]


def trained_runs(tokenizer, messages, **knobs) -> list[list[str]]:
    """For each sequence a chat trains as, the decoded runs of consecutive labelled tokens (`knobs`: `Labelling`'s)."""
    out = tokenize_batch({"messages": [messages], "difficulty_score": [1.0], "source_line": [7]}, tokenizer,
                         Labelling(max_length=4096, **knobs)).to_pydict()
    assert not any(out["refused"]), out["refused"]
    return [[tokenizer.decode(run, skip_special_tokens=False) for run in labelled_runs(ids, labels)]
            for ids, labels in zip(out["input_ids"], out["labels"])]


def expected(family: str, answers: list[tuple[str, str]]) -> list[str]:
    spec = FAMILIES[family]
    texts = [spec["answer"].format(a=a, r=r) for a, r in answers]
    if "last_answer" in spec:
        texts[-1] = spec["last_answer"].format(a=answers[-1][0], r=answers[-1][1])
    return texts


PLAIN = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def call(arguments) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


AGENT = [{"role": "user", "content": "Weather in Paris?"}, call('{"city": "Paris"}'),
         {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"},
         {"role": "assistant", "content": "It is 18 C."}]


def labelled(tokenizer, messages, tools=None, **knobs) -> list[list[str]]:
    """The decoded runs of labelled tokens of each sequence a chat trains as (through the tokens, as training
    gets them; `knobs`: `Labelling`'s)."""
    batch = {"messages": [messages], "difficulty_score": [1.0], "source_line": [1],
             "tools": [json.dumps(tools) if tools else ""]}
    out = tokenize_batch(batch, tokenizer, Labelling(max_length=4096, **knobs)).to_pydict()
    assert not any(out["refused"]), out["refused"]
    return [[tokenizer.decode(run, skip_special_tokens=False) for run in labelled_runs(ids, labels)]
            for ids, labels in zip(out["input_ids"], out["labels"])]


def answers(family: str, *texts: str) -> list[str]:
    """Each answer as the family's template writes it, through its stop token: the oracle."""
    return [QUIRKS[family]["answer"].format(a=a) for a in texts]


REASONED_CHAT = [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]


def tokenizer_stop(tokenizer) -> list[str]:
    return tokenizer.convert_ids_to_tokens(stop_token_ids(tokenizer))
