"""Row formats (ShareGPT, Alpaca, prompt-completion, mapped columns) train exactly what the same chat as
`messages` trains; per-turn weights and `train_on` set the weight of each turn's tokens, exactly under
gradient accumulation; bad rows name file, line and field."""

import json

import pytest
import torch
from conftest import chat, labelled_runs, run_train, train_steps, write_jsonl

from sft.data.tokens.collator import WeightedDataCollator
from sft.data.load import load_sft_datasets
from sft.data.rows.reading import DataError
from sft.data.spec import DataSpec
from sft.loss.builtin import CrossEntropyLoss

TWO_TURNS = [{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": "1 + 1?"},
             {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 20 + 22?"},
             {"role": "assistant", "content": "20 + 22 = 42"}]


def tokenised(tmp_path, tokenizer, rows, name="rows.jsonl", **data):
    data.setdefault("default_score", 1.0)
    f = write_jsonl(tmp_path / name, rows)
    split = load_sft_datasets(DataSpec(train_file=str(f), max_length=128, **data), tokenizer).train
    return [(r["input_ids"], r["labels"], r.get("token_weights")) for r in split]


def as_messages(tmp_path, tokenizer, messages_rows):
    return [(ids, labels) for ids, labels, _ in tokenised(tmp_path, tokenizer, messages_rows, "messages.jsonl")]


@pytest.mark.parametrize("fmt, row", [
    ("sharegpt", {"conversations": [{"from": "system", "value": "Add the numbers."},
                                    {"from": "human", "value": "1 + 1?"}, {"from": "gpt", "value": "2"},
                                    {"from": "human", "value": "And 20 + 22?"},
                                    {"from": "gpt", "value": "20 + 22 = 42"}]}),
    ("alpaca", {"system": "Add the numbers.", "history": [["1 + 1?", "2"]], "instruction": "And 20 + 22?",
                "output": "20 + 22 = 42"}),
    ("prompt_completion", {"prompt": TWO_TURNS[:4], "completion": TWO_TURNS[4:]}),
])
def test_each_format_trains_the_tokens_of_the_same_chat_as_messages(tmp_path, tokenizer, fmt, row):
    expected = as_messages(tmp_path, tokenizer, [{"messages": TWO_TURNS}])
    if fmt == "prompt_completion":  # TRL trains the completion only: the prompt's assistant turn is context
        expected = as_messages(tmp_path, tokenizer, [{"messages": TWO_TURNS[:2] + [{**TWO_TURNS[2], "train": False}]
                                                      + TWO_TURNS[3:]}])
    for data in ({"format": fmt}, {}):  # named, and detected (auto)
        got = [(ids, labels) for ids, labels, _ in tokenised(tmp_path, tokenizer, [row], **data)]
        assert got == expected, data


def test_alpaca_input_joins_the_instruction_and_prompt_completion_strings_are_one_exchange(tmp_path, tokenizer):
    alpaca = tokenised(tmp_path, tokenizer, [{"instruction": "Add:", "input": "3 + 4", "output": "7"}])
    assert [(ids, labels) for ids, labels, _ in alpaca] == as_messages(tmp_path, tokenizer, [chat("Add:\n\n3 + 4", "7")])
    strings = tokenised(tmp_path, tokenizer, [{"prompt": "Add: 3 + 4", "completion": "7"}])
    assert [(ids, labels) for ids, labels, _ in strings] == as_messages(tmp_path, tokenizer, [chat("Add: 3 + 4", "7")])


def test_mapped_columns_name_the_files_fields(tmp_path, tokenizer):
    rows = [{"convs": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}], "difficulty": 3}]
    f = write_jsonl(tmp_path / "mapped.jsonl", rows)
    data = load_sft_datasets(DataSpec(train_file=str(f), max_length=128, columns={"messages": "convs",
                                                                                  "score": "difficulty"}), tokenizer)
    assert data.train["difficulty_score"] == [3.0]
    assert data.identity["columns"] == {"messages": "convs", "score": "difficulty"}  # in the data hash


