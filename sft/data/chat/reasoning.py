"""Reasoning in chat templates: the blocks templates open and close it with (`REASONING_BLOCKS`), one a rendering leaves
open (`open_reasoning`), the kwargs a template reads to turn it on (`reasoning_switches`), a turn's own reasoning
(`reasoning_of`), and why a template's generation prompt and an answer's reasoning disagree (`reasoning_cause`,
`prefill_cause`); the ways out a refusal offers are tried first (`sft.data.chat.remedies`)."""

from __future__ import annotations

from sft.data.chat.template import ChatRenderer

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


def reasoning_cause(render: ChatRenderer, prefill: str, rendered: str, reasoning: str) -> str:
    """Why an answer with reasoning does not follow the generation prompt: the prompt closes the reasoning
    (`<think>\n\n</think>`, `<|START_THINKING|><|END_THINKING|>`: its no-thinking prompt, by a kwarg or by default),
    the template renders none of the answer's reasoning (`rendered`: the answer as it writes it), or it renders it
    without what the prompt wrote before it (Apriel's preamble). The ways out are tried and said by
    `sft.data.chat.remedies`."""
    given = ", ".join(f"{k}={v!r}" for k, v in render.settings.kwargs.items()) or "none: its default"
    if closes_reasoning(prefill):
        return (f"This answer has reasoning, but the generation prompt closes the reasoning ({prefill.strip()!r}: the "
                f"template's no-thinking prompt, with the kwargs {given})")
    if reasoning and reasoning not in rendered:
        return f"The template renders none of this answer's reasoning here (with the kwargs {given})"
    return "The answer's reasoning is rendered, without what the prefill wrote before it"


def prefill_cause(prefill: str) -> str:
    """Why an answer without reasoning does not follow a prefilling generation prompt, where the prefill says more."""
    if closes_reasoning(prefill):  # Gemma-4's, Command-R7B's empty thought block
        return "The prefill is an empty reasoning block (the template's no-thinking prompt) that the finished chat does not show"
    return ""


def switches_on(template: str) -> list[dict]:
    """The template kwargs that would turn its reasoning on, one dict each: `{enable_thinking: True}`,
    `{reasoning_effort: "high"}`."""
    return [{name: _on(name)} for name in reasoning_switches(template) if "budget" not in name]


def switches_off(template: str) -> list[dict]:
    """The template kwargs that would turn its reasoning off, one dict each (an effort has no off every template
    names alike: none)."""
    return [{name: False} for name in reasoning_switches(template) if "effort" not in name and "budget" not in name]


def as_override(kwargs: dict) -> str:
    """`{enable_thinking: True}` -> `+tokenizer.chat_template_kwargs.enable_thinking=true` (as Hydra parses it)."""
    from sft.config.overrides import override

    return ", ".join(override(f"tokenizer.chat_template_kwargs.{k}", v, add=True) for k, v in kwargs.items())


def _on(switch: str):
    """The value that turns a template's reasoning switch on, as such kwargs go: `enable_thinking=True`,
    `reasoning_effort="high"`."""
    return "high" if "effort" in switch else True


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
    # a message's own field read as a variable (MiniMax's `reasoning_content`) is no kwarg
    return sorted(n for n in names if ("think" in n.lower() or "reason" in n.lower()) and n != "reasoning_content")


def reasoning_of(message: dict) -> str:
    """A turn's reasoning text (its `reasoning_content`, or the `<think>` block its content opens with), stripped."""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"].strip()
    content = message.get("content")
    if isinstance(content, str) and "</think>" in content:
        return content.split("</think>")[0].split("<think>")[-1].strip()
    return ""
