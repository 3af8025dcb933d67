"""Row formats: the chat datasets users have, each turned into this project's row, `{"messages": [...],
"difficulty_score": ..., "tools": [...]}`, before validation (`data.format`, `data.columns`).

- `messages`: `{"messages": [{"role", "content"}, ...]}` (OpenAI / TRL conversational), as is; a content may
  be a list of parts (OpenAI's `{"type": "text", "text"}`, LLaMA-Factory's `{"type": "text"|"reasoning"|
  "tool_call", "value"}`), joined into the text, the reasoning and the tool calls of the turn;
- `sharegpt`: `{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}`, roles
  human/user, gpt/assistant/model, system mapped; `function_call` (its value the call's JSON) becomes an
  assistant turn with `tool_calls`, `observation` a `tool` result;
- `alpaca`: `{"instruction", "input", "output", "system", "history": [[q, a], ...]}`, the user turn being
  the instruction and the input joined by a blank line;
- `prompt_completion`: `{"prompt", "completion"}`, each a string (a user turn, an assistant turn) or a
  list of messages (TRL's conversational prompt-completion).

Turns are read by their shape, whatever the column: `{role, content}` and ShareGPT's `{from, value}` both,
so `data.columns.messages=conversations` on ShareGPT rows (LLaMA-Factory's `dataset_info.json` says so) works.
Every format may have a `system` column (a system turn first) and a `tools` column (the definitions the template
renders: a list or its JSON text; empty is no tools; LLaMA-Factory's bare `{name, description, parameters}`
wrapped as `{type: function, function: ...}`).

`auto` (the default) detects the format from the first row's columns and holds the file to it: a row that
looks like another format is refused, naming it. `data.columns` maps a field to the file's column
(`data.columns.messages=convs`, `data.columns.score=difficulty`), with LLaMA-Factory's names too: `prompt`,
`query` and `response` for Alpaca's instruction, input and output. Every message may carry a per-turn
`weight` (>= 0; LLaMA-Factory's `loss_weight`) and `train` (false: not trained), kept as they are for
`sft.data`'s validation.

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
# LLaMA-Factory's dataset_info.json names for a format's fields (its `columns`), where they differ from ours
ALIASES = {"alpaca": {"output": "response", "instruction": "prompt", "input": "query"}}
COMMON = ("system", "tools")  # columns every format may have
COLUMN_KEYS = ("score", *sorted({f for fields in FIELDS.values() for f in fields} | set(COMMON)
                                | {a for aliases in ALIASES.values() for a in aliases.values()}))
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system"}
TURN_KEYS = ("weight", "train")  # per-turn control, passed through every format
TEXT_PARTS = ("text", "input_text", "output_text")
REASONING_PARTS = ("reasoning", "thinking")


class FormatError(ValueError):
    """A row that its format cannot turn into messages: the field (the file's name for it) and why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def detect(row: dict, columns: dict) -> str | None:
    """The format whose required column the row has (None: no format's), in the order of `FIELDS`."""
    return next((fmt for fmt in FIELDS if _column(columns, fmt, FIELDS[fmt][0]) in row), None)


def _column(columns: dict, fmt: str, field: str) -> str:
    """The file's column for a format's field: `data.columns` by our name or LLaMA-Factory's, else the field's name."""
    alias = ALIASES.get(fmt, {}).get(field)
    return columns.get(field) or (columns.get(alias) if alias else None) or (
        "difficulty_score" if field == "score" else field)


class RowFormat:
    """Turns the rows of one file into `{"messages", "difficulty_score", "tools", ...other columns}` (`__call__`)."""

    def __init__(self, fmt: str = "auto", columns: dict | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
        # the fields whose column is named (a null in `data.columns`: the field's own name)
        self.fmt, self.columns = fmt, {k: v for k, v in dict(columns or {}).items() if v is not None}
        self.chosen = None if fmt == "auto" else fmt  # auto: the first row's format, for the whole file

    def name(self, field: str) -> str:
        """The file's column for one of the chosen format's fields (or a column every format may have)."""
        return _column(self.columns, self.chosen or "messages", field)

    def __call__(self, row) -> dict:
        if not isinstance(row, dict):
            raise FormatError("row", f"must be a JSON object, got {type(row).__name__}")
        found = detect(row, self.columns)
        if self.chosen is None:
            if found is None:
                wanted = ", ".join(f"{_column(self.columns, fmt, f[0])} ({fmt})" for fmt, f in FIELDS.items())
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
        own = {self.name(f) for f in (*FIELDS[self.chosen], *COMMON, "score")}
        tools_field = self.name("tools")
        if tools_field == "tools" and "tools" not in row and "functions" in row:  # OpenAI's older name for them
            tools_field = "functions"
            own.add("functions")
        system_field = self.name("system")
        if system_field == "system" and "system" not in row and "system_prompt" in row:  # glaive's name for it
            system_field = "system_prompt"
            own.add("system_prompt")
        out = {k: v for k, v in row.items() if k not in own}
        out["messages"] = getattr(self, f"_{self.chosen}")(row)
        if self.chosen != "alpaca":  # (whose system field is its own)
            out["messages"] = self._with_system(row, out["messages"], system_field)
        tools = self._tools(row.get(tools_field), tools_field)
        if tools is not None:
            out["tools"] = tools
        score = self.name("score")
        if score in row:
            out["difficulty_score"] = row[score]
        return out

    def _tools(self, value, field: str) -> list | None:
        """The row's tool definitions (its column `field`: `tools`, OpenAI's older `functions`, or as `data.columns`
        maps it) as templates take them; None for none (null, "", "[]", [])."""
        if isinstance(value, str):  # LLaMA-Factory keeps the definitions as JSON text
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as e:
                raise FormatError(field, f"not JSON ({e.msg} at column {e.colno})") from None
        if value is None or value == []:
            return None
        if not isinstance(value, list):
            raise FormatError(field, "must be a list of tool definitions (or its JSON text)")
        # A bare definition ({"name", "description", "parameters"}) in the form templates read (tool.function.name)
        return [{"type": "function", "function": t} if isinstance(t, dict) and "function" not in t and "name" in t
                else t for t in value]

    def _with_system(self, row: dict, messages, field: str):
        """The row's system column (`field`: `system`, glaive's `system_prompt`, or as `data.columns` maps it), where it
        has one, as the chat's first turn."""
        system = row.get(field)
        if system is None or system == "" or not isinstance(messages, list):
            return messages
        if not isinstance(system, str):
            raise FormatError(field, f"must be a string, got {type(system).__name__}")
        first = messages[0] if messages else None
        if isinstance(first, dict) and first.get("role") == "system":
            if first.get("content") != system:
                raise FormatError(field, "the row has a system column and a different system turn: one of them")
            return messages
        return [{"role": "system", "content": system}, *messages]

    def _messages(self, row: dict):
        return self._turns(self.name("messages"), row[self.name("messages")])

    def _sharegpt(self, row: dict) -> list[dict]:
        return self._turns(self.name("conversations"), row[self.name("conversations")])

    def _turns(self, field: str, turns):
        """A chat's turns, each read by its shape: ShareGPT's `{from, value}` or a message `{role, content}`
        (validated as messages by `sft.data`)."""
        if not isinstance(turns, list) or not turns:
            if self.chosen == "messages":
                return turns  # sft.data names what is wrong with it
            raise FormatError(field, "must be a non-empty list of {from, value} objects")
        messages = []
        for i, turn in enumerate(turns):
            where = f"{field}[{i}]"
            if isinstance(turn, dict) and "role" not in turn and ("from" in turn or "value" in turn):
                messages.append(_sharegpt_turn(turn, where))
            elif isinstance(turn, dict) and "role" not in turn and self.chosen == "sharegpt":
                raise FormatError(f"{where}.from", "missing")
            elif isinstance(turn, dict):
                messages.append(_message(turn, where))
            elif self.chosen == "sharegpt":
                raise FormatError(where, "must be an object with from and value")
            else:
                messages.append(turn)
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
                parts.append(self._turns(self.name(field), value))
            else:
                raise FormatError(self.name(field), "missing" if value is None else
                                  "must be a string or a non-empty list of messages")
        prompt, completion = parts
        # TRL trains the completion only: assistant turns of a conversational prompt are context
        prompt = [{**m, "train": False} if isinstance(m, dict) and m.get("role") == "assistant" else m
                  for m in prompt]
        return prompt + completion


def _sharegpt_turn(turn: dict, where: str) -> dict:
    """A ShareGPT turn `{from, value}` as a message."""
    for key in ("from", "value"):
        if key not in turn:
            raise FormatError(f"{where}.{key}", "missing")
    who, control = turn["from"], _control(turn)
    if who == "function_call":  # LLaMA-Factory's: the value is the call, {"name", "arguments"}, as JSON
        try:
            call = json.loads(turn["value"]) if isinstance(turn["value"], str) else turn["value"]
        except json.JSONDecodeError as e:
            raise FormatError(f"{where}.value", f"a function_call's value is not JSON ({e.msg})") from None
        calls = call if isinstance(call, list) else [call]
        # OpenAI's form of a turn that only calls tools: null content (chat_template.ChatRenderer gives a
        # template that cannot take it an empty text)
        return {"role": "assistant", "content": None, **control,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}
    if who in ("observation", "tool", "function"):
        return {"role": "tool", "content": turn["value"]}
    if who not in SHAREGPT_ROLES:
        raise FormatError(f"{where}.from", f"cannot map {who!r} to a role (known: {', '.join(SHAREGPT_ROLES)})")
    return {"role": SHAREGPT_ROLES[who], "content": turn["value"], **control}


def _control(turn: dict) -> dict:
    """A turn's per-turn control: `weight` (LLaMA-Factory's `loss_weight` too) and `train`."""
    control = {k: turn[k] for k in TURN_KEYS if k in turn}
    if "weight" not in control and "loss_weight" in turn:
        control["weight"] = turn["loss_weight"]
    return control


def _message(turn: dict, where: str) -> dict:
    """A `{role, content}` message, its content parts (a list) joined into its text, reasoning and tool calls."""
    message = {k: v for k, v in turn.items() if k != "loss_weight"}
    message.update(_control(turn))
    content = turn.get("content")
    if not isinstance(content, list):
        return message
    text, reasoning, calls = [], [], list(turn.get("tool_calls") or [])
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise FormatError(at, f"must be a content part {{type, text}}, got {type(part).__name__} (or the content "
                                  "a string)")
        kind = part.get("type")
        value = part.get("text", part.get("value"))
        if kind in TEXT_PARTS + REASONING_PARTS and isinstance(value, str):
            (text if kind in TEXT_PARTS else reasoning).append(value)
        elif kind == "tool_call":
            try:
                call = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError as e:
                raise FormatError(f"{at}.value", f"a tool_call part is not JSON ({e.msg})") from None
            calls.append({"type": "function", "function": call})
        else:
            raise FormatError(at, f"a {kind!r} part: only text, reasoning and tool_call parts are trained on (a text "
                                  "part's text in 'text' or 'value')")
    message["content"] = "".join(text) if text or not calls else None
    if reasoning and "reasoning_content" not in message:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message
