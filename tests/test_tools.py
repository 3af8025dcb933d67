"""Tool calls: an assistant turn's calls train with it, tool results never do, the row's tool definitions
reach the chat template; a template that would drop calls or definitions, and malformed calls, are refused
with their line."""

import json

import pytest

from chat_templates import family_tokenizer
from conftest import labelled_runs, write_jsonl
from sft.data.rows import DataError
from sft.data.load import load_sft_datasets

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
AGENT = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "content": "18 C, sunny", "name": "get_weather"},
         {"role": "assistant", "content": "It is 18 C and sunny."}]


def trained(tmp_path, tokenizer, rows, **data):
    f = write_jsonl(tmp_path / "agent.jsonl", rows)
    split = load_sft_datasets(tokenizer, None, train_file=str(f), max_length=512, default_score=1.0, **data).train
    return [([tokenizer.decode(run, skip_special_tokens=False) for run in labelled_runs(r["input_ids"], r["labels"])],
             tokenizer.decode(r["input_ids"], skip_special_tokens=False)) for r in split]


def test_the_call_and_the_answer_train_the_tool_result_and_definitions_are_context(tmp_path):
    tokenizer = family_tokenizer("qwen25_tools")
    [(runs, text)] = trained(tmp_path, tokenizer, [{"messages": AGENT, "tools": TOOLS}])
    assert runs == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "It is 18 C and sunny.<|im_end|>"]
    assert '"description": "Weather of a city"' in text and "<tool_response>\n18 C, sunny\n</tool_response>" in text
    # arguments as JSON text (OpenAI's wire form) train the same tokens
    as_text = [dict(m) for m in AGENT]
    as_text[1] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    as_text[2] = {**AGENT[2], "tool_call_id": "call_1"}
    assert trained(tmp_path, tokenizer, [{"messages": as_text, "tools": TOOLS}])[0][0] == runs


def test_sharegpt_function_call_and_observation_turns_are_tool_calls_and_results(tmp_path):
    tokenizer = family_tokenizer("qwen25_tools")
    share = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                               {"from": "function_call", "value": json.dumps(CALL["function"])},
                               {"from": "observation", "value": "18 C, sunny"},
                               {"from": "gpt", "value": "It is 18 C and sunny."}],
             "tools": json.dumps(TOOLS)}  # LLaMA-Factory keeps them as JSON text
    messages = [{k: v for k, v in m.items() if k != "name"} for m in AGENT]
    assert trained(tmp_path, tokenizer, [share]) == trained(tmp_path, tokenizer, [{"messages": messages,
                                                                                   "tools": TOOLS}])


@pytest.mark.parametrize("rows, message", [
    ([{"messages": AGENT}], "agent.jsonl:1: messages[1].tool_calls: the chat template does not render this turn's "
                            "tool call ('get_weather'): the turn would train without it"),
    ([{"messages": AGENT[:1] + AGENT[3:], "tools": TOOLS}],
     "agent.jsonl:1: tools: the chat template does not render the tool definitions ('get_weather'"),
])
def test_a_template_that_renders_no_tool_calls_or_definitions_is_refused(tmp_path, rows, message):
    from sft.model.loading import load_tokenizer

    with pytest.raises(DataError) as e:
        trained(tmp_path, load_tokenizer("tiny"), rows)  # its ChatML template knows no tools
    assert message in str(e.value)


def bad(messages):
    return [{"messages": messages, "tools": TOOLS}]


@pytest.mark.parametrize("rows, message", [
    (bad([AGENT[0], {"role": "tool", "content": "18 C"}, AGENT[3]]),
     "messages[1].role: a tool result without a tool call before it"),
    (bad([AGENT[0], {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}, *AGENT[2:]]),
     "messages[1].tool_calls[0].function: missing"),
    (bad([AGENT[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}, *AGENT[2:]]),
     "messages[1].tool_calls[0].function.arguments: not JSON"),
    (bad([AGENT[0], {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "a"}]},
          {"role": "tool", "content": "18 C", "tool_call_id": "b"}, AGENT[3]]),
     "messages[2].tool_call_id: 'b' names no call of the assistant turn before it"),
    (bad([*AGENT[:2], {"role": "tool", "content": "18 C", "name": "get_time"}, AGENT[3]]),
     "messages[2].name: 'get_time' is no function called by the assistant turn before it"),
    ([{"messages": AGENT, "tools": {"name": "get_weather"}}], "tools: must be a list of tool definitions"),
    (bad([{"role": "user", "content": "hi", "tool_calls": [CALL]}, AGENT[3]]),
     "messages[0].tool_calls: only an assistant turn calls tools"),
])
def test_malformed_calls_and_results_name_line_and_field(tmp_path, rows, message):
    with pytest.raises(DataError) as e:
        trained(tmp_path, family_tokenizer("qwen25_tools"), rows)
    assert f"agent.jsonl:1: {message}" in str(e.value)
