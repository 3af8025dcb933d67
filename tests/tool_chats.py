"""Chats that call tools (the definitions, a call, its result, the answer), and how each trains."""

from conftest import labelled_runs, write_jsonl

from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


WEATHER_CHAT = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
         {"role": "tool", "content": "18 C, sunny", "name": "get_weather"},
         {"role": "assistant", "content": "It is 18 C and sunny."}]


def trained_on(tmp_path, tokenizer, rows, **data):
    f = write_jsonl(tmp_path / "agent.jsonl", rows)
    split = load_sft_datasets(DataSpec(train_file=str(f), max_length=512, default_score=1.0, **data), tokenizer).train
    return [([tokenizer.decode(run, skip_special_tokens=False) for run in labelled_runs(r["input_ids"], r["labels"])],
             tokenizer.decode(r["input_ids"], skip_special_tokens=False)) for r in split]
