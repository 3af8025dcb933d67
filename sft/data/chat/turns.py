"""Where each trained assistant turn of a chat lies: `chat_views`, the texts a chat trains as, each with the
character spans of its answers through their first stop token, as the model writes them after the rendering of
the chat before them (see docs/templates.md for the rule, and `sft.data.tokens.labels` for the tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from sft.data.chat.reasoning import REASONING_BLOCKS, open_reasoning, prefill_cause, reasoning_cause, reasoning_of
from sft.data.chat.template import ChatRenderer, Refused
from sft.data.chat.text import common_prefix, divergence, first_stop, stop_at, tool_name
from sft.data.spec import Labelling

LABELLING = Labelling()  # the defaults


class Views(list):
    """`chat_views`' texts, each `(text, [(start, end, weight), ...])`, and what the labelling noticed of the chat:
    `untrained_reasoning`, the trained turns whose reasoning the template does not render."""

    untrained_reasoning = 0


@dataclass
class _Turn:
    text: str  # the chat through the turn as the model saw and wrote it
    start: int  # where the answer begins in `text` (after the generation prompt)
    end: int  # where it ends: after its stop token
    own_text: bool = False  # `text` differs from the whole chat's rendering before the answer (a kept prefill)


def chat_views(tokenizer, messages: list[dict], tools: list[dict] | None = None, labelling: Labelling = LABELLING,
               render: ChatRenderer | None = None, advise: bool = True) -> Views:
    """The texts a chat trains as, each with the character spans of its trained assistant turns and their
    weights (a message's `weight`, as `sft.data.rows.reading.scan_jsonl` sets it: 0 leaves the turn untrained; default 1).

    An assistant turn is trained as the model generates it: after the rendering of the chat before it with the
    generation prompt, through its first stop token (`TemplateProfile.stops`) in the chat that ends with it.
    Where the turn holds none, the stop token that follows it once the chat goes on (GLM's next role token;
    for the chat's last turn, from the chat continued by a user turn) ends it, and is added to the text.
    Usually every turn is found so in the whole chat's rendering: one text.

        [user "1+1?", assistant "2", user "2+2?", assistant "4"], ChatML  ->
            [("<|im_start|>system ... assistant\\n2<|im_end|>\\n<|im_start|>user ... assistant\\n4<|im_end|>\\n",
              [(start of "2", end of its <|im_end|>, 1.0), (start of "4", end of its <|im_end|>, 1.0)])]

    Some templates render a turn differently once later turns follow (Qwen3 drops the reasoning of earlier
    answers; gpt-oss ends an earlier answer with `<|end|>`, not the `<|return|>` the model writes). Such a turn,
    by `labelling.rewritten_turns`: `split` trains it in a text of its own, the chat up to and including it (as the
    model saw it when answering); `skip` trains it not at all (it stays context); `refuse` raises `Refused`.

    A generation prompt that prefills text the answer does not begin with (`TemplateProfile.prefill`), by
    `labelling.prefill`: `refuse` (`Refused`, naming the prefill and the ways out), `after` (the answer trains after the
    prefill, as the model answers at inference: a text of its own per turn), `drop` (the answer trains as the
    template renders it in the whole chat, its prompt without the prefill). Whatever the setting, an answer is never
    trained inside a reasoning block it does not close, nor opening one its prompt already opened (`Refused`).

    A refusal's ways out are tried on the chat before they are offered (`sft.data.chat.remedies`; `advise=False`: the
    refusal alone, as the trying itself labels).

    Tool calls are part of their assistant turn and train with it; `tool` results are context. `tools` (the
    row's definitions) go to the template. A template that renders neither a turn's calls nor the tools
    (`Refused`) would train the turn without what it is for.

    Cost: 2 x (trained turns) renders (`render`, the tokenizer's `ChatRenderer` by default), the last message's
    rendering being the whole chat's, and one more for a last turn that only a following stop token ends.
    """
    render = render or ChatRenderer(tokenizer)
    rewritten_turns = labelling.rewritten_turns
    weights = [m.get("weight", 1.0) if m["role"] == "assistant" else 0.0 for m in messages]
    messages, tools = render.prepare(messages), render.prepare_tools(tools)
    full = render(messages, tools=tools)
    if tools and not definitions_shown(render, messages, tools):
        name = next((n for n in map(tool_name, tools) if n), "?")
        raise Refused("tools", f"the chat template does not render the tool definitions ({name!r} ...): the prompt "
                      "of the chat's first answer is the same with them as without, so the model would learn to call "
                      "tools it is never shown; set tokenizer.chat_template to one that renders tools")
    views, whole_chat, own_texts = Views(), [], []
    for i, m in enumerate(messages):
        if weights[i] == 0:  # context: not trained
            continue
        turn = _locate(render, messages, i, tools, full, labelling, advise)
        if turn is None:  # its prompt is rendered otherwise in the chat, and data.rewritten_turns=skip
            continue
        _refuse_misplaced_reasoning(render, messages, i, turn, tools, labelling, advise)
        answer = turn.text[turn.start:turn.end]
        for call in m.get("tool_calls") or []:
            if call["function"]["name"] not in answer:
                raise Refused(f"messages[{i}].tool_calls", "the chat template does not render this turn's tool call "
                              f"({call['function']['name']!r}): the turn would train without it; set "
                              "tokenizer.chat_template to one that renders tool calls")
        reasoning = reasoning_of(m)
        if reasoning and reasoning not in answer:
            views.untrained_reasoning += 1
        if not turn.own_text and full.startswith(turn.text[:turn.end]):
            whole_chat.append((turn.start, turn.end, weights[i]))
        elif not turn.own_text and i == len(messages) - 1:
            full = turn.text[:turn.end]  # the last answer with the stop token that follows it, added
            whole_chat.append((turn.start, turn.end, weights[i]))
        elif rewritten_turns == "refuse" and not turn.own_text:
            raise Refused(f"messages[{i}]", "the chat template renders this turn differently once later turns "
                          f"follow ({divergence(turn.text[:turn.end], full)}); data.rewritten_turns=split trains it "
                          "from its own rendering, skip leaves it untrained")
        elif rewritten_turns == "split" or turn.own_text:
            own_texts.append((turn.text, [(turn.start, turn.end, weights[i])]))
    views += ([(full, whole_chat)] if whole_chat else []) + own_texts
    return views


def _locate(render: ChatRenderer, messages: list[dict], i: int, tools, full: str, labelling: Labelling,
            advise: bool) -> _Turn | None:
    """Where assistant turn `i` is trained: its text, and the answer's start and end in it (see `chat_views`)."""
    prefill = labelling.prefill
    prompt = render(messages[:i], tools=tools, add_generation_prompt=True)
    last = i == len(messages) - 1
    through = full if last else render(messages[: i + 1], tools=tools)
    text, start, own_text = through, len(prompt), False
    if not through.startswith(prompt):
        tail = render.profile.prefill  # the generation prompt's prefill, which this answer does not begin with
        k = len(prompt) - len(tail)
        if not tail or not prompt.endswith(tail) or not through.startswith(prompt[:k]):
            placed = _after_own_prompt(render, messages, i, tools, prompt, through, labelling, advise)
            if placed is None:
                return None
            text, start, own_text = placed, len(prompt), True
        elif prefill == "refuse":
            reasoning = reasoning_of(messages[i])
            cause = reasoning_cause(render, tail, through[k:], reasoning) if reasoning else prefill_cause(tail)
            raise Refused(f"messages[{i}]", f"the chat template's generation prompt ends with {tail!r}, which this "
                          f"answer does not begin with as the template renders it ({through[k:k + 30]!r}): the model "
                          f"answers after it at inference.{' ' + cause + '.' if cause else ''}"
                          + _ways_out(render, messages, i, tools, labelling, advise))
        elif prefill == "after":  # what the prefill already wrote is not written twice (DeepSeek-V3.2's </think>)
            rest = through[k:]
            overlap = next((n for n in range(len(tail), 0, -1) if rest.startswith(tail[-n:])), 0)
            text, own_text = prompt + rest[overlap:], True
        else:
            start = k
    profile = render.profile
    stop = first_stop(text[start:], profile.stops)
    if stop is not None:
        return _Turn(text, start, start + stop[0], own_text)
    # No stop token in the turn as the template renders it: the one that follows once the chat goes on (in the
    # whole chat; after the last turn, or one the whole chat shows otherwise, as the template writes it after an
    # answer or a call once the chat goes on, `TemplateProfile.following`).
    end = start + len(text[start:].rstrip())
    if end <= start:
        raise Refused(f"messages[{i}]", "the chat template renders this turn as no text")
    following = stop_at(full[end:], profile.stops) if not last and full.startswith(text[:end]) else None
    following = following or profile.following["call" if messages[i].get("tool_calls") else "answer"]
    if following:
        return _Turn(text[:end] + following, start, end + len(following), own_text)
    if messages[i].get("tool_calls"):
        _refuse_call_without_stop(render, i, text[start:end])
    return _Turn(text, start, end, own_text)  # no stop at all: `TemplateProfile.notes` says so once


def _refuse_call_without_stop(render: ChatRenderer, i: int, call: str) -> None:
    """Refuse a tool-calling turn the template ends with no stop token, in the chat or once it goes on (Apertus's
    `<|tools_prefix|>...<|tools_suffix|>`, followed by the tool's result in the same turn): trained so, the model
    would write on past its call instead of stopping for the result. Where the call ends with a special token of its
    own, the refusal names the stop tokens that would train it (that token added, where the server stops there)."""
    from sft.config.overrides import override
    from sft.data.chat.text import special_tokens

    stops = render.profile.stops
    ending = next((t for t in special_tokens(render.tokenizer) if call.rstrip().endswith(t)), None)
    if ending is not None and len(render.tokenizer.encode(ending, add_special_tokens=False)) == 1:
        way = (f"where the model's server stops at {ending!r} after a call (to run the tool), add it to the stop "
               f"tokens: {override('tokenizer.stop_tokens', [*stops, ending])}; else set ")
    else:
        way = "set "
    raise Refused(f"messages[{i}]", f"the chat template ends this tool-calling turn with no token the model could stop "
                  f"at ({call[-100:]!r}; the stop tokens: {', '.join(map(repr, stops)) or 'none'}), nor writes one "
                  "once the chat goes on: the model would learn to write on past its call instead of stopping for the "
                  f"tool's result; {way}tokenizer.chat_template to a template that ends calls with a stop token")


def _after_own_prompt(render: ChatRenderer, messages: list[dict], i: int, tools, prompt: str, through: str,
                      labelling: Labelling, advise: bool) -> str | None:
    """A turn whose prompt the template renders otherwise once the turn follows (Hermes-3 writes a last tool result
    without the newline it writes before a following turn), by `rewritten_turns`: `split`, its text of its own, the
    prompt the model answers and the answer after it (found in the chat through the turn after the generation
    prompt); `skip`, None (untrained); `refuse`, `Refused`. Where the generation prompt cannot place the answer (a
    template without one, or that moves earlier text, as Mistral's system prompt into the last user turn), refused."""
    rewritten_turns = labelling.rewritten_turns
    before = render(messages[:i], tools=tools)
    header = prompt[len(before):] if prompt.startswith(before) else ""
    at = through.find(header, common_prefix(prompt, through)) if header else -1
    if at < 0 or rewritten_turns == "refuse":
        if at < 0 and reasoning_of(messages[i]) and any(tag in header for block in REASONING_BLOCKS for tag in block):
            # the cause: a generation prompt that opens or closes the reasoning otherwise than this answer's rendering,
            # unless the turn without its reasoning is refused too: then that refusal names the true cause
            _refuse_as_without_reasoning(render, messages, i, tools, labelling, advise)
            raise Refused(f"messages[{i}]", f"the chat template's generation prompt ({header.strip()!r}) is not where "
                          "this answer, rendered with its reasoning, begins. "
                          + reasoning_cause(render, header, through[common_prefix(prompt, through):],
                                            reasoning_of(messages[i])) + "."
                          + _ways_out(render, messages, i, tools, labelling, advise))
        raise Refused(f"messages[{i}]", "the chat template renders the chat before this turn differently once the "
                      f"turn is added ({divergence(prompt, through)}), so the turn cannot be located"
                      + ("" if at < 0 else "; data.rewritten_turns=split trains it after its own prompt")
                      + "; set tokenizer.chat_template to a template that keeps earlier text unchanged")
    if rewritten_turns == "skip":
        return None
    return prompt + through[at + len(header):]


def _refuse_misplaced_reasoning(render: ChatRenderer, messages: list[dict], i: int, turn: _Turn, tools,
                                labelling: Labelling, advise: bool) -> None:
    """Refuse an answer trained inside a reasoning block it does not close, or opening a block its prompt already
    opened: a template that writes its generation prompt's `<think>` prefill into the finished chat too
    (Nemotron-Nano-v2's, before its last answer) escapes the prefill check, and every answer would train inside the
    model's reasoning, never closing it (`data.prefill=after` likewise, after an open prefill); a `<think>...</think>`
    block in such an answer's content trains a second `<think>`. Only the text after the chat's last message counts:
    an earlier answer's block is its own."""
    context = turn.text[:turn.start]
    before = messages[i - 1].get("content") if i else None
    if isinstance(before, str) and before.strip() and (at := context.rfind(before.strip())) >= 0:
        context = context[at + len(before.strip()):]  # what the template wrote after the chat's last message
    answer = turn.text[turn.start:turn.end]
    block = open_reasoning(context)
    if block is None:
        return
    opened = context[context.rfind(block[0]):]
    if answer.lstrip().startswith(block[0]):
        problem = (f"the chat template opens a reasoning block before this answer ({opened!r}) and the answer, as the "
                   f"template renders it, opens another ({answer[:30]!r}): the model would learn to write "
                   f"{block[0]!r} twice")
    elif block[1] not in answer:
        problem = (f"the chat template opens a reasoning block before this answer ({opened!r}) that the answer, as the "
                   f"template renders it, does not close (no {block[1]!r}): the model would learn to answer inside its "
                   "reasoning and never close it")
    else:
        return
    raise Refused(f"messages[{i}]", problem + "." + _ways_out(render, messages, i, tools, labelling, advise))


def _ways_out(render: ChatRenderer, messages: list[dict], i: int, tools, labelling: Labelling, advise: bool) -> str:
    """` ` + the refusal's ways out, each tried first (`sft.data.chat.remedies`); nothing while trying them."""
    if not advise:
        return ""
    from sft.data.chat.remedies import ways_out

    return " " + ways_out(render, messages, i, tools, labelling, chat_views)


def _refuse_as_without_reasoning(render: ChatRenderer, messages: list[dict], i: int, tools, labelling: Labelling,
                                 advise: bool) -> None:
    """Raise the refusal turn `i` gets once its reasoning is taken out, where it gets one: the reasoning is then not
    the cause (a call turn refused for its reasoning was refused without it too, for another reason)."""
    from sft.data.chat.remedies import WayOut, _applied

    chat = _applied(WayOut("", form="none"), messages[:i + 1], i)
    try:
        chat_views(render.tokenizer, chat, tools, labelling, render, advise=False)
    except Refused:
        chat_views(render.tokenizer, chat, tools, labelling, render, advise=advise)  # raises it, with its ways out


def definitions_shown(render, messages: list[dict], tools: list[dict]) -> bool:
    """Whether the template shows the tool definitions: the prompt of the chat's first answer (the chat before it, with
    the generation prompt) rendered with them differs from it rendered without (a tool's name elsewhere in the chat,
    an answer mentioning it, says nothing)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    with_tools = render(messages[:first], tools, add_generation_prompt=True)
    try:
        return with_tools != render(messages[:first], None, add_generation_prompt=True)
    except Refused:  # a template that needs the tools to render at all uses them
        return True

