"""Tool-call accuracy (`sft.eval.tool_calls`): calls read in the form each chat template writes them, checked against
the template's own rendering of the reference calls (the oracle), malformed calls counted as wrong."""

import json

import pytest
from chat_templates import family_tokenizer

from sft.data.chat.template import ChatRenderer
from sft.eval.tool_calls import Call, CallFormat, reference_calls, score

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "description": "A sum",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]
USER = {"role": "user", "content": "Weather in Perth, and 2 + 3?"}
CALLS = [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Perth"}}},
         {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
# templates that render tool calls: Qwen2.5/Hermes's <tool_call> blocks, a tools-only variant, Llama-3.1's JSON
# with "parameters", DeepSeek's special-token markers with the arguments as text
CALLING = ["qwen25_tools", "tools_required", "tool_preamble", "arguments_as_text"]


def rendered_answer(tokenizer, calls) -> str:
    """What the template writes for an assistant turn making `calls` (after the generation prompt)."""
    render = ChatRenderer(tokenizer)
    turn = {"role": "assistant", "content": "", "tool_calls": [render._call(c) for c in calls]}
    prompt = render([USER], TOOLS, add_generation_prompt=True)
    return render([USER, turn], TOOLS)[len(prompt):]


@pytest.mark.parametrize("family", CALLING)
def test_the_templates_own_rendering_of_the_calls_reads_back_as_the_calls(family):
    tokenizer = family_tokenizer(family)
    fmt = CallFormat.of(tokenizer)
    assert fmt is not None
    expected = reference_calls({"tool_calls": CALLS})
    for calls in (CALLS[:1], CALLS):
        text = rendered_answer(tokenizer, calls)
        generated, malformed = fmt.parse(text)
        assert (generated, malformed) == (expected[:len(calls)], 0), (family, text)
        assert score(generated, expected[:len(calls)]) == (len(calls), True)


@pytest.mark.parametrize("family", CALLING)
def test_a_cut_call_is_malformed_and_a_wrong_argument_is_a_wrong_call(family):
    tokenizer = family_tokenizer(family)
    fmt = CallFormat.of(tokenizer)
    text = rendered_answer(tokenizer, CALLS[:1])
    cut = text[:text.index("Perth")]  # generation stopped inside the arguments
    assert fmt.parse(cut) == ([], 1)
    wrong, _ = fmt.parse(text.replace("Perth", "Paris"))
    assert score(wrong, reference_calls({"tool_calls": CALLS[:1]})) == (0, False)


def test_templates_that_render_no_calls_have_no_format():
    assert CallFormat.of(family_tokenizer("chatml")) is None


def test_score_counts_each_reference_call_once_and_a_turn_only_when_exactly_right():
    weather, add = Call("get_weather", {"city": "Perth"}), Call("add", {"a": 2, "b": 3})
    assert score([weather], [weather, add]) == (1, False)
    assert score([add, weather], [weather, add]) == (2, False)  # both calls, in another order
    assert score([weather, weather], [weather]) == (1, False)  # one call too many
    assert score([], []) == (0, True)
    text_args = {"tool_calls": json.dumps([{"function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}])}
    assert reference_calls(text_args) == [add]  # arguments given as JSON text compare as parsed JSON


def test_eval_generation_scores_calls_and_shows_them_in_the_samples(tokenizer):
    from sft.eval.samples import EvalGeneration

    qwen = family_tokenizer("qwen25_tools")
    samples = EvalGeneration(prompts=3)
    samples.rows = [{"messages": [USER, {"role": "assistant", "content": "", "tool_calls": json.dumps(CALLS)}]},
                    {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": CALLS[:1]}]},
                    {"messages": [USER, {"role": "assistant", "content": "Sunny."}]}]
    right, one = rendered_answer(qwen, CALLS), rendered_answer(qwen, CALLS[:1])
    cut = one[:one.index("Perth")]  # generation stopped inside the arguments
    table = [["q", "ref", "a"] for _ in samples.rows]
    metrics = samples._score_calls(qwen, [right, cut, "Sunny."], table)
    assert metrics == {"eval_gen/tool_call_accuracy": 2 / 3, "eval_gen/tool_turn_accuracy": 0.5,
                       "eval_gen/tool_calls_malformed": 1.0}
    assert json.loads(table[0][1]) == [{"name": "get_weather", "arguments": {"city": "Perth"}},
                                       {"name": "add", "arguments": {"a": 2, "b": 3}}]
    assert table[1][2].endswith("[1 malformed call(s)]") and table[2] == ["q", "ref", "a"]  # not a calling prompt
