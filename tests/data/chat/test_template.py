"""The chat template as the labelling reads it (`sft.data.chat.template`): a template's own Python error, or one
that does not compile, is a refusal naming it; the form a template reads tool-call arguments and definitions in is
probed, and each row is given that form."""

import json

import pytest
from chat_templates import family_tokenizer
from chat_views import AGENT, PLAIN, SYSTEM, TOOLS, TURNS, call, labelled
from conftest import write_jsonl
from tool_chats import WEATHER_CHAT, WEATHER_TOOLS

from sft.data.chat.template import ChatRenderer, Refused
from sft.data.chat.turns import chat_views
from sft.data.load import load_sft_datasets
from sft.data.rows.reading import DataError
from sft.data.spec import DataSpec


def test_a_chat_the_template_refuses_is_reported_with_its_line_or_skipped_and_counted(tmp_path):
    tokenizer = family_tokenizer("gemma")
    bad = {"messages": [TURNS[0], TURNS[2], TURNS[3]], "difficulty_score": 1.0}  # two user turns in a row
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [SYSTEM, *TURNS], "difficulty_score": 1.0}, bad])
    with pytest.raises(DataError, match=r"chats.jsonl:2: messages: the chat template refuses this chat: "
                                        r"Conversation roles must alternate.* \(data.on_error=skip leaves such rows "
                                        r"out, counted, and trains the others\)"):
        load_sft_datasets(DataSpec(train_file=str(path), max_length=256), tokenizer)
    rejected = tmp_path / "rejected.jsonl"
    data = load_sft_datasets(DataSpec(train_file=str(path), max_length=256, on_error="skip"), tokenizer,
                             rejected_file=str(rejected))
    assert len(data.train) == 1 and data.summary["train"].rejected == 1
    record = json.loads(rejected.read_text())
    assert record["line"] == 2 and record["field"] == "messages" and json.loads(record["row"]) == bad
    with pytest.raises(DataError, match="chats.jsonl:2"):  # the cache a skipping run wrote does not hide it
        load_sft_datasets(DataSpec(train_file=str(path), max_length=256), tokenizer)


@pytest.mark.parametrize("family, arguments", [("arguments_as_text", {"city": "Paris"}),
                                               ("arguments_as_text", '{"city": "Paris"}'),
                                               ("next_role", '{"city": "Paris"}')])
def test_call_arguments_reach_the_template_in_the_form_it_reads(family, arguments):
    """DeepSeek-V3.1 adds the arguments to text (an object is a TypeError there), GLM iterates them (text is its
    refusal): each gets them in its form, whichever form the row gave."""
    tokenizer = family_tokenizer(family)
    runs = labelled(tokenizer, [AGENT[0], call(arguments), *AGENT[2:]], tools=TOOLS)
    assert "Paris" in runs[0][0] and runs[0][0].endswith(tuple(ChatRenderer(tokenizer).profile.stops))
    if family == "arguments_as_text":  # a call-only turn's null content: no empty answer of its own
        assert runs == [['<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
                         "<｜end▁of▁sentence｜>", "It is 18 C.<｜end▁of▁sentence｜>"]]
        assert ChatRenderer(tokenizer).profile.null_content
        text = ChatRenderer(tokenizer)(ChatRenderer(tokenizer).prepare(AGENT[:2]), TOOLS)
        assert "<｜Assistant｜><｜end▁of▁sentence｜>" not in text
    assert not ChatRenderer(family_tokenizer("chatml")).profile.null_content  # it adds content to text: ""


@pytest.mark.parametrize("messages, tools, field, message", [
    (PLAIN, None, "messages", "the chat template fails on this chat (TypeError: 'NoneType' object is not iterable); "
                              "a tool-use template may need the row's tools"),
    (AGENT, [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {
        "type": "object", "properties": {"city": {"type": "str"}}}}}], "tools",
     "the chat template fails on these tool definitions (RecursionError: maximum recursion depth exceeded"),
])
def test_a_templates_python_error_is_a_refusal_naming_its_message(messages, tools, field, message):
    tokenizer = family_tokenizer("tools_required")
    with pytest.raises(Refused) as e:
        chat_views(tokenizer, messages, tools=tools)
    assert e.value.field == field and message in e.value.reason


def test_a_template_that_does_not_compile_is_one_config_error(tmp_path):
    from sft.config import ConfigError

    tokenizer = family_tokenizer("chatml")
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }"
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": PLAIN, "difficulty_score": 1.0}])
    with pytest.raises(ConfigError, match="tokenizer.chat_template: the chat template does not compile"):
        load_sft_datasets(DataSpec(train_file=str(path), max_length=256), tokenizer)


