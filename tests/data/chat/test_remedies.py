"""The ways out a refusal offers (`sft.data.chat.remedies`): each tried on the refused chat first, only those that
train right offered."""


import pytest
from chat_templates import family_tokenizer
from chat_views import PLAIN, labelled

from sft.data.chat.template import Refused
from sft.data.chat.turns import chat_views
from sft.data.spec import Labelling


def test_a_prefilled_generation_prompt_is_refused_naming_it_and_the_ways_out_that_train_right():
    """DeepSeek-R1 distills prefill an open `<think>\\n`: a plain answer after it would train inside the reasoning, so
    `data.prefill=after` is refused too and not offered; the ways out offered are those that, tried, train right."""
    tokenizer = family_tokenizer("prefilled_think")
    with pytest.raises(Refused) as e:
        chat_views(tokenizer, PLAIN)
    assert "generation prompt ends with '<think>\\n', which this answer does not begin with" in e.value.reason
    assert ("Ways out, each tried on this chat: give the answer its reasoning as a <think>...</think> block at the "
            "start of the content; set data.prefill=drop (the answer as the finished chat renders it)") in e.value.reason
    assert "data.prefill=after" not in e.value.reason and "chat_template_kwargs" not in e.value.reason  # it reads none
    with pytest.raises(Refused, match="does not close"):  # after: inside the open block, never closed
        chat_views(tokenizer, PLAIN, labelling=Labelling(prefill="after"))
    assert labelled(tokenizer, PLAIN, prefill="drop") == [["4<|im_end|>", "6<|im_end|>"]]  # as the chat renders it
    # an answer that begins with what the prefill opens trains after it
    reasoned = PLAIN[:3] + [{"role": "assistant", "content": "<think>\n3 and 3.\n</think>\n\n6"}]
    assert labelled(tokenizer, reasoned[2:]) == [["3 and 3.\n</think>\n\n6<|im_end|>"]]


def test_a_prefill_the_template_writes_into_the_finished_chat_too_is_refused_not_trained_inside_open_reasoning():
    """Nemotron-Nano-v2's template writes its generation prompt's `<think>\n\n` before the last answer of a finished
    chat as well: the prefill check sees no prefill, and every answer would train inside an open think block. Refused,
    naming the block and the ways out; '/no_think' (which this template reads) closes it, and the answers train."""
    tokenizer = family_tokenizer("prefill_in_last_turn")
    with pytest.raises(Refused) as e:
        chat_views(tokenizer, PLAIN)
    assert e.value.field == "messages[1]"  # the first answer: rendered with the prefill in a text of its own
    assert r"opens a reasoning block before this answer ('<think>\n\n')" in e.value.reason
    assert "does not close (no '</think>')" in e.value.reason
    # the ways out offered are those that, tried, train right: not data.prefill=after (inside the open block), not a
    # <think>...</think> block in the content (a second <think>)
    assert e.value.reason.endswith(
        "Ways out, each tried on this chat: give the answer its reasoning in the content, closed by '</think>' (the "
        "template opening the block itself); put '/no_think' in the system prompt (this template reads it). Or set "
        "tokenizer.chat_template to a template that renders it.")
    no_think = [{**PLAIN[0], "content": PLAIN[0]["content"] + " /no_think"}] + PLAIN[1:]
    assert labelled(tokenizer, no_think) == [["6<|im_end|>"], ["4<|im_end|>"]]  # after <think></think>, each
    reasoned = PLAIN[:3] + [{"role": "assistant", "content": "3 and 3.\n</think>\n\n6"}]
    assert labelled(tokenizer, reasoned[2:]) == [["3 and 3.\n</think>\n\n6<|im_end|>"]]  # it closes the block
    for advised_before in ({"prefill": "after"}, {}):  # the old advice, each refused now, not trained wrong
        chat = PLAIN if advised_before else PLAIN[:1] + [{"role": "assistant", "content": "<think>2 and 2.</think>4"}]
        with pytest.raises(Refused, match="does not close|opens another"):
            chat_views(tokenizer, chat, labelling=Labelling(**advised_before))


def test_reasoning_a_template_drops_whatever_it_is_given_is_refused_saying_it_cannot_train():
    """QwQ's and the R1 distills' current copies drop every answer's reasoning, and their switch only opens the
    prompt's think block: the refusal named `enable_thinking=true`, which, set, was refused again naming it. Every
    change tried, it says the reasoning cannot train with this template, and what trains the answer without it."""
    from sft.data.chat.settings import configure_chat

    reasoned = [PLAIN[0], {**PLAIN[1], "reasoning_content": "2 and 2."}]
    for kwargs in ({}, {"enable_thinking": True}):
        with pytest.raises(Refused) as refused:
            chat_views(configure_chat(family_tokenizer("switch_drops_reasoning"), kwargs), reasoned)
        reason = refused.value.reason
        assert "With this template the reasoning cannot train: none of the " in reason
        assert "These train the answer without its reasoning: " in reason and "set data.prefill=drop" in reason
        assert "enable_thinking=true" not in reason.split("cannot train")[1]  # not offered: it does not help
    # the R1 pattern that keeps the last answer as given: its reasoning trains as a <think> block in the content
    with pytest.raises(Refused) as refused:
        chat_views(family_tokenizer("prefilled_think"), reasoned)
    assert "renders none of this answer's reasoning here" in refused.value.reason
    assert "Ways out, each tried on this chat: the reasoning as a <think>...</think> block" in refused.value.reason
    block = [PLAIN[0], {**PLAIN[1], "content": "<think>\n2 and 2.\n</think>\n\n4"}]
    assert labelled(family_tokenizer("prefilled_think"), block) == [["2 and 2.\n</think>\n\n4<|im_end|>"]]
