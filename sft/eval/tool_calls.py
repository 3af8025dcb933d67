"""Tool-call accuracy of generated answers: the calls a model writes, read in the form its chat template writes them,
against the calls the eval row's answer makes.

The form is learned from the template itself (`CallFormat.of`): a probe call is rendered, and what stands before
the function's name, between the name and its arguments, and after them becomes the pattern the model's answers are
read with: `<tool_call>\\n{"name": "` ... `", "arguments": ` (Qwen, Hermes), `{"name": "` ... `", "parameters": `
(Llama 3.1), `[TOOL_CALLS]` ... `[ARGS]` (Mistral), and so on; where the template writes the name inside the JSON
object, the object is read whole. A call is right when its name is the reference's and its arguments, parsed as
JSON, equal the reference's; a turn when it makes exactly the reference's calls, in order. A call that opens as
the template's do but does not parse (a cut or broken JSON) is `malformed`: wrong, and shown in the samples.

    fmt = CallFormat.of(tokenizer)  # Qwen2.5: before '<tool_call>\\n{"name": "', between '", "arguments": '
    fmt.parse('<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>')
        -> [Call("get_weather", {"city": "Paris"})], malformed 0
    score([Call("get_weather", {"city": "Paris"})], reference) -> (1 right call of 1, turn right)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sft.data.chat.template import ChatRenderer, Refused

_NAME = "probe_tool"
_ARGUMENTS = {"probe_arg": "probe value"}
_TOOLS = [{"type": "function", "function": {"name": _NAME, "description": "A probe.", "parameters": {
    "type": "object", "properties": {"probe_arg": {"type": "string"}}}}}]
_USER = {"role": "user", "content": "Probe question?"}


@dataclass(frozen=True)
class Call:
    """A function call: its name and its arguments as parsed JSON."""

    name: str
    arguments: object


@dataclass(frozen=True)
class CallFormat:
    """How a template writes one call: `before` the name, `between` the name and the arguments' JSON; or, where the
    name is inside the JSON object (`inline`), `before` that object and the keys of the name and the arguments."""

    before: str
    between: str = ""
    inline: bool = False
    name_key: str = "name"
    arguments_key: str = "arguments"

    @classmethod
    def of(cls, tokenizer) -> CallFormat | None:
        """The form the tokenizer's chat template writes a call in, or None where it renders no call."""
        render = ChatRenderer(tokenizer)
        forms = render.profile.arguments
        if not forms:
            return None
        arguments = _ARGUMENTS if "object" in forms else json.dumps(_ARGUMENTS)
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": _NAME, "arguments": arguments}}]}
        try:
            prompt = render([_USER], _TOOLS, add_generation_prompt=True)
            text = render([_USER, call], _TOOLS)
        except Refused:
            return None
        turn = text[len(prompt):] if text.startswith(prompt) else text[text.rfind(_USER["content"]):]
        at_name, at_arguments = turn.find(_NAME), turn.find('"probe_arg"')
        if at_name < 0 or at_arguments < 0:
            return None
        outer = turn.rfind("{", 0, at_name)
        if outer >= 0:  # the name inside a JSON object with the arguments ({"name": ..., "arguments": {...}}): read whole
            try:
                whole, _ = json.JSONDecoder().raw_decode(turn[outer:])
            except ValueError:
                whole = None
            if isinstance(whole, dict):
                name_key = next((k for k, v in whole.items() if v == _NAME), None)
                arguments_key = next((k for k, v in whole.items() if k != name_key and _parsed(v) == _ARGUMENTS), None)
                if name_key is not None and arguments_key is not None:
                    return cls(before=_marker(turn[:outer]), inline=True, name_key=name_key,
                               arguments_key=arguments_key)
        start = turn.find("{", at_name)  # the name, then the arguments' object ([TOOL_CALLS]name[ARGS]{...})
        if start < 0 or start > at_arguments:
            return None
        return cls(before=_marker(turn[:at_name]), between=turn[at_name + len(_NAME):start])

    def parse(self, text: str) -> tuple[list[Call], int]:
        """The calls written in `text` as this template writes them, and how many more opened but did not parse."""
        decoder, calls, malformed, at = json.JSONDecoder(), [], 0, 0
        while (found := text.find(self.before or "{", at)) >= 0:
            start = found + len(self.before)
            at = start if self.before else found + 1
            try:
                call, at = self._read(decoder, text, start)
            except ValueError:
                # a call opened (its marker; with none, an object whose first key is the name's) and did not parse
                malformed += bool(self.before) or text[start:start + len(self.name_key) + 8].replace(" ", "")\
                    .startswith('{"' + self.name_key + '"')
                continue
            calls.append(call)
        return calls, malformed

    def _read(self, decoder, text: str, at: int) -> tuple[Call, int]:
        """The call that starts at `at` (right after `before`) and where it ends; ValueError where none parses."""
        if self.inline:
            obj, end = decoder.raw_decode(text, text.index("{", at))
            if not isinstance(obj, dict) or self.name_key not in obj or self.arguments_key not in obj:
                raise ValueError("not a call")
            return Call(str(obj[self.name_key]), _parsed(obj[self.arguments_key])), end
        split = text.index(self.between, at) if self.between else text.index("{", at)
        name, start = text[at:split], split + len(self.between)
        if not name or len(name) > 200 or any(c in name for c in " \n\t{}\"'") or text[start:start + 1] != "{":
            raise ValueError("no call here")
        arguments, end = decoder.raw_decode(text, start)
        return Call(name, arguments), end


def _marker(prefix: str) -> str:
    """What a call opens with: the prefix's last line (the text after the answer's own content)."""
    return prefix[prefix.rfind("\n", 0, len(prefix.rstrip("\n")) or None) + 1:] if "\n" in prefix.rstrip("\n") \
        else prefix


def _parsed(arguments):
    """Arguments as parsed JSON: an object as it is, JSON text decoded (text that is not JSON stays text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def reference_calls(message: dict) -> list[Call]:
    """The calls of a stored assistant turn (`tool_calls` as a list, or the JSON text `sft.data` keeps)."""
    calls = message.get("tool_calls") or []
    if isinstance(calls, str):
        calls = json.loads(calls)
    return [Call(c["function"]["name"], _parsed(c["function"].get("arguments"))) for c in calls]


def score(generated: list[Call], reference: list[Call]) -> tuple[int, bool]:
    """How many of the reference calls the answer makes (each generated call counts once), and whether the turn is
    right: exactly the reference's calls, in order."""
    left, right = list(generated), 0
    for call in reference:
        if call in left:
            left.remove(call)
            right += 1
    return right, generated == reference