@pytest.mark.slow
def test_cli_a_template_that_fails_on_some_rows_refuses_them_in_one_line_or_skips_and_counts_them(tmp_path):
    """sft.commands.inspect and sft.train with a template (a .jinja file, as llama.cpp keeps them) that raises a Python
    error on chats without tools: the row named, no traceback; data.on_error=skip trains the others."""
    import subprocess
    import sys

    from chat_templates import TOOLS_REQUIRED
    from conftest import REPO, run_train

    template = tmp_path / "hermes-like.jinja"
    template.write_text(TOOLS_REQUIRED)
    tool = TOOLS[0]
    rows = [{"messages": [{"role": "user", "content": f"{a} + {a}?"}, {"role": "assistant", "content": str(2 * a)}],
             "difficulty_score": 1.0, **({"tools": [tool]} if a % 4 else {})} for a in range(24)]
    f = write_jsonl(tmp_path / "rows.jsonl", rows)
    common = ["data=jsonl", f"data.train_file={f}", f"tokenizer.chat_template={template}", "loss=ce"]
    proc = subprocess.run([sys.executable, "-m", "sft", "inspect", *common], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{f}:1: messages: the chat template fails on this chat (TypeError: 'NoneType' object is not iterable)" \
           in proc.stderr and "the same in 5 more row(s) (lines 5, 9, 13, 17, 21)" in proc.stderr
    run = run_train(*common, "data.on_error=skip", "trainer.max_steps=2", "trainer.eval_strategy=no",
                    "trainer.save_strategy=no", "trainer.report_to=[]", f"hydra.run.dir={tmp_path}/run")
    assert run.returncode == 0, run.stderr[-3000:]
    rejected = [json.loads(line) for line in (tmp_path / "run/rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [1, 5, 9, 13, 17, 21] and {r["field"] for r in rejected} == {"messages"}
    assert "skipped 6 invalid row(s)" in (tmp_path / "run/train.log").read_text()


def test_a_template_that_takes_only_ids_of_its_form_still_reads_the_arguments_as_json():
    """Mistral-Nemo (9-character ids): the row's JSON-text arguments train as JSON, not as a JSON string of it."""
    tokenizer = family_tokenizer("strict_ids")
    row = [AGENT[0], {**call('{"city": "Paris"}'), "tool_calls": [{**call('{"city": "Paris"}')["tool_calls"][0],
                                                                    "id": "a1b2c3d4e"}]},
           {**AGENT[2], "tool_call_id": "a1b2c3d4e"}, AGENT[3]]
    runs = labelled(tokenizer, row, tools=TOOLS)
    assert runs[0][0] == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}<|im_end|>'


def test_definitions_in_openais_form_reach_a_template_that_reads_them_bare_as_it_reads_them():
    """Apertus: a template that reads each definition bare (`tool.name`) shows OpenAI's wrapped form as a nameless
    tool; the row's definitions go to it unwrapped, the prompt shows the tool and its parameters, and the call trains
    (it was refused, blaming the chat). A template that reads OpenAI's form gets the row's definitions unchanged."""
    from sft.data.chat.template import prompt_text

    tokenizer = family_tokenizer("bare_definitions")
    assert ChatRenderer(tokenizer).profile.definitions == ("bare",)
    assert TOOLS[0]["type"] == "function" and "function" in TOOLS[0]  # the row's definitions: OpenAI's form
    prompt = prompt_text(tokenizer, AGENT[:1], TOOLS)
    assert "type get_weather = (_: {city: any, }) => any;" in prompt and "type  =" not in prompt
    runs = labelled(tokenizer, AGENT, tools=TOOLS)
    assert runs[0] == ['<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>', "It is 18 C.<|im_end|>"], runs
    as_json = ChatRenderer(family_tokenizer("json_content"))
    assert as_json.profile.definitions == ("openai", "bare")  # `tools | tojson`: either form is shown, as it is
    bare = [TOOLS[0]["function"]]
    assert as_json.prepare_tools(TOOLS) == TOOLS and as_json.prepare_tools(bare) == bare
    assert ChatRenderer(family_tokenizer("no_definitions")).prepare_tools(TOOLS) == TOOLS  # none shown: as it is


def test_a_call_only_turns_null_content_written_as_json_is_not_trained():
    """LFM2: `content | tojson` writes a null content as `null`, which would train after the call."""
    tokenizer = family_tokenizer("json_content")
    runs = labelled(tokenizer, AGENT, tools=TOOLS)
    assert runs[0][0] == '<tool_call>get_weather({"city": "Paris"})</tool_call>\n""<|im_end|>'  # "" as the template
    assert not ChatRenderer(tokenizer).profile.null_content  # writes an empty content


def test_a_template_that_fails_on_an_argument_form_gets_the_form_it_takes():
    """Apertus's first import concatenated a call's arguments as text: an object failed inside the template
    (`TypeError: can only concatenate str (not "dict") to str`). Where the form probe can tell, rows are converted to
    the text it takes and train; where it cannot (the probe chat refused: it refused such rows, asking for JSON
    text), the chat that fails is rendered again with its calls' arguments as text, and trains the same tokens as a
    row that gave them so."""
    from sft.data.chat.settings import configure_chat

    chat = [WEATHER_CHAT[0], {**WEATHER_CHAT[1], "content": ""}, WEATHER_CHAT[2], WEATHER_CHAT[3]]
    runs = labelled(family_tokenizer("arguments_concatenated"), chat, tools=WEATHER_TOOLS)
    assert sorted(run for sequence in runs for run in sequence) == [
        '<call>get_weather {"city": "Paris"}</call><|im_end|>', "It is 18 C and sunny.<|im_end|>"]
    strict = configure_chat(family_tokenizer("arguments_concatenated"), {"strict": True})
    system = [{"role": "system", "content": "Be brief."}]
    as_text = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": '{"city": "Paris"}'}}
                                    for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in chat]
    converted, given = (labelled(strict, [*system, *rows], tools=WEATHER_TOOLS) for rows in (chat, as_text))
    assert converted == given and any("get_weather" in run for sequence in given for run in sequence)
