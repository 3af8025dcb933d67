"""The ways out a refusal offers, each tried on the refused chat before it is offered (`ways_out`).

A refusal of an answer the template cannot place (a prefill it does not begin with, a reasoning block left open, a
reasoning the prompt closes) could advise a change that trains silently wrong: on Nemotron-Nano-v2's template, whose
finished chat writes its own `<think>\\n` before the last answer, a `<think>...</think>` block in the content trains a
second `<think>`, and `data.prefill=after` trains every answer inside the open block; on QwQ's, turning
`enable_thinking` on is refused again, as the template drops every answer's reasoning whatever its kwargs. So each
candidate (`candidates`: the template's own switches on or off, `/no_think` where it reads it, the reasoning in each
form a template may render, the reasoning dropped, `data.prefill=after`/`drop`, and the switches with each form) is
applied to the chat through the refused turn, which is labelled again, and kept only where the turn then trains
right: placed, every reasoning block it is inside closed and opened once (`sft.data.chat.turns`), and with its reasoning
where it has one. Those that train it without its reasoning are said so; where none works, the refusal says that
this template cannot train it.

    ways_out(render, messages, 1, None, Labelling())  on Nemotron-Nano-v2's template, a plain answer ->
        ["put '/no_think' in the system prompt (this template reads it)",
         "give the answer its reasoning in the content, closed by '</think>' (the template opens the block itself)"]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sft.data.chat.reasoning import (REASONING_BLOCKS, as_override, open_reasoning, reasoning_of, switches_off,
                                     switches_on)
from sft.data.chat.template import ChatRenderer, Refused
from sft.data.spec import Labelling

PLACEHOLDER = "Reasoning first."  # the reasoning tried for an answer that has none (`give the answer its reasoning`)


@dataclass(frozen=True)
class WayOut:
    """One change to try: template kwargs, a form of the answer's reasoning, `/no_think` in the system prompt, a
    `data.prefill`, or several of these; `advice` says it as a user would make it."""

    advice: str
    kwargs: dict = field(default_factory=dict)
    form: str | None = None  # reasoning_content | block | closing | none (the reasoning dropped)
    no_think: bool = False
    prefill: str | None = None
    block: tuple[str, str] = ("<think>", "</think>")  # the reasoning block a form writes


def candidates(render: ChatRenderer, message: dict, context: str) -> list[WayOut]:
    """The changes to try for a refused answer (`message`), the template's own switches first. `context`: the text
    the template writes before the answer (which block it opens, if any)."""
    template = render.tokenizer.chat_template or ""
    opening, closing = open_reasoning(context) or _block_of(template)
    has = bool(reasoning_of(message))
    give = "" if has else "give the answer its reasoning "
    forms = [("reasoning_content", f"{give or 'the reasoning '}as the message's reasoning_content"),
             ("block", f"{give or 'the reasoning '}as a {opening}...{closing} block at the start of the content"),
             ("closing", f"{give or 'the reasoning '}in the content, closed by {closing!r} (the template opening the "
                         "block itself)")]
    ways = [WayOut(f"set {as_override(on)}", kwargs=on) for on in switches_on(template)]
    ways += [WayOut(f"set {as_override(on)} and {text}", kwargs=on, form=form, block=(opening, closing))
             for on in switches_on(template) for form, text in forms]
    ways += [WayOut(text, form=form, block=(opening, closing)) for form, text in forms]
    ways += [WayOut(f"set {as_override(off)}", kwargs=off) for off in switches_off(template)]
    if "/no_think" in template:
        ways.append(WayOut("put '/no_think' in the system prompt (this template reads it)", no_think=True))
    if has:
        ways.append(WayOut("drop the rows' reasoning", form="none"))
    ways += [WayOut("set data.prefill=after (the answer after the prefill, as the model answers)", prefill="after"),
             WayOut("set data.prefill=drop (the answer as the finished chat renders it)", prefill="drop")]
    return ways


def ways_out(render: ChatRenderer, messages: list[dict], i: int, tools, labelling: Labelling, label) -> str:
    """What a refusal of assistant turn `i` says next: the candidates that, tried on the chat through the turn, train
    it right (those that train it without its reasoning said apart), or that none does. `label`: the labelling to
    try them with (`sft.data.chat.turns.chat_views`, without advice of its own)."""
    reasoning = reasoning_of(messages[i])
    context = render(messages[:i], tools=tools, add_generation_prompt=True)
    right, without, tried = [], [], []
    given = render.settings.kwargs
    for way in candidates(render, messages[i], context):
        if way.kwargs and all(given.get(k) == v for k, v in way.kwargs.items()):
            continue  # already set: the same change without it is tried on its own
        tried.append(way.advice)
        chat, trying = _applied(way, messages[:i + 1], i), replace(labelling, prefill=way.prefill or labelling.prefill)
        try:
            views = label(render.tokenizer, chat, tools, trying, render.with_kwargs(way.kwargs) if way.kwargs
                          else render, advise=False)
        except Refused:
            continue
        answer = "".join(text[a:b] for text, spans in views for a, b, _ in spans)
        if reasoning:  # trains right only with its reasoning; dropping it is said as such
            (right if way.form != "none" and reasoning in answer else without).append(way.advice)
        elif way.form is None or PLACEHOLDER in answer:  # a reasoning given that does not train: no way out
            right.append(way.advice)
    right, without = _without_idle_kwargs(right), _without_idle_kwargs(without)
    if right:
        said = "Ways out, each tried on this chat: " + "; ".join(right) + "."
    elif without:
        said = (f"With this template the reasoning cannot train: none of the {len(tried)} changes sft tried renders "
                "it where the model writes it.")
    else:
        return (f"With this template this answer cannot train right: none of the {len(tried)} changes sft tried "
                "places it (" + "; ".join(tried[:4]) + (" ..." if len(tried) > 4 else "") + "); set "
                "tokenizer.chat_template to a template that renders it, or leave such rows out (data.on_error=skip)")
    if without:
        said += " These train the answer without its reasoning: " + "; ".join(without) + "."
    return said + " Or set tokenizer.chat_template to a template that renders it."


def _without_idle_kwargs(advice: list[str]) -> list[str]:
    """`advice` less each "set <kwarg> and <change>" whose change works alone too (the kwarg does nothing for it)."""
    return [a for a in advice if not (a.startswith("set +tokenizer.chat_template_kwargs.") and " and " in a
                                      and a.split(" and ", 1)[1] in advice)]


def _applied(way: WayOut, chat: list[dict], i: int) -> list[dict]:
    """The chat through turn `i` with `way`'s change to the answer and the system prompt; only turn `i` trained."""
    chat = [{**m, "weight": 0.0} if m.get("role") == "assistant" and k < i else dict(m) for k, m in enumerate(chat)]
    if way.form is not None:
        chat[i] = _in_form(chat[i], way.form, way.block)
    if way.no_think:
        if chat[0].get("role") == "system":
            chat[0] = {**chat[0], "content": f"{chat[0].get('content') or ''} /no_think".strip()}
        else:
            chat.insert(0, {"role": "system", "content": "/no_think"})
    return chat


def _in_form(message: dict, form: str, block: tuple[str, str]) -> dict:
    """`message` with its reasoning (or the placeholder, where it has none) in `form`, or without it (`none`)."""
    reasoning = reasoning_of(message) or PLACEHOLDER
    content = message.get("content") or ""
    for opening, closing in REASONING_BLOCKS:  # the answer alone, its own block (if any) taken out
        if closing in content:
            content = content.split(closing, 1)[1].lstrip("\n")
            break
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    opening, closing = block
    if form == "reasoning_content":
        return {**out, "content": content, "reasoning_content": reasoning}
    if form == "block":
        return {**out, "content": f"{opening}\n{reasoning}\n{closing}\n\n{content}"}
    if form == "closing":
        return {**out, "content": f"{reasoning}\n{closing}\n\n{content}"}
    return {**out, "content": content}


def _block_of(template: str) -> tuple[str, str]:
    """The reasoning block a template writes (the first of `REASONING_BLOCKS` in its text), `<think>` by default."""
    return next(((o, c) for o, c in REASONING_BLOCKS if c in template), ("<think>", "</think>"))
