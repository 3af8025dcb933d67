"""Row formats: the chat datasets users have, each turned into this project's row, `{"messages": [...],
"difficulty_score": ...}`, before validation (`data.format`, `data.columns`).

- `messages`: `{"messages": [{"role", "content"}, ...]}` (OpenAI / TRL conversational), as is;
- `sharegpt`: `{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}`, roles
  human/user, gpt/assistant/model, system mapped; `function_call` (its value the call's JSON) becomes an
  assistant turn with `tool_calls`, `observation` a `tool` result; `tools` may be JSON text;
- `alpaca`: `{"instruction", "input", "output", "system", "history": [[q, a], ...]}`, the user turn being
  the instruction and the input joined by a blank line;
- `prompt_completion`: `{"prompt", "completion"}`, each a string (a user turn, an assistant turn) or a
  list of messages (TRL's conversational prompt-completion).

`auto` (the default) detects the format from the first row's columns and holds the file to it: a row that
looks like another format is refused, naming it. `data.columns` maps a format's field to the file's column
(`data.columns.messages=convs`, `data.columns.score=difficulty`). Every message may carry a per-turn `weight`
(>= 0) and `train` (false: not trained), kept as they are for `sft.data`'s validation; ShareGPT's turns too.

    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4", "weight": 2}]}
        ->  {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "weight": 2}]}
"""

from __future__ import annotations

import json

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion")
# each format's fields (the first: the one that must be there), as `data.columns` names them
FIELDS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("output", "instruction", "input", "system", "history"),
    "prompt_completion": ("completion", "prompt"),
}
COLUMN_KEYS = ("score", *sorted({f for fields in FIELDS.values() for f in fields}))
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system"}
TURN_KEYS = ("weight", "train")  # per-turn control, passed through every format


class FormatError(ValueError):
    """A row that its format cannot turn into messages: the field (the file's name for it) and why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def detect(row: dict, columns: dict) -> str | None:
    """The format whose required column the row has (None: no format's), in the order of `FIELDS`."""
    return next((fmt for fmt, fields in FIELDS.items() if columns.get(fields[0], fields[0]) in row), None)


class RowFormat:
    """Turns the rows of one file into `{"messages", "difficulty_score", ...other columns}` (`__call__`)."""

    def __init__(self, fmt: str = "auto", columns: dict | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
        # the fields whose column is named (a null in `data.columns`: the field's own name)
        self.fmt, self.columns = fmt, {k: v for k, v in dict(columns or {}).items() if v is not None}
        self.chosen = None if fmt == "auto" else fmt  # auto: the first row's format, for the whole file

    def name(self, field: str) -> str:
        """The file's column for one of the format's fields."""
        return self.columns.get(field, "difficulty_score" if field == "score" else field)

    def __call__(self, row) -> dict:
        if not isinstance(row, dict):
            raise FormatError("row", f"must be a JSON object, got {type(row).__name__}")
        found = detect(row, self.columns)
        if self.chosen is None:
            if found is None:
                wanted = ", ".join(f"{self.name(f[0])} ({fmt})" for fmt, f in FIELDS.items())
                raise FormatError("row", f"no column of a known format: expected one of {wanted} (data.format, "
                                         "data.columns)")
            self.chosen = found
        elif self.fmt == "auto" and found is not None and found != self.chosen:
            raise FormatError("row", f"a {found} row in a file whose first row is {self.chosen}: a file holds one "
                                     "format")
        required = self.name(FIELDS[self.chosen][0])
        if required not in row:
            raise FormatError(required, f"missing (data.format={self.chosen}; data.columns maps a column of another "
                                        "name)")
        own = {self.name(f) for f in FIELDS[self.chosen]} | {self.name("score")}
        out = {k: v for k, v in row.items() if k not in own}
        if isinstance(out.get("tools"), str):  # LLaMA-Factory keeps the definitions as JSON text
            try:
                out["tools"] = json.loads(out["tools"]) if out["tools"].strip() else None
            except json.JSONDecodeError as e:
                raise FormatError("tools", f"not JSON ({e.msg} at column {e.colno})") from None
        out["messages"] = getattr(self, f"_{self.chosen}")(row)
        score = self.name("score")
        if score in row:
            out["difficulty_score"] = row[score]
        return out

    def _messages(self, row: dict):
        return row[self.name("messages")]  # validated as messages by sft.data

    def _sharegpt(self, row: dict) -> list[dict]:
        field = self.name("conversations")
        turns = row[field]
        if not isinstance(turns, list) or not turns:
            raise FormatError(field, "must be a non-empty list of {from, value} objects")
        messages = []
        for i, turn in enumerate(turns):
            where = f"{field}[{i}]"
            if not isinstance(turn, dict):
                raise FormatError(where, "must be an object with from and value")
            for key in ("from", "value"):
                if key not in turn:
                    raise FormatError(f"{where}.{key}", "missing")
            who, control = turn["from"], {k: turn[k] for k in TURN_KEYS if k in turn}
            if who == "function_call":  # LLaMA-Factory's: the value is the call, {"name", "arguments"}, as JSON
                try:
                    call = json.loads(turn["value"]) if isinstance(turn["value"], str) else turn["value"]
                except json.JSONDecodeError as e:
                    raise FormatError(f"{where}.value", f"a function_call's value is not JSON ({e.msg})") from None
                calls = call if isinstance(call, list) else [call]
                messages.append({"role": "assistant", "content": "", **control,
                                 "tool_calls": [{"type": "function", "function": c} for c in calls]})
                continue
            if who in ("observation", "tool", "function"):
                messages.append({"role": "tool", "content": turn["value"]})
                continue
            if who not in SHAREGPT_ROLES:
                raise FormatError(f"{where}.from", f"cannot map {who!r} to a role (known: "
                                                   f"{', '.join(SHAREGPT_ROLES)})")
            messages.append({"role": SHAREGPT_ROLES[who], "content": turn["value"], **control})
        return messages

    def _alpaca(self, row: dict) -> list[dict]:
        def text(field: str, required: bool = False) -> str:
            value = row.get(self.name(field))
            if value is None and not required:
                return ""
            if not isinstance(value, str):
                raise FormatError(self.name(field), "missing" if value is None else
                                  f"must be a string, got {type(value).__name__}")
            return value

        instruction, extra_input, system = text("instruction", required=True), text("input"), text("system")
        messages = [{"role": "system", "content": system}] if system else []
        history = row.get(self.name("history")) or []
        if not isinstance(history, list):
            raise FormatError(self.name("history"), "must be a list of [instruction, answer] pairs")
        for i, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise FormatError(f"{self.name('history')}[{i}]", "must be an [instruction, answer] pair of strings")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        prompt = f"{instruction}\n\n{extra_input}" if extra_input else instruction
        return messages + [{"role": "user", "content": prompt},
                           {"role": "assistant", "content": text("output", required=True)}]

    def _prompt_completion(self, row: dict) -> list[dict]:
        parts = []
        for field, role in (("prompt", "user"), ("completion", "assistant")):
            value = row.get(self.name(field))
            if isinstance(value, str):
                parts.append([{"role": role, "content": value}])
            elif isinstance(value, list) and value:
                parts.append(value)
            else:
                raise FormatError(self.name(field), "missing" if value is None else
                                  "must be a string or a non-empty list of messages")
        prompt, completion = parts
        # TRL trains the completion only: assistant turns of a conversational prompt are context
        prompt = [{**m, "train": False} if isinstance(m, dict) and m.get("role") == "assistant" else m
                  for m in prompt]
        return prompt + completion
