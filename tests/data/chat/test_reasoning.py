"""Reasoning in chat templates (`sft.data.chat.reasoning`): what a template keeps of a turn's reasoning trains, a
turn it rewrites later trains from its own rendering, and a refusal names why the reasoning cannot be placed and the
template's own switch."""


import pytest
from chat_templates import family_tokenizer
from chat_views import REASONED_CHAT, SYSTEM, TURNS, expected, labelled, trained_runs
from tool_chats import WEATHER_CHAT, WEATHER_TOOLS

from sft.data.chat.template import Refused
from sft.data.chat.turns import chat_views
from sft.data.spec import Labelling
from sft.data.tokens.labels import tokenize_batch


@pytest.mark.parametrize("reasoning_in", ["reasoning_content", "think_block"])
def test_qwen3_trains_the_reasoning_it_keeps_and_earlier_turns_from_their_own_rendering(reasoning_in):
    tokenizer = family_tokenizer("qwen3")
    turns = TURNS
    if reasoning_in == "think_block":
        turns = [{"role": m["role"], "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
                 if m["role"] == "assistant" else m for m in TURNS]
    last, first = expected("qwen3", [("6", "3 and 3 make 6.")]), expected("qwen3", [("4", "2 and 2 make 4.")])
    # The whole chat shows the first answer without its reasoning (dropped once a user turn follows): that
    # answer trains in the chat up to it, where the template keeps its reasoning, as the model wrote it.
    assert trained_runs(tokenizer, [SYSTEM, *turns]) == [last, first]
    assert trained_runs(tokenizer, [SYSTEM, *turns], rewritten_turns="skip") == [last]
    out = tokenize_batch({"messages": [[SYSTEM, *turns]], "difficulty_score": [1.0], "source_line": [3]}, tokenizer,
                         Labelling(max_length=4096, rewritten_turns="refuse")).to_pydict()
    field, reason = out["refused"][0].split("\t")
    assert field == "messages[2]" and "renders this turn differently once later turns follow" in reason


def test_qwen3_a_single_answer_without_reasoning_trains_the_empty_think_block_the_template_writes():
    runs = trained_runs(family_tokenizer("qwen3"), [{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": "Hello"}])
    assert runs == [["<think>\n\n</think>\n\nHello<|im_end|>"]]


@pytest.mark.parametrize("family, closed, switch, trained", [
    # Command-R7B: an uppercase block, closed unless the template's own switch is passed
    ("upper_thinking_switch", "'<|START_THINKING|><|END_THINKING|>'", {"reasoning": True},
     "<|START_THINKING|>Greet.<|END_THINKING|>Hello!<|im_end|>"),
    # Hunyuan Hy3: suffixed tags, closed unless reasoning_effort asks for thinking
    ("suffixed_think_effort", "'<think:opensource>\\n\\n</think:opensource>'", {"reasoning_effort": "high"},
     "<think:opensource>Greet.</think:opensource>Hello!<|im_end|>"),
])
def test_reasoning_after_a_closed_block_is_refused_naming_the_kwarg_the_template_itself_reads(family, closed, switch,
                                                                                              trained):
    """A generation prompt that closes the reasoning by default: a reasoning row's refusal says so (it said the
    reasoning was rendered, or blamed the rendering of earlier text) and names the template's own switch, with the
    value that turns it on; with it, the reasoning trains."""
    from sft.data.chat.settings import configure_chat

    with pytest.raises(Refused) as refused:
        chat_views(family_tokenizer(family), REASONED_CHAT)
    assert f"the generation prompt closes the reasoning ({closed}" in refused.value.reason
    (name, value), = switch.items()
    assert f"+tokenizer.chat_template_kwargs.{name}={'true' if value is True else value}" in refused.value.reason
    assert labelled(configure_chat(family_tokenizer(family), switch), REASONED_CHAT) == [[trained]]


def test_an_answer_with_reasoning_after_a_no_thinking_prompt_is_refused_naming_that_cause():
    """Qwen3 with enable_thinking=false, Hunyuan Hy3 by default: the refusal names the closed reasoning and the kwarg
    that opens it (it said the template renders the chat differently, or to give the answer reasoning it had)."""
    from sft.data.chat.settings import configure_chat

    tokenizer = configure_chat(family_tokenizer("no_think_prompt"), {"enable_thinking": False})
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]
    with pytest.raises(Refused) as refused:
        chat_views(tokenizer, chat, None)
    reason = refused.value.reason
    assert "This answer has reasoning, but the generation prompt closes the reasoning ('<think>\\n\\n</think>': the " \
           "template's no-thinking prompt, with the kwargs enable_thinking=False)" in reason
    assert "+tokenizer.chat_template_kwargs.enable_thinking=true" in reason and "Give the answer" not in reason


def test_a_call_turn_refused_without_its_reasoning_too_is_refused_for_that_cause_not_its_reasoning():
    """Nemotron-Nano-v2's generation prompt opens <think>, but a call turn is written without it: the turn cannot be
    placed whether or not it has reasoning. With reasoning it was refused for the reasoning (and advice about it);
    refused the same way as without, the true cause is named."""
    tokenizer = family_tokenizer("prefill_in_last_turn")
    call = {**WEATHER_CHAT[1], "content": ""}
    refusals = []
    for turn in (call, {**call, "reasoning_content": "Look it up."}):
        with pytest.raises(Refused) as refused:
            chat_views(tokenizer, [WEATHER_CHAT[0], turn, *WEATHER_CHAT[2:]], WEATHER_TOOLS)
        refusals.append((refused.value.field, refused.value.reason))
    assert refusals[0] == refusals[1]
    assert refusals[0][0] == "messages[1]" and "renders the chat before this turn differently" in refusals[0][1]
    assert "reasoning" not in refusals[1][1]