@pytest.mark.parametrize("rows, data, message", [
    ([chat("1?", "1"), {"conversations": [{"from": "human", "value": "2?"}, {"from": "gpt", "value": "2"}]}], {},
     "rows.jsonl:2: row: a sharegpt row in a file whose first row is messages: a file holds one format"),
    ([{"conversations": [{"from": "human", "value": "2?"}, {"from": "robot", "value": "2"}]}], {},
     "rows.jsonl:1: conversations[1].from: cannot map 'robot' to a role"),
    ([{"conversations": [{"from": "human", "value": "2?"}, {"from": "function_call", "value": "{name: f}"}]}], {},
     "rows.jsonl:1: conversations[1].value: a function_call's value is not JSON"),
    ([{"text": "no chat here"}], {}, "rows.jsonl:1: row: no column of a known format: expected one of messages"),
    ([chat("1?", "1")], {"columns": {"messages": "convs"}}, "rows.jsonl:1: row: no column of a known format"),
    ([{"instruction": "Add 1 and 1."}], {"format": "alpaca"}, "rows.jsonl:1: output: missing"),
    ([chat("1?", "1")], {"format": "messages", "columns": {"messages": "convs"}}, "rows.jsonl:1: convs: missing"),
    ([chat("1?", "1")], {"format": "sharegpt"}, "rows.jsonl:1: conversations: missing (data.format=sharegpt"),
    ([chat("1?", "1")], {"format": "prompt_completion"}, "rows.jsonl:1: completion: missing"),
    ([{"prompt": "1?", "completion": 2}], {}, "rows.jsonl:1: completion: must be a string or a non-empty list"),
    ([{"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1", "weight": -1}]}], {},
     "rows.jsonl:1: messages[1].weight: must be a finite number >= 0, got -1"),
    ([{"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1", "weight": "2"}]}], {},
     "rows.jsonl:1: messages[1].weight: must be a finite number >= 0, got '2'"),
    ([{"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1", "train": "no"}]}], {},
     "rows.jsonl:1: messages[1].train: must be true or false, got 'no'"),
    ([{"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1", "weight": 0}]}], {},
     "rows.jsonl:1: messages: every assistant turn has weight 0 or train false (nothing to train on)"),
])
def test_bad_rows_of_every_format_name_file_line_and_field(tmp_path, tokenizer, rows, data, message):
    with pytest.raises(DataError) as e:
        tokenised(tmp_path, tokenizer, rows, **data)
    assert message in str(e.value)


def test_per_turn_weights_and_train_false_weigh_each_turns_tokens(tmp_path, tokenizer):
    """Weight 2 on the first answer, train false on a second chat's first answer: the collator's loss weights
    are 2 on every token of the first turn and 1 on the second; an untrained turn has no label."""
    weighted = [dict(m) for m in TWO_TURNS]
    weighted[2]["weight"] = 2.0
    untrained = [dict(m) for m in TWO_TURNS]
    untrained[2]["train"] = False
    (ids, labels, weights), (ids2, labels2, _) = tokenised(tmp_path, tokenizer, [{"messages": weighted},
                                                                                 {"messages": untrained}])
    [(plain_ids, plain_labels)] = as_messages(tmp_path, tokenizer, [{"messages": TWO_TURNS}])
    assert ids == plain_ids and labels == plain_labels  # the weight changes no label
    first, second = labelled_runs(ids, labels)
    batch = WeightedDataCollator(tokenizer)([{"input_ids": ids, "labels": labels, "token_weights": weights,
                                              "sample_weight": 1.0, "source_line": 1}])
    trained = batch["weights"][0][torch.tensor(labels) != -100].tolist()
    assert trained == [2.0] * len(first) + [1.0] * len(second)
    assert labelled_runs(ids2, labels2) == [second]
    last_only = tokenised(tmp_path, tokenizer, [{"messages": TWO_TURNS}], train_on="last")
    assert [(i, lab) for i, lab, _ in last_only] == [(ids2, labels2)]  # train_on=last: the last answer only


