"""Reasoning in chat templates: the blocks templates open and close it with (`REASONING_BLOCKS`), one a rendering leaves
open (`open_reasoning`), the kwargs a template reads to turn it on (`reasoning_switches`), a turn's own reasoning
(`reasoning_of`), and what a refusal says when a template's generation prompt and an answer's reasoning disagree
(`closed_reasoning_advice`, `prefill_advice`): the cause, and the switch this template itself reads."""

from __future__ import annotations

from sft.data.templates import ChatRenderer


# How templates open and close a reasoning block (Qwen's, Hunyuan Hy3's, Granite's, Command-R7B's, Mistral's, Apertus's,
# Gemma-4's)
REASONING_BLOCKS = (("<think>", "</think>"), ("<think:opensource>", "</think:opensource>"),
                    ("<thinking>", "</thinking>"), ("<|start_thinking|>", "<|end_thinking|>"),
                    ("<|START_THINKING|>", "<|END_THINKING|>"), ("[THINK]", "[/THINK]"),
                    ("<|inner_prefix|>", "<|inner_suffix|>"), ("<|channel>thought", "<channel|>"))


def open_reasoning(context: str) -> tuple[str, str] | None:
    """The reasoning block `context` leaves open at its end, as (opening tag, closing tag): its last opening tag after
    its last closing one; None where none is open.

        open_reasoning("<SPECIAL_11>Assistant\n<think>\n\n") -> ("<think>", "</think>")
        open_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") -> None
    """
    for opening, closing in REASONING_BLOCKS:
        at = context.rfind(opening)
        if at >= 0 and context.rfind(closing) < at:
            return opening, closing
    return None


def closes_reasoning(text: str) -> bool:
    """Whether `text` closes a reasoning block (a generation prompt's `<think>\n\n</think>`: its no-thinking prompt)."""
    return any(closing in text for _, closing in REASONING_BLOCKS)


def closed_reasoning_advice(render: ChatRenderer, prefill: str, rendered: str, reasoning: str) -> str:
    """What to say of an answer with reasoning that the generation prompt does not let follow: where it closes the
    reasoning (`<think>\n\n</think>`, `<|START_THINKING|><|END_THINKING|>`: its no-thinking prompt, by a kwarg or by
    default), that, and the kwargs of the template that turn thinking on; where it renders no reasoning of the answer
    at all (`rendered`, the answer as the template writes it), that."""
    kwargs = render.settings.kwargs
    given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "none: its default"
    has_switch = bool(reasoning_switches(render.tokenizer.chat_template or ""))
    # no switch: DeepSeek-R1 distills, which drop an answer's reasoning from the chat whatever the caller passes
    cannot = ("and the template reads no kwarg that would change that: with it the reasoning cannot train; drop the "
              "rows' reasoning, set tokenizer.chat_template to one that renders it, or set ")
    if closes_reasoning(prefill):
        head = (f"This answer has reasoning, but the generation prompt closes the reasoning ({prefill.strip()!r}: the "
                f"template's no-thinking prompt, with the kwargs {given}), ")
        return head + (f"turn thinking on with a template kwarg ({switches_named(render)}), drop the rows' reasoning, "
                       "or set " if has_switch else cannot)
    if reasoning and reasoning not in rendered:
        head = f"The template renders none of this answer's reasoning here (with the kwargs {given}), "
        return head + (f"which it may only with thinking on ({switches_named(render)}); or drop the rows' reasoning, "
                       "or set " if has_switch else cannot)
    # it renders the reasoning, only not after what the prompt already wrote (Apriel's preamble)
    return "The answer's reasoning is rendered, without what the prefill wrote before it: set "


def prefill_advice(render: ChatRenderer, prefill: str) -> str:
    """What to say of an answer without reasoning that a generation prompt's prefill comes before."""
    if closes_reasoning(prefill):  # Gemma-4's, Command-R7B's empty thought block
        return ("The prefill is an empty reasoning block (the template's no-thinking prompt) that the finished chat does "
                f"not show: turn thinking on ({switches_named(render)}) and give the answers their reasoning, or set ")
    return ("Give the answer what the prefill opens (its reasoning, as reasoning_content or a <think> block, where the "
            f"template renders it), pass the template a kwarg that changes its generation prompt "
            f"({switches_named(render)}), or set ")


def switches_named(render: ChatRenderer) -> str:
    """The kwargs that turn the template's reasoning on, as overrides: those it reads, else the usual names."""
    switches = reasoning_switches(render.tokenizer.chat_template or "")
    if switches:
        return f"the kwarg{'s' if len(switches) > 1 else ''} this template reads: " + ", ".join(
            f"+tokenizer.chat_template_kwargs.{name}={_on(name)}" for name in switches)
    return ("+tokenizer.chat_template_kwargs.enable_thinking=true, or reasoning_effort=high, thinking=true: as the "
            "template names it")


def _on(switch: str) -> str:
    """The value that turns a template's reasoning switch on, as such kwargs go: `enable_thinking=true`,
    `reasoning_effort=high`."""
    return "high" if "effort" in switch else "true" if "budget" not in switch else "<tokens>"


def reasoning_switches(template: str) -> list[str]:
    """The variables a chat template reads from its caller whose names speak of thinking or reasoning
    (`enable_thinking`, `reasoning_effort`, `thinking`): the kwargs that turn its reasoning on or off. Parsed in
    transformers' own template environment, whose extensions (`{% break %}`, `{% generation %}`) templates use."""
    import jinja2
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        names = meta.find_undeclared_variables(_compile_jinja_template(template).environment.parse(template))
    except jinja2.TemplateError:
        return []
    return sorted(n for n in names if "think" in n.lower() or "reason" in n.lower())


def reasoning_of(message: dict) -> str:
    """A turn's reasoning text (its `reasoning_content`, or the `<think>` block its content opens with), stripped."""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"].strip()
    content = message.get("content")
    if isinstance(content, str) and "</think>" in content:
        return content.split("</think>")[0].split("<think>")[-1].strip()
    return ""
