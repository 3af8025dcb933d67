"""Validation (`sft.data.rows.reading`): bad rows (malformed tool calls and results among them) named by file, line and
field; scores, BOMs, CRLF and blank lines; the same rows and rejections on several processes as on one."""

import json

import pytest
from chat_templates import family_tokenizer
from conftest import chat, write_jsonl
from tool_chats import WEATHER_CALL, WEATHER_CHAT, WEATHER_TOOLS, trained_on

from sft.data.rows import reading as data_rows
from sft.data.rows.reading import DataError, read_jsonl
from sft.data.rows.sources import Source


def bad(messages):
    return [{"messages": messages, "tools": WEATHER_TOOLS}]


@pytest.mark.parametrize("rows, message", [
    (bad([WEATHER_CHAT[0], {"role": "tool", "content": "18 C"}, WEATHER_CHAT[3]]),
     "messages[1].role: a tool result without a tool call before it"),
    (bad([WEATHER_CHAT[0], {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
          *WEATHER_CHAT[2:]]),
     "messages[1].tool_calls[0].function: missing"),
    (bad([WEATHER_CHAT[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}, *WEATHER_CHAT[2:]]),
     "messages[1].tool_calls[0].function.arguments: not JSON"),
    (bad([WEATHER_CHAT[0], {"role": "assistant", "content": "", "tool_calls": [{**WEATHER_CALL, "id": "a"}]},
          {"role": "tool", "content": "18 C", "tool_call_id": "b"}, WEATHER_CHAT[3]]),
     "messages[2].tool_call_id: 'b' names no call of the assistant turn before it"),
    (bad([*WEATHER_CHAT[:2], {"role": "tool", "content": "18 C", "name": "get_time"}, WEATHER_CHAT[3]]),
     "messages[2].name: 'get_time' is no function called by the assistant turn before it"),
    ([{"messages": WEATHER_CHAT, "tools": {"name": "get_weather"}}], "tools: must be a list of tool definitions"),
    (bad([{"role": "user", "content": "hi", "tool_calls": [WEATHER_CALL]}, WEATHER_CHAT[3]]),
     "messages[0].tool_calls: only an assistant turn calls tools"),
])
def test_malformed_calls_and_results_name_line_and_field(tmp_path, rows, message):
    with pytest.raises(DataError) as e:
        trained_on(tmp_path, family_tokenizer("qwen25_tools"), rows)
    assert f"agent.jsonl:1: {message}" in str(e.value)


@pytest.mark.parametrize(
    "line, field, reason",
    [
        ("{not json", "row", "invalid JSON"),
        ("[1, 2]", "row", "must be a JSON object"),
        ('{"difficulty_score": 1}', "messages", "missing"),
        ('{"messages": [{"role": "user", "content": "hi"}], "difficulty_score": 1}', "messages", "no assistant"),
        ('{"messages": [{"role": "bot", "content": "hi"}], "difficulty_score": 1}', "messages[0].role", "unknown"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], '
         '"difficulty_score": 1}', "messages[0].content", "must be a string"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
         '"difficulty_score": "hard"}', "difficulty_score", "finite number"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
         '"difficulty_score": -1}', "difficulty_score", "finite number"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
         "difficulty_score", "missing"),
    ],
)
def test_bad_rows_are_reported_with_file_line_and_field(tmp_path, line, field, reason):
    good = json.dumps(chat("q", "a", 1.0))
    f = write_jsonl(tmp_path / "bad.jsonl", [good, line, good])
    with pytest.raises(DataError) as e:
        read_jsonl(f)
    assert f"{f}:2: {field}: " in str(e.value) and reason in str(e.value)
    assert e.value.total == 1


def test_missing_score_uses_default_and_bom_crlf_blank_lines_are_accepted(tmp_path):
    row = json.dumps({"messages": chat("q", "a")["messages"]})
    f = tmp_path / "odd.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + row.encode() + b"\r\n\r\n" + row.encode() + b"\r\n")
    rows = read_jsonl(f, default_score=1.5)
    assert [r["difficulty_score"] for r in rows] == [1.5, 1.5] and [r["source_line"] for r in rows] == [1, 3]


@pytest.mark.parametrize("processes", [2, 3, 5])
def test_a_jsonl_file_validated_on_several_processes_gives_the_rows_and_rejections_of_one(tmp_path, processes):
    from datasets import Dataset, concatenate_datasets

    from sft.data.rows.formats import RowFormat
    from sft.data.splits.preprocess import write_rows_in_parallel

    lines = ['{"no": "format"}', "", "not json", json.dumps(chat("1 + 1?", "2", 1.0))]
    for i in range(40):
        lines.append(json.dumps(chat(f"{i} + 1?", str(i + 1), 1.0 + i % 3)) if i % 7 else "\xff bad utf-8")
        lines += [""] if i % 5 == 0 else []
    lines.append('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}')  # sharegpt
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf-8", "surrogateescape").replace(
        "\xff".encode(), b"\xff") + b"\n")
    rows, rejected = data_rows.scan_jsonl(path, score_required=False)
    found: list = []
    files, count, _ = write_rows_in_parallel(Source(str(path)), found, tmp_path / "shards", processes, None, False,
                                             RowFormat(), "all")
    assert len(files) > 1 and count == len(rows)
    parallel = concatenate_datasets([Dataset.from_file(str(f)) for f in files])
    assert parallel["source_line"] == [r["source_line"] for r in rows]
    assert [json.loads(m) for m in parallel["messages"]] == [r["messages"] for r in rows]  # stored as JSON text
    assert [str(r) for r in found] == [str(r) for r in rejected]
    assert any("a sharegpt row in a file whose first row is messages" in str(r) for r in found)


@pytest.mark.parametrize("processes", [2, 3])
def test_a_table_validated_on_several_processes_gives_the_rows_and_rejections_of_one(tmp_path, processes):
    from datasets import Dataset, concatenate_datasets

    from sft.data.rows.formats import RowFormat
    from sft.data.splits.preprocess import write_rows_in_parallel

    rows = [{"text": "no format"}] + [chat(f"{i} + 1?", str(i + 1), 1.0 + i % 3) if i % 6 else
                                      {"messages": [{"role": "robot", "content": "x"}]} for i in range(30)]
    rows.append({"prompt": "q", "completion": "a"})  # prompt_completion, in a messages table
    keys = sorted({k for r in rows for k in r})  # (from_list would take the first row's keys alone)
    Dataset.from_dict({k: [r.get(k) for r in rows] for k in keys}).to_parquet(path := tmp_path / "rows.parquet")
    scanned, rejected = data_rows.scan_table(Source(str(path)), score_required=False)
    found: list = []
    files, count, _ = write_rows_in_parallel(Source(str(path)), found, tmp_path / "shards", processes, None, False,
                                             RowFormat(), "all")
    assert len(files) == processes and count == len(scanned)
    parallel = concatenate_datasets([Dataset.from_file(str(f)) for f in files])
    assert parallel["source_line"] == [r["source_line"] for r in scanned]
    assert [json.loads(m) for m in parallel["messages"]] == [r["messages"] for r in scanned]
    assert [str(r) for r in found] == [str(r) for r in rejected] and len(found) == 7