def test_the_step_loss_with_turn_weights_is_the_weighted_mean_of_the_models_own_token_losses(tmp_path, tokenizer):
    """One row, one step of loss=ce: the logged loss is sum(w * ce) / sum(w) over its trained tokens, the
    per-token ce computed here from the model's own logits, w = 3 on the first answer and 1 on the second."""
    from sft.model.loading import load_model

    weighted = [dict(m) for m in TWO_TURNS]
    weighted[2]["weight"] = 3.0
    row = {"messages": weighted, "difficulty_score": 1.0}
    model = load_model("tiny")
    [(ids, labels, _)] = tokenised(tmp_path, tokenizer, [row])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    targets = torch.tensor(labels[1:])
    ce = torch.nn.functional.cross_entropy(logits, targets.clamp_min(0), reduction="none")[targets != -100]
    first, second = labelled_runs(ids, labels)
    w = torch.tensor([3.0] * len(first) + [1.0] * len(second))
    expected = float((w * ce).sum() / w.sum())
    losses, _, _ = train_steps(tmp_path / "train", tokenizer, CrossEntropyLoss(), batch_size=1, accumulation=1,
                               rows=[row], steps=1, model=model)
    assert losses[0] == pytest.approx(expected, abs=1e-5)


def test_turn_weights_are_exact_under_gradient_accumulation(tmp_path, tokenizer):
    rows = []
    for k in range(8):
        messages = [dict(m) for m in TWO_TURNS]
        messages[2]["weight"] = [0.5, 2.0, 0.0, 1.0][k % 4]
        messages[4]["content"] = f"20 + {k} = {20 + k}"
        rows.append({"messages": messages, "difficulty_score": float(k % 3)})
    loss = CrossEntropyLoss()
    losses_a, params_a, _ = train_steps(tmp_path / "a", tokenizer, loss, batch_size=4, accumulation=1, rows=rows)
    losses_b, params_b, _ = train_steps(tmp_path / "b", tokenizer, loss, batch_size=1, accumulation=4, rows=rows)
    assert losses_a == pytest.approx(losses_b, abs=1e-5)
    torch.testing.assert_close(params_a, params_b, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_cli_a_sharegpt_file_trains_and_a_bad_format_is_one_line(tmp_path):
    f = write_jsonl(tmp_path / "share.jsonl", [
        {"conversations": [{"from": "human", "value": f"{a} + {a}?"}, {"from": "gpt", "value": str(2 * a)}],
         "difficulty": float(a % 4)} for a in range(40)])
    common = ["data=jsonl", f"data.train_file={f}", "data.columns.score=difficulty", "trainer.max_steps=2",
              "trainer.eval_strategy=no", "trainer.save_strategy=no", "trainer.report_to=[]"]
    proc = run_train(*common, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "format sharegpt (data.format=auto" in (tmp_path / "run/train.log").read_text()
    assert json.loads((tmp_path / "run/results.json").read_text())["global_step"] == 2
    bad = run_train(*common, "data.format=csv", f"hydra.run.dir={tmp_path}/bad")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "data.format='csv': must be one of auto, messages, sharegpt, alpaca, prompt_completion" in bad.stderr
    bad = run_train(*common, "data.columns.answer=out", f"hydra.run.dir={tmp_path}/bad2")  # misspelt: composition
    assert bad.returncode != 0 and "answer" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_inspect_data_shows_a_turns_weight_and_leaves_an_untrained_turn_unmarked(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    f = write_jsonl(tmp_path / "w.jsonl", [{"messages": [
        {"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "3", "train": False},
        {"role": "user", "content": "Wrong. 1 + 1?"}, {"role": "assistant", "content": "2", "weight": 2.0}]}])
    proc = subprocess.run([sys.executable, "-m", "sft", "inspect", "data=jsonl", f"data.train_file={f}", "loss=ce"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\u27e62<|im_end|>\u27e7\u00d72" in proc.stdout and "\u27e63" not in proc.stdout


def test_the_columns_schema_names_every_field_of_every_format():
    import dataclasses

    from sft.data.rows.formats import COLUMN_KEYS
    from sft.data.spec import ColumnsConfig

    assert {f.name for f in dataclasses.fields(ColumnsConfig)} == set(COLUMN_KEYS)


TOOL_DEF = {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def rendered(tmp_path, tokenizer, rows, **data) -> list[str]:
    """Each row's text as it trains (its first sequence), decoded."""
    data.setdefault("default_score", 1.0)
    f = write_jsonl(tmp_path / "rows.jsonl", rows)
    split = load_sft_datasets(DataSpec(train_file=str(f), max_length=512, **data), tokenizer).train
    return [tokenizer.decode(r["input_ids"], skip_special_tokens=False) for r in split]


def test_an_empty_tools_list_is_no_tools_and_bare_definitions_are_wrapped(tmp_path):
    """LLaMA-Factory's "tools": "[]" (109 of its 300 glaive rows) is no tools: a Llama-3.1 template writes no tool
    preamble for it; its bare {name, parameters} definitions reach the template as {type: function, function}."""
    from chat_templates import family_tokenizer

    tokenizer = family_tokenizer("tool_preamble")
    share = {"conversations": [{"from": "human", "value": "1 + 1?"}, {"from": "gpt", "value": "2"}]}
    for tools in ("[]", [], ""):
        [text] = rendered(tmp_path, tokenizer, [{**share, "tools": tools}])
        assert "Environment: ipython" not in text
    [text] = rendered(tmp_path, tokenizer, [{**share, "tools": json.dumps([TOOL_DEF])}])
    assert "Environment: ipython" in text and json.dumps(TOOL_DEF) in text


def test_the_tools_and_system_columns_of_every_format_by_any_name(tmp_path):
    from chat_templates import family_tokenizer

    tokenizer = family_tokenizer("qwen25_tools")
    share = {"conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "gpt", "value": "Sunny."}]}
    [text] = rendered(tmp_path, tokenizer, [{**share, "functions": [TOOL_DEF], "sys": "Be brief."}],
                      columns={"tools": "functions", "system": "sys"})
    assert '"name": "get_weather"' in text and text.startswith("<|im_start|>system\nBe brief.")
    # ShareGPT's own system column, which the template's default system prompt no longer replaces
    [text] = rendered(tmp_path, tokenizer, [{**share, "system": "Be brief."}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    [text] = rendered(tmp_path, tokenizer, [{"messages": [{"role": "user", "content": "1?"},
                                                          {"role": "assistant", "content": "1"}], "system": "Be brief."}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(DataError, match="rows.jsonl:1: system: the row has a system column and a different system turn"):
        rendered(tmp_path, tokenizer, [{"messages": [{"role": "system", "content": "Be long."},
                                                     {"role": "user", "content": "1?"}, {"role": "assistant", "content": "1"}],
                                        "system": "Be brief."}])


def test_llama_factorys_dataset_info_names_map_the_columns(tmp_path, tokenizer):
    """Its dataset_info.json `columns`: prompt/query/response for Alpaca, messages for ShareGPT's conversations."""
    expected = as_messages(tmp_path, tokenizer, [chat("Add:\n\n3 + 4", "7")])
    alpaca = tokenised(tmp_path, tokenizer, [{"q": "Add:", "x": "3 + 4", "a": "7"}],
                       columns={"prompt": "q", "query": "x", "response": "a"})
    assert [(ids, labels) for ids, labels, _ in alpaca] == expected
    share = {"conversations": [{"from": "human", "value": "Add:\n\n3 + 4"}, {"from": "gpt", "value": "7"}]}
    mapped = tokenised(tmp_path, tokenizer, [share], columns={"messages": "conversations"})
    assert [(ids, labels) for ids, labels, _ in mapped] == expected


def test_content_parts_and_loss_weight_of_llama_factorys_v1_rows(tmp_path):
    """Its reason_tool_use rows: content a list of text, reasoning and tool_call parts, per-turn loss_weight."""
    from chat_templates import family_tokenizer

    tokenizer = family_tokenizer("qwen25_tools")
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    v1 = {"messages": [
        {"role": "user", "content": [{"type": "text", "value": "Weather in Paris?"}], "loss_weight": 0.0},
        {"role": "assistant", "content": [{"type": "reasoning", "value": "I should call it."},
                                          {"type": "tool_call", "value": json.dumps(call)}], "loss_weight": 2.0},
        {"role": "tool", "content": [{"type": "text", "value": "18 C"}]},
        {"role": "assistant", "content": [{"type": "text", "value": "It is 18 C."}]}], "tools": json.dumps([TOOL_DEF])}
    plain = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call it.", "weight": 2.0,
         "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "It is 18 C."}], "tools": [TOOL_DEF]}
    assert tokenised(tmp_path, tokenizer, [v1]) == tokenised(tmp_path, tokenizer, [plain], name="plain.jsonl")
    with pytest.raises(DataError, match=r"rows.jsonl:1: messages\[0\].content\[0\]: a 'image' part"):
        tokenised(tmp_path, tokenizer, [{"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]},
                                                      {"role": "assistant", "content": "1"}]}])


def test_a_problem_of_every_row_is_one_line_naming_the_knob_before_any_row_is_tokenised(tmp_path, tokenizer,
                                                                                        monkeypatch):
    """The default loss on a file without scores: one line, with loss=ce among the ways out, and no tokenising."""
    from sft.data.splits import preprocess
    from sft.loss.builtin import HardSampleLoss

    f = write_jsonl(tmp_path / "unscored.jsonl", [{"messages": chat(f"{a} + 1?", str(a + 1))["messages"]}
                                                  for a in range(999)])
    monkeypatch.setattr(preprocess, "tokenize_batch", lambda *a, **k: pytest.fail("tokenised"))
    with pytest.raises(DataError) as e:
        load_sft_datasets(DataSpec(train_file=str(f), max_length=128), tokenizer, HardSampleLoss())
    lines = str(e.value).splitlines()
    assert lines[0] == "999 bad row(s) in the data:" and len(lines) == 2
    assert f"{f}:1: difficulty_score: missing (used by loss.alpha=1: set data.default_score=" in lines[1]
    assert "loss=ce" in lines[1] and "the same in 998 more row(s) (lines 2, 3, 4, 5, 6, ...)" in lines[1]
    bad = write_jsonl(tmp_path / "keys.jsonl", [{"messages": [{"speaker": "user", "text": "1?"}]}] * 3)
    with pytest.raises(DataError, match=r"keys.jsonl:1: messages\[0\].role: missing \(the turn has speaker, text; a "
                                        r"turn is \{role, content\}, or ShareGPT's \{from, value\}\); the same in 2 more"):
        load_sft_datasets(DataSpec(train_file=str(bad), max_length=128), tokenizer)


def test_a_functions_column_is_read_as_the_tool_definitions(tmp_path):
    """OpenAI's older name for `tools`: ignored, the calls trained without their definitions."""
    from sft.data.rows.formats import RowFormat

    definition = {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
           "functions": [definition]}
    out = RowFormat()(row)
    assert out["tools"] == [{"type": "function", "function": definition}] and "functions" not in out


def test_a_system_prompt_column_beside_functions_is_the_chats_system_turn():
    """glaive-function-calling's own form: its `system_prompt` was dropped, the template's default system prompt
    trained in its place."""
    from sft.data.rows.formats import FormatError, RowFormat

    definition = {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}
    chat = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Sunny."}]
    row = {"messages": chat, "functions": [definition], "system_prompt": "You are a weather assistant."}
    out = RowFormat()(row)
    assert out["messages"] == [{"role": "system", "content": "You are a weather assistant."}, *chat]
    assert "system_prompt" not in out and out["tools"] == [{"type": "function", "function": definition}]
    named = RowFormat(columns={"system": "sys"})({**row, "sys": "Be brief."})  # a mapped column wins; the other stays
    assert named["messages"][0]["content"] == "Be brief." and named["system_prompt"] == row["system_prompt"]
    with pytest.raises(FormatError, match="system_prompt: the row has a system column and a different system turn"):
        RowFormat()({**row, "messages": [{"role": "system", "content": "Other."}, *chat]})
