"""Overrides as sft prints them: each one parses in Hydra's override grammar as printed and pastes into a shell.

A value Hydra reads unquoted (`true`, `2e-4`, `drop`, `a/b.jsonl`) stays bare; any other string is quoted for Hydra
(`"<|im_end|>"`), and an override holding what a shell would read (`<`, `|`, `[`, spaces, quotes) is quoted for the
shell too:

    override("tokenizer.stop_tokens", ["<|assistant_end|>", "<|tools_suffix|>"])
      -> 'tokenizer.stop_tokens=["<|assistant_end|>","<|tools_suffix|>"]'
    override("tokenizer.chat_template_kwargs.enable_thinking", True, add=True)
      -> +tokenizer.chat_template_kwargs.enable_thinking=true

`quoted(text)` turns an override Hydra cannot parse (`key=[<|a|>,<|b|>]`) into the form it can, for the one line that
says so. Imports nothing heavy (the config's base).
"""

from __future__ import annotations

import re

BARE = re.compile(r"^[A-Za-z0-9_./:\-+@%~]+$")  # what Hydra's grammar reads as an unquoted value (ASCII)
SHELL_SAFE = re.compile(r"^[A-Za-z0-9_./:\-+=@%,~]+$")  # what a shell passes on unchanged


def value_text(value) -> str:
    """A value in Hydra's grammar: booleans and None as Hydra writes them, numbers as they are, a list element by
    element, a string bare where the grammar reads it so, else in double quotes."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{value_text(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if BARE.match(text) and text.lower() not in ("true", "false", "null"):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def shell(text: str) -> str:
    """An override as it pastes into a shell: as it is where a shell leaves it so, else in single quotes."""
    if SHELL_SAFE.match(text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def override(key: str, value, add: bool = False) -> str:
    """`key=value` (`+key=value` to add a key) that Hydra parses and a shell passes on as printed."""
    return shell(f"{'+' if add else ''}{key}={value_text(value)}")


def quoted(text: str) -> str | None:
    """An override Hydra could not parse, with its values quoted as the grammar needs (a list's elements each), as it
    pastes into a shell; None where quoting would not make it parse (no `=`)."""
    key, sep, value = text.partition("=")
    if not sep:
        return None
    value = value.strip()
    if value.startswith("[") and value.endswith("]"):
        items = [item.strip() for item in value[1:-1].split(",") if item.strip()]
        return shell(f"{key}=[{','.join(unquoted_text(item) for item in items)}]")
    return shell(f"{key}={unquoted_text(value)}")


def unquoted_text(item: str) -> str:
    """One value as typed (perhaps already quoted) in Hydra's grammar."""
    if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"":
        item = item[1:-1]
    return value_text(item)
