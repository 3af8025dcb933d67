"""The model's chat template as the labelling reads it: `ChatRenderer` renders chats through the template compiled
once (as `apply_chat_template` does, with the tokenizer's `chat_template_kwargs`); `TemplateProfile` probes what
the template does around an answer (its stop tokens, a generation prompt's prefill, the form it reads tool-call
arguments in, notes for the user). A chat the template cannot label is `Refused`, naming the field and why. The
kwargs and stop tokens a tokenizer is given: `sft.data.chat.settings`; the string work on renderings:
`sft.data.chat.text`; where each trained answer lies in them: `sft.data.chat.turns`."""

from __future__ import annotations

import json
import logging
from functools import cached_property

from sft.data.chat.settings import chat_settings
from sft.data.chat.text import (added_tokens, common_prefix, first_stop, first_stop_with_space, listed, special_tokens,
                                token_boundary, token_start)

log = logging.getLogger(__name__)


# A plain answer text for the probes (`TemplateProfile`): no template rewrites it.
PROBE_ANSWER = "Probe answer 7."


PROBE_ARGUMENTS = {"probe_arg": "probe value"}


class Refused(ValueError):
    """A chat whose trained tokens cannot be located with this chat template: the field and why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class ChatRenderer:
    """The tokenizer's chat template as `apply_chat_template(messages, tokenize=False, ...)` renders it, with the
    settings' kwargs, without that call's per-call work (resolving the template, copying and normalising the
    messages: two thirds of its time on a short chat). The messages must be plain JSON values (`prepare`
    makes them from stored rows). Any failure of the template, its own refusal (`raise_exception`) or a Python
    error in it, is `Refused` with the template's message.

        ChatRenderer(tokenizer)([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
            == tokenizer.apply_chat_template([...], tokenize=False, add_generation_prompt=True)
    """

    def __init__(self, tokenizer, settings=None):
        self.tokenizer = tokenizer
        self.settings = settings or chat_settings(tokenizer)
        self.variables = {**tokenizer.special_tokens_map, **self.settings.kwargs}
        self._templates: dict[bool, object] = {}  # compiled, by whether tools are given (a template may be named)
        self._context: dict[bool, dict] = {}  # each one's globals and the variables, merged once

    def __call__(self, messages: list[dict], tools: list[dict] | None = None,
                 add_generation_prompt: bool = False) -> str:
        try:
            return self._render(messages, tools, add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template is code: TypeError, RecursionError, ... as well as its own
            converted = self._in_the_form_that_renders(messages, tools, add_generation_prompt)
            if converted is not None:  # its tool calls' arguments in the form this template takes
                return converted
            raise self._refusal(e, messages, tools, add_generation_prompt) from e

    def with_kwargs(self, kwargs: dict) -> ChatRenderer:
        """This template rendered with `kwargs` added to its own (`enable_thinking=True`): a way out a refusal tries."""
        from dataclasses import replace

        return ChatRenderer(self.tokenizer, replace(self.settings, kwargs={**self.settings.kwargs, **kwargs}))

    def _render(self, messages, tools, add_generation_prompt) -> str:
        template = self._template(tools)
        if template is None:  # transformers without the functions below: its own, slower path
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **self.settings.kwargs)
        if any("reasoning_content" in m for m in messages):
            messages = _alias_reasoning(messages)
        # What `template.render(**variables)` does, less its per-call copying of the template's globals into a new
        # dict (half of a short chat's render): they are merged with the variables once, and the context shares
        # the merged dict under this call's own values.
        context = template.new_context({**self._context[tools is not None], "messages": messages, "tools": tools,
                                        "documents": None, "add_generation_prompt": add_generation_prompt},
                                       shared=True)
        return template.environment.concat(template.root_render_func(context))

    def _refusal(self, error: Exception, messages, tools, add_generation_prompt) -> Refused:
        """The template's failure as a refusal naming its message; `tools` when it fails on the row's tool
        definitions (the chat renders with well-formed ones)."""
        from jinja2 import TemplateError

        if isinstance(error, TemplateError) and not isinstance(error, _undefined_errors()):
            return Refused("messages", f"the chat template refuses this chat: {error} (data.on_error=skip leaves such "
                           "rows out, counted, and trains the others)")
        message = f"{type(error).__name__}: {str(error)[:300]}"
        if tools is not None:
            try:  # the chat with definitions known to be well-formed instead of the row's
                self._render(messages, _PROBE_TOOLS, add_generation_prompt)
            except Exception:  # noqa: BLE001 - it fails with them too: the chat is the cause
                pass
            else:
                return Refused("tools", f"the chat template fails on these tool definitions ({message}); it may "
                               "expect another form of them (each {type: function, function: {name, description, "
                               "parameters}} with JSON-schema types)")
        return Refused("messages", f"the chat template fails on this chat ({message})"
                       + ("; a tool-use template may need the row's tools" if tools is None and "NoneType" in message
                          else ""))

    def _in_the_form_that_renders(self, messages, tools, add_generation_prompt) -> str | None:
        """Where the chat has tool calls and fails, its rendering with their arguments in the other form (`text`: JSON
        strings, `object`) where that renders: the form the template takes, which its probe could not tell (Apertus's
        first import concatenated them as text, `TypeError: can only concatenate str (not "dict") to str`; the probe
        chat was refused by the template on other grounds). None where the other form fails too."""
        calls = [c for m in messages for c in m.get("tool_calls") or [] if isinstance(c, dict) and "function" in c]
        forms = {"text" if isinstance(c["function"].get("arguments"), str) else "object" for c in calls}
        if len(forms) != 1:
            return None
        other = "object" if forms == {"text"} else "text"
        try:
            converted = [{**m, "tool_calls": [self._in_form(c, other) for c in m["tool_calls"]]}
                         if m.get("tool_calls") else m for m in messages]
            return self._render(converted, tools, add_generation_prompt)
        except Exception:  # noqa: BLE001 - the other form fails too: the arguments are not the cause
            return None

    @staticmethod
    def _in_form(call: dict, form: str) -> dict:
        """A call with its `arguments` as an object or as their JSON text."""
        arguments = call["function"].get("arguments")
        converted = (json.dumps(arguments, ensure_ascii=False) if form == "text" and not isinstance(arguments, str)
                     else json.loads(arguments) if form == "object" and isinstance(arguments, str) else arguments)
        return {**call, "function": {**call["function"], "arguments": converted}}

    def compile(self) -> None:
        """Compile the template now: a syntax error is jinja's `TemplateSyntaxError`, not a refusal of each chat."""
        self._template(None)

    def _template(self, tools):
        key = tools is not None
        if key not in self._templates:
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template
            except ImportError:
                self._templates[key] = None
            else:
                self._templates[key] = template = _compile_jinja_template(self.tokenizer.get_chat_template(None, tools))
                self._context[key] = {**template.globals, **self.variables}  # what every render of it sees
        return self._templates[key]

    @cached_property
    def profile(self) -> TemplateProfile:
        return TemplateProfile(self)

    def prepare(self, messages: list[dict]) -> list[dict]:
        """Stored messages (`sft.data`'s rows) as the template takes them: tool calls decoded from their JSON text,
        each call's `arguments` in a form the template renders (`TemplateProfile.arguments`: the row's own, an
        object or its JSON text, unless the template needs the other), no `weight`, and no null values but a
        tool-calling turn's null `content` (OpenAI's form, which some templates test for)."""
        out = []
        for m in messages:
            message = {k: v for k, v in m.items()
                       if k != "weight" and (v is not None or (k == "content" and m.get("tool_calls")))}
            calls = message.get("tool_calls")
            if isinstance(calls, str):
                calls = json.loads(calls)
            if calls:
                message["tool_calls"] = [self._call(c) for c in calls]
                if message["content"] is None and not self.profile.null_content:
                    message["content"] = ""
            out.append(message)
        return out

    def prepare_tools(self, tools: list[dict] | None) -> list[dict] | None:
        """A row's tool definitions in a form the template shows (`TemplateProfile.definitions`), each as it is where
        its form is shown: [{"type": "function", "function": {"name": "f", ...}}] -> [{"name": "f", ...}] (Apertus)"""
        shown = self.profile.definitions if tools else ()
        return [_definition(t, shown) for t in tools] if shown else tools

    def _call(self, call: dict) -> dict:
        form = "text" if isinstance(call["function"].get("arguments"), str) else "object"
        usable = self.profile.arguments
        if form in usable or not usable:
            return call
        return self._in_form(call, usable[0])


def _undefined_errors() -> tuple:
    """jinja's UndefinedError: a template reading what the chat lacks, a failure rather than a refusal."""
    from jinja2 import UndefinedError

    return (UndefinedError,)


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """What `apply_chat_template` shows a template of a message's reasoning: also as `thinking` (gpt-oss's name)."""
    try:
        from transformers.utils.chat_template_utils import _alias_reasoning_fields
    except ImportError:
        return [{"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m for m in messages]
    return _alias_reasoning_fields(messages)


def prompt_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The generation prompt for a chat's stored messages (`sft.data`'s rows), as the labelling renders it: the
    chat with the template's kwargs and the generation prompt (a prefill included: the model answers after it)."""
    render = ChatRenderer(tokenizer)
    return render(render.prepare(messages), render.prepare_tools(tools), add_generation_prompt=True)


def stop_token_ids(tokenizer) -> list[int]:
    """The ids of the tokens that end a generated answer: the model's stop tokens and, where the template ends its
    turns with another token, that one (`TemplateProfile.end_of_turn`)."""
    render = ChatRenderer(tokenizer)
    tokens = list(render.profile.stops)
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


class TemplateProfile:
    """What a chat template does around an answer, found by rendering a probe chat (user, answer, user) once:

    - `stops`: the tokens a turn ends at: the model's stop tokens, and the template's own `end_of_turn` token
      where no stop token of the model closes an answer (a base model's eos under a ChatML template);
    - `prefill`: text the generation prompt adds that an answer as the template renders it does not begin with
      (`<think>\\n` of DeepSeek-R1 distills and QwQ, an empty thinking block), or "";
    - `arguments`: the forms of tool-call arguments it renders as JSON (`object`, `text`), found when first asked;
    - `notes`: what a user should know (a turn end that is no stop token of the model, no end at all: `no_end`).
    """

    def __init__(self, render: ChatRenderer):
        self.render = render
        settings = render.settings
        self.model_stops = tuple(settings.stop_tokens)
        self.end_of_turn: str | None = None
        self.prefill = ""
        self.notes: list[str] = []
        self.final_end = self.chat_end = ""  # what follows the probe answer in a chat that ends with it, goes on
        self.no_end = False  # the template ends an answer with no token the model could stop at (a note says so)
        try:
            try:
                self._probe(None)
            except Refused:  # a tool-use template may need tools even for a plain answer
                self._probe(_PROBE_TOOLS)
        except Refused as e:  # a template that refuses the probe chat: rows will say why
            self.notes.append(f"the probe chat could not be rendered ({e})")
        self.stops = self.model_stops + ((self.end_of_turn,) if self.end_of_turn else ())

    @cached_property
    def following(self) -> dict[str, str]:
        """The stop token (and the white space before it) the template writes after an answer (`answer`) and after
        a tool-calling turn (`call`) once the chat goes on, where it writes none within the turn (GLM's next role
        token); "" where it writes none."""
        out = {}
        for kind, chat, more, tools in (("answer", [_PROBE_USER, _PROBE_ANSWER], _PROBE_NEXT, (None, _PROBE_TOOLS)),
                                        ("call", [_PROBE_USER, _probe_call(self._arguments())], _PROBE_RESULT,
                                         (_PROBE_TOOLS,))):
            out[kind] = ""
            for given in tools:  # (a tool-use template may need tools even for a plain answer)
                try:
                    final, going_on = self.render(chat, given), self.render(chat + [more], given)
                except Refused:
                    continue
                k = token_boundary(final, common_prefix(final, going_on), added_tokens(self.render.tokenizer))
                if first_stop(final[k:], self.stops) is None:
                    # the first stop token before the next message, with the white space before it: right after the
                    # turn, or after what the template adds to it once the chat goes on (Apriel's call ids)
                    rest = going_on[k:]
                    nxt = rest.find(more["content"])
                    out[kind] = first_stop_with_space(rest[:nxt] if nxt >= 0 else rest, self.stops)
                break
        return out

    def _probe(self, tools) -> None:
        render, name = self.render, self.render.settings.template_name
        user, answer = _PROBE_USER, _PROBE_ANSWER
        prompt = render([user], tools, add_generation_prompt=True)
        final = render([user, answer], tools)
        going_on = render([user, answer, _PROBE_NEXT], tools)
        at = final.find(PROBE_ANSWER)
        if at < 0 or going_on.find(PROBE_ANSWER) != at:
            return
        self.final_end = final[at + len(PROBE_ANSWER):]
        self.chat_end = going_on[at + len(PROBE_ANSWER):]
        if not final.startswith(prompt):
            k = token_boundary(prompt, common_prefix(prompt, final), added_tokens(render.tokenizer))
            self.prefill = prompt[token_start(render.tokenizer, prompt, k):]
        specials = special_tokens(render.tokenizer)
        shared = self.final_end[:common_prefix(self.final_end, self.chat_end)]
        if first_stop(self.final_end, self.model_stops) or any(self.chat_end.lstrip().startswith(t)
                                                                 for t in self.model_stops):
            return
        # No stop token of the model after an answer: the template's own end-of-turn token, the first special token
        # an answer is followed by whether or not the chat goes on.
        own = next((t for _, t in sorted((shared.find(t), t) for t in specials if t in shared)), None)
        if own is not None:
            self.end_of_turn = own
            self.notes.append(f"{name} ends an answer with {own!r}, which is not among the model's stop tokens "
                              f"({listed(self.model_stops)}: {render.settings.stops_from}): {own!r} is trained as the "
                              "end of every answer, and a server must stop at it (add its id to "
                              "generation_config.json's eos_token_id, or set tokenizer.stop_tokens)")
        else:
            self.no_end = True
            self.notes.append(f"{name} writes no token after an answer that the model could learn to stop at (after "
                              f"an answer: {self.final_end[:40]!r}; the model's stop tokens: "
                              f"{listed(self.model_stops)}): the model will not learn to stop; set "
                              "tokenizer.chat_template to a template that ends turns with an end-of-turn token, or "
                              "tokenizer.stop_tokens")

    @cached_property
    def arguments(self) -> tuple[str, ...]:
        """The forms of a tool call's `arguments` the template renders: `object` (it serialises them, `| tojson`, or
        writes their keys and values) and/or `text` (it writes them as they are, or needs a string); only `object`
        where it renders both but differently (GLM-4.5's fallback for text); () where neither renders."""
        usable, renderings = [], []
        for form, arguments in (("object", PROBE_ARGUMENTS), ("text", json.dumps(PROBE_ARGUMENTS))):
            try:
                rendered = self.render([_PROBE_USER, _probe_call(arguments)], _PROBE_TOOLS)
            except Refused:
                continue
            # The value shown in the call (after the question: the definitions, before it, may be any repr), not in
            # Python's repr of the dict ({'probe_arg': ...}) nor escaped inside a JSON string; a Python-call form
            # (LFM2.5's probe_tool(probe_arg='probe value')) reads it
            call = rendered[rendered.rfind(_PROBE_USER["content"]):]
            if "probe value" in call and "'probe_arg'" not in call and '\\"probe value\\"' not in call:
                usable.append(form)
                renderings.append(rendered)
        if len(renderings) == 2 and renderings[0] != renderings[1]:
            return ("object",)  # it reads the two differently (a fallback for text): the form chat templates document
        return tuple(usable)

    def _arguments(self):
        """The probe call's arguments in a form the template reads."""
        return json.dumps(PROBE_ARGUMENTS) if self.arguments == ("text",) else PROBE_ARGUMENTS

    @cached_property
    def definitions(self) -> tuple[str, ...]:
        """The forms of tool definitions the template shows in the prompt (their name and parameters): `openai`
        ({type: function, function: {name, description, parameters}}) and/or `bare` ({name, ...}: Apertus's)."""
        shown = []
        for form, tools in (("openai", _PROBE_TOOLS), ("bare", [t["function"] for t in _PROBE_TOOLS])):
            try:
                prompt = self.render([_PROBE_USER], tools, add_generation_prompt=True)
            except Refused:
                continue
            if "probe_tool" in prompt and "probe_arg" in prompt:
                shown.append(form)
        return tuple(shown)

    @cached_property
    def null_content(self) -> bool:
        """Whether the template renders a tool-calling turn whose `content` is null (OpenAI's form): some test for
        it (DeepSeek's `is none`), others would add the null to text and fail, or write it out."""
        chats = [[_PROBE_USER, {**_probe_call(self._arguments()), "content": content}, _PROBE_RESULT, _PROBE_ANSWER]
                 for content in (None, "")]
        try:
            null, empty = (self.render(chat, _PROBE_TOOLS) for chat in chats)
        except Refused:
            return False
        # not written out: as Python's "None" (GLM's, MiniMax's) nor JSON's "null" (LFM2's `content | tojson`)
        return all(null.count(word) == empty.count(word) for word in ("None", "null"))


# The probe chats: a question, an answer, the next question; a call of a tool and its result.
_PROBE_USER = {"role": "user", "content": "Probe question?"}
_PROBE_ANSWER = {"role": "assistant", "content": PROBE_ANSWER}
_PROBE_NEXT = {"role": "user", "content": "Next question?"}
# The probe call's id: 9 letters and digits, the one form every template takes (Mistral's refuse any other)
PROBE_ID = "call00000"
_PROBE_RESULT = {"role": "tool", "content": "Probe result.", "tool_call_id": PROBE_ID, "name": "probe_tool"}
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"probe_arg": {"type": "string"}}}}}]


def _probe_call(arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": PROBE_ID, "type": "function", "function": {"name": "probe_tool", "arguments": arguments}}]}


def _definition(tool: dict, shown: tuple[str, ...]) -> dict:
    """One tool definition in a form of `shown` (`openai` or `bare`), left as it is where its own is shown."""
    inner = tool["function"] if tool.get("type") == "function" and isinstance(tool.get("function"), dict) else None
    if (inner is not None and "openai" in shown) or (inner is None and "bare" in shown):
        return tool
    return inner if inner is not None else {"type": "function", "function": tool}


