"""Assistant-only labels under the chat templates of the major families (`tests/chat_templates.py`): a
multi-turn chat trains exactly each answer and its end-of-turn token, in every turn, as the model writes it
after the rendering of the chat before it; turns a template rewrites later are trained from their own
rendering, or refused; a chat a template cannot label is refused with its line, never mislabelled. Tool calls
train with their turn, tool results and definitions are context."""

import json

import pytest
import torch
from chat_templates import FAMILIES, QUIRKS, family_tokenizer
from conftest import labelled_runs, write_jsonl
from tool_chats import WEATHER_CALL, WEATHER_CHAT, WEATHER_TOOLS, trained_on

from sft.data.labels import tokenize_batch
from sft.data.load import load_sft_datasets
from sft.data.rows import DataError
from sft.data.spec import DataSpec, Labelling
from sft.data.templates import ChatRenderer, Refused, stop_token_ids
from sft.data.turns import chat_views

SYSTEM = {"role": "system", "content": "Be brief."}


TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "3 and 3 make 6."},
]


def trained_runs(tokenizer, messages, **knobs) -> list[list[str]]:
    """For each sequence a chat trains as, the decoded runs of consecutive labelled tokens (`knobs`: `Labelling`'s)."""
    out = tokenize_batch({"messages": [messages], "difficulty_score": [1.0], "source_line": [7]}, tokenizer,
                         Labelling(max_length=4096, **knobs)).to_pydict()
    assert not any(out["refused"]), out["refused"]
    return [[tokenizer.decode(run, skip_special_tokens=False) for run in labelled_runs(ids, labels)]
            for ids, labels in zip(out["input_ids"], out["labels"])]


def expected(family: str, answers: list[tuple[str, str]]) -> list[str]:
    spec = FAMILIES[family]
    texts = [spec["answer"].format(a=a, r=r) for a, r in answers]
    if "last_answer" in spec:
        texts[-1] = spec["last_answer"].format(a=answers[-1][0], r=answers[-1][1])
    return texts


@pytest.mark.parametrize("family", ["chatml", "llama3", "gemma", "phi3"])
def test_every_answer_and_its_end_of_turn_token_are_trained_in_one_sequence(family):
    runs = trained_runs(family_tokenizer(family), [SYSTEM, *TURNS])
    assert runs == [expected(family, [("4", ""), ("6", "")])]


def test_mistral_trains_every_answer_and_refuses_a_system_prompt_its_template_drops():
    tokenizer = family_tokenizer("mistral")
    assert trained_runs(tokenizer, TURNS) == [expected("mistral", [("4", ""), ("6", "")])]
    # Its template puts the system prompt into the user turn that ends the chat: a chat ending with an
    # answer has none, so the answer would be trained without the prompt it was given.
    out = tokenize_batch({"messages": [[SYSTEM, *TURNS]], "difficulty_score": [1.0], "source_line": [3]}, tokenizer,
                         Labelling(max_length=4096)).to_pydict()
    assert out["input_ids"] == [[]]
    field, reason = out["refused"][0].split("\t")
    assert field == "messages[2]" and "renders the chat before this turn differently once the turn is added" in reason
    assert "Be brief." in reason  # where the renderings part, quoted


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


def test_llama3_date_in_the_system_header_is_context_not_trained():
    tokenizer = family_tokenizer("llama3")
    text = tokenizer.apply_chat_template(TURNS, tokenize=False)
    assert "Today Date: " in text and "Cutting Knowledge Date" in text
    assert trained_runs(tokenizer, TURNS) == [expected("llama3", [("4", ""), ("6", "")])]


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


def test_evaluation_counts_every_sequence_of_a_chat_once(tmp_path):
    """A Qwen3 chat of two answers evaluates as two sequences of the same line: the exact eval loss is the
    token mean over both, as the model's own loss computes it on each."""
    from transformers import TrainingArguments

    from sft.data.collator import WeightedDataCollator
    from sft.loss.builtin import CrossEntropyLoss
    from sft.model.loading import load_model
    from sft.training.trainer import WeightedLossTrainer

    tokenizer = family_tokenizer("qwen3")
    rows = [{"messages": [SYSTEM, *TURNS], "difficulty_score": 1.0},
            {"messages": TURNS[:2], "difficulty_score": 2.0}]
    path = write_jsonl(tmp_path / "eval.jsonl", rows)
    data = load_sft_datasets(DataSpec(train_file=str(path), eval_file=str(path), max_length=256), tokenizer)
    assert len(data.eval) == 3 and data.summary["eval"].own_turn_texts == 1
    model = load_model("tiny")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=2, use_cpu=True,
                             report_to=[], remove_unused_columns=False)
    trainer = WeightedLossTrainer(model=model, args=args, eval_dataset=data.eval, loss=CrossEntropyLoss(),
                                  data_collator=WeightedDataCollator(tokenizer))
    metrics = trainer.evaluate()
    ce_sum, tokens = 0.0, 0
    with torch.no_grad():
        for row in data.eval:
            labels = torch.tensor([row["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            ce_sum += model(input_ids=torch.tensor([row["input_ids"]]), labels=labels).loss.item() * n
            tokens += n
    assert metrics["eval_ce"] == pytest.approx(ce_sum / tokens, rel=1e-5)


PLAIN = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def call(arguments) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


AGENT = [{"role": "user", "content": "Weather in Paris?"}, call('{"city": "Paris"}'),
         {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"},
         {"role": "assistant", "content": "It is 18 C."}]


def labelled(tokenizer, messages, tools=None, **knobs) -> list[list[str]]:
    """The decoded runs of labelled tokens of each sequence a chat trains as (through the tokens, as training
    gets them; `knobs`: `Labelling`'s)."""
    batch = {"messages": [messages], "difficulty_score": [1.0], "source_line": [1],
             "tools": [json.dumps(tools) if tools else ""]}
    out = tokenize_batch(batch, tokenizer, Labelling(max_length=4096, **knobs)).to_pydict()
    assert not any(out["refused"]), out["refused"]
    return [[tokenizer.decode(run, skip_special_tokens=False) for run in labelled_runs(ids, labels)]
            for ids, labels in zip(out["input_ids"], out["labels"])]


def answers(family: str, *texts: str) -> list[str]:
    """Each answer as the family's template writes it, through its stop token: the oracle."""
    return [QUIRKS[family]["answer"].format(a=a) for a in texts]


def test_a_template_that_writes_the_eos_only_after_the_last_answer_trains_every_answer_with_it():
    """gpt-oss: in the whole chat the first answer ends <|end|>, which stops nothing; the model writes <|return|>
    whenever it answers, so that answer trains from its own rendering, <|return|> and all."""
    tokenizer = family_tokenizer("eos_after_last")
    runs = labelled(tokenizer, PLAIN)
    assert runs == [answers("eos_after_last", "6"), answers("eos_after_last", "4")]
    assert all(not run.endswith("<|end|>") for seq in runs for run in seq)


def test_the_next_turns_header_a_template_writes_after_every_chat_is_never_trained():
    """Command-R7B: one sequence, each answer through <|END_OF_TURN_TOKEN|>, the header after it context."""
    tokenizer = family_tokenizer("next_header")
    assert labelled(tokenizer, PLAIN) == [answers("next_header", "4", "6")]
    assert ChatRenderer(tokenizer)(PLAIN).endswith("<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")


def test_where_a_turn_has_no_end_token_the_next_roles_stop_token_is_trained_also_after_the_last_answer():
    """GLM-4.6: <|user|> (the next turn's role, a stop token of its generation config) ends each answer, the chat's
    last one too (added after it); a tool call is ended by <|observation|>, which its result begins with."""
    tokenizer = family_tokenizer("next_role")
    assert labelled(tokenizer, PLAIN) == [answers("next_role", "4", "6")]
    runs = labelled(tokenizer, [AGENT[0], call({"city": "Paris"}), *AGENT[2:]], tools=TOOLS)
    assert runs == [["\n<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>\n</tool_call>"
                     "<|observation|>", "\nIt is 18 C.<|user|>"]]
    assert set(stop_token_ids(tokenizer)) >= set(tokenizer.convert_tokens_to_ids(["<|user|>", "<|observation|>"]))


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


def test_a_prompt_the_template_renders_otherwise_once_the_answer_follows_is_trained_as_the_model_saw_it():
    """Hermes-3 ends a tool result that ends the chat without the newline it has before a following answer: the
    answer trains after the prompt the model answers (a sequence of its own); data.rewritten_turns=skip leaves
    it untrained, refuse refuses the row."""
    tokenizer = family_tokenizer("tools_required")
    runs = labelled(tokenizer, AGENT, tools=TOOLS)
    assert runs == [['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'],
                    ["It is 18 C.<|im_end|>"]]
    assert labelled(tokenizer, AGENT, tools=TOOLS, rewritten_turns="skip") == [runs[0]]
    with pytest.raises(Refused, match="data.rewritten_turns=split trains it after its own prompt"):
        chat_views(tokenizer, AGENT, tools=TOOLS, labelling=Labelling(rewritten_turns="refuse"))


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


REASONED_CHAT = [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]


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
    from sft.data.chat_settings import configure_chat

    with pytest.raises(Refused) as refused:
        chat_views(family_tokenizer(family), REASONED_CHAT)
    assert f"the generation prompt closes the reasoning ({closed}" in refused.value.reason
    (name, value), = switch.items()
    assert f"+tokenizer.chat_template_kwargs.{name}={'true' if value is True else value}" in refused.value.reason
    assert labelled(configure_chat(family_tokenizer(family), switch), REASONED_CHAT) == [[trained]]


def test_reasoning_a_template_drops_whatever_it_is_given_is_refused_saying_it_cannot_train():
    """QwQ's and the R1 distills' current copies drop every answer's reasoning, and their switch only opens the
    prompt's think block: the refusal named `enable_thinking=true`, which, set, was refused again naming it. Every
    change tried, it says the reasoning cannot train with this template, and what trains the answer without it."""
    from sft.data.chat_settings import configure_chat

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


def test_template_kwargs_reach_the_template_and_the_reasoning_it_then_drops_is_counted(tmp_path):
    from sft.data.chat_settings import configure_chat

    reasoned = [PLAIN[0], {**PLAIN[1], "reasoning_content": "2 and 2."}]
    thinking = family_tokenizer("thinking_switch")
    assert labelled(thinking, reasoned) == [["<think>\n2 and 2.\n</think>\n\n4<|im_end|>"]]
    off = configure_chat(family_tokenizer("thinking_switch"), kwargs={"enable_thinking": False})
    assert labelled(off, reasoned) == [["4<|im_end|>"]]  # after the prefilled empty think block
    assert chat_views(off, reasoned).untrained_reasoning == 1
    path = write_jsonl(tmp_path / "r.jsonl", [{"messages": reasoned, "difficulty_score": 1.0}])
    kept = load_sft_datasets(DataSpec(train_file=str(path), max_length=256), thinking)
    dropped = load_sft_datasets(DataSpec(train_file=str(path), max_length=256), off)
    assert dropped.summary["train"].untrained_reasoning == 1 and kept.summary["train"].untrained_reasoning == 0
    assert dropped.identity["chat_template_kwargs"] == {"enable_thinking": False}
    assert dropped.data_hash != kept.data_hash


def test_a_turn_end_that_no_stop_token_of_the_model_names_is_trained_and_said_once(tmp_path, caplog):
    """A base model's ChatML (eos <|endoftext|>): answers train through the template's <|im_end|>, and the log says
    once that a server must stop at it; a template with no end at all is said to teach no stop."""
    base = family_tokenizer("base_chatml")
    assert labelled(base, PLAIN) == [answers("base_chatml", "4", "6")]
    assert ChatRenderer(base).profile.end_of_turn == "<|im_end|>"
    assert tokenizer_stop(base) == ["<|endoftext|>", "<|im_end|>"]
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": PLAIN, "difficulty_score": 1.0}] * 3)
    with caplog.at_level("WARNING", logger="sft.data"):
        load_sft_datasets(DataSpec(train_file=str(path), max_length=256), base)
        load_sft_datasets(DataSpec(train_file=str(path), max_length=256), family_tokenizer("plain_text"))
    notes = [r.getMessage() for r in caplog.records]
    assert sum("ends an answer with '<|im_end|>', which is not among the model's stop tokens" in n for n in notes) == 1
    assert sum("the model will not learn to stop" in n for n in notes) == 1


def tokenizer_stop(tokenizer) -> list[str]:
    return tokenizer.convert_ids_to_tokens(stop_token_ids(tokenizer))


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


def test_the_stop_tokens_are_the_models_own_unless_named_and_a_template_may_be_a_file(tmp_path):
    """load_tokenizer reads the eos ids of the model's generation_config.json (and the tokenizer's eos);
    tokenizer.stop_tokens replaces them (each one token); tokenizer.chat_template may name a .jinja file."""
    import shutil

    from sft.config import ConfigError
    from sft.data.chat_settings import chat_settings
    from sft.model.loading import load_tokenizer, tiny_model_dir

    tiny = load_tokenizer("tiny")
    assert chat_settings(tiny).stop_tokens == ("<|im_end|>",)
    assert chat_settings(tiny).stops_from == "generation_config.json's eos_token_id"
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), model)
    config = json.loads((model / "generation_config.json").read_text())
    ids = tiny.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": ids}))
    assert chat_settings(load_tokenizer(str(model))).stop_tokens == ("<|endoftext|>", "<|im_end|>")
    named = load_tokenizer(str(model), stop_tokens=["<|im_start|>"])
    assert chat_settings(named).stop_tokens == ("<|im_start|>",) and chat_settings(named).stops_from == \
        "tokenizer.stop_tokens"
    with pytest.raises(ConfigError, match=r"tokenizer.stop_tokens=\['</answer>'\]: '</answer>' is not one token"):
        load_tokenizer("tiny", stop_tokens=["</answer>"])
    template = tmp_path / "next-header.jinja"
    template.write_text(QUIRKS["next_header"]["template"])
    loaded = load_tokenizer("tiny", chat_template=str(template))
    assert loaded.chat_template == QUIRKS["next_header"]["template"]
    assert chat_settings(loaded).template_name == "tokenizer.chat_template (next-header.jinja)"
    with pytest.raises(ConfigError, match="tokenizer.chat_template='/nonexistent/t.jinja': cannot be read"):
        load_tokenizer("tiny", chat_template="/nonexistent/t.jinja")


def test_the_call_and_the_answer_train_the_tool_result_and_definitions_are_context(tmp_path):
    tokenizer = family_tokenizer("qwen25_tools")
    [(runs, text)] = trained_on(tmp_path, tokenizer, [{"messages": WEATHER_CHAT, "tools": WEATHER_TOOLS}])
    assert runs == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "It is 18 C and sunny.<|im_end|>"]
    assert '"description": "Weather of a city"' in text and "<tool_response>\n18 C, sunny\n</tool_response>" in text
    # arguments as JSON text (OpenAI's wire form) train the same tokens
    as_text = [dict(m) for m in WEATHER_CHAT]
    as_text[1] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    as_text[2] = {**WEATHER_CHAT[2], "tool_call_id": "call_1"}
    assert trained_on(tmp_path, tokenizer, [{"messages": as_text, "tools": WEATHER_TOOLS}])[0][0] == runs


def test_sharegpt_function_call_and_observation_turns_are_tool_calls_and_results(tmp_path):
    tokenizer = family_tokenizer("qwen25_tools")
    share = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                               {"from": "function_call", "value": json.dumps(WEATHER_CALL["function"])},
                               {"from": "observation", "value": "18 C, sunny"},
                               {"from": "gpt", "value": "It is 18 C and sunny."}],
             "tools": json.dumps(WEATHER_TOOLS)}  # LLaMA-Factory keeps them as JSON text
    messages = [{k: v for k, v in m.items() if k != "name"} for m in WEATHER_CHAT]
    assert trained_on(tmp_path, tokenizer, [share]) == trained_on(tmp_path, tokenizer, [{"messages": messages,
                                                                                   "tools": WEATHER_TOOLS}])


@pytest.mark.parametrize("rows, message", [
    ([{"messages": WEATHER_CHAT}],
     "agent.jsonl:1: messages[1].tool_calls: the chat template does not render this turn's "
                            "tool call ('get_weather'): the turn would train without it"),
    ([{"messages": WEATHER_CHAT[:1] + WEATHER_CHAT[3:], "tools": WEATHER_TOOLS}],
     "agent.jsonl:1: tools: the chat template does not render the tool definitions ('get_weather'"),
])
def test_a_template_that_renders_no_tool_calls_or_definitions_is_refused(tmp_path, rows, message):
    from sft.model.loading import load_tokenizer

    with pytest.raises(DataError) as e:
        trained_on(tmp_path, load_tokenizer("tiny"), rows)  # its ChatML template knows no tools
    assert message in str(e.value)


def test_a_template_that_takes_only_ids_of_its_form_still_reads_the_arguments_as_json():
    """Mistral-Nemo (9-character ids): the row's JSON-text arguments train as JSON, not as a JSON string of it."""
    tokenizer = family_tokenizer("strict_ids")
    row = [AGENT[0], {**call('{"city": "Paris"}'), "tool_calls": [{**call('{"city": "Paris"}')["tool_calls"][0],
                                                                    "id": "a1b2c3d4e"}]},
           {**AGENT[2], "tool_call_id": "a1b2c3d4e"}, AGENT[3]]
    runs = labelled(tokenizer, row, tools=TOOLS)
    assert runs[0][0] == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}<|im_end|>'


def test_calls_are_refused_where_the_template_never_shows_the_tool_definitions():
    """DeepSeek-V3.1: the definitions are not in the prompt, whatever the answers mention: a call would train with
    nothing in the prompt that defines it (the check looked for the tool's name anywhere, answers included)."""
    tokenizer = family_tokenizer("no_definitions")
    mentioning = [AGENT[0], call('{"city": "Paris"}'), AGENT[2], {"role": "assistant", "content": "get_weather says 18"}]
    with pytest.raises(Refused) as refused:
        chat_views(tokenizer, mentioning, TOOLS)
    assert refused.value.field == "tools" and "does not render the tool definitions" in refused.value.reason


def test_definitions_in_openais_form_reach_a_template_that_reads_them_bare_as_it_reads_them():
    """Apertus: a template that reads each definition bare (`tool.name`) shows OpenAI's wrapped form as a nameless
    tool; the row's definitions go to it unwrapped, the prompt shows the tool and its parameters, and the call trains
    (it was refused, blaming the chat). A template that reads OpenAI's form gets the row's definitions unchanged."""
    from sft.data.templates import prompt_text

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


@pytest.mark.parametrize("prefill", ["refuse", "after"])
def test_a_call_the_template_writes_otherwise_once_the_chat_goes_on_still_trains_its_stop(prefill):
    """Apriel-1.6: a call is written with its id and an end token only once more follows; the call trained (as the
    model writes it, last) ends with the end token the template writes after it (it trained with none)."""
    tokenizer = family_tokenizer("ids_once_continued")
    runs = labelled(tokenizer, AGENT, tools=TOOLS, prefill=prefill)  # the call, rewritten later: a sequence of its own
    assert sorted(run for sequence in runs for run in sequence) == [
        '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>\n<|im_end|>',
        "It is 18 C.\n<|im_end|>"]


def test_an_answer_with_reasoning_after_a_no_thinking_prompt_is_refused_naming_that_cause():
    """Qwen3 with enable_thinking=false, Hunyuan Hy3 by default: the refusal names the closed reasoning and the kwarg
    that opens it (it said the template renders the chat differently, or to give the answer reasoning it had)."""
    from sft.data.chat_settings import configure_chat

    tokenizer = configure_chat(family_tokenizer("no_think_prompt"), {"enable_thinking": False})
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]
    with pytest.raises(Refused) as refused:
        chat_views(tokenizer, chat, None)
    reason = refused.value.reason
    assert "This answer has reasoning, but the generation prompt closes the reasoning ('<think>\\n\\n</think>': the " \
           "template's no-thinking prompt, with the kwargs enable_thinking=False)" in reason
    assert "+tokenizer.chat_template_kwargs.enable_thinking=true" in reason and "Give the answer" not in reason


def test_a_chat_ending_with_a_call_the_template_ends_with_no_stop_is_refused_naming_the_stop_that_trains_it():
    """Apertus: a call ends with <|tools_suffix|> and the turn goes on with the tool's result, so no stop token follows
    a call, in the chat or once it goes on; it trained `<|tools_prefix|>...<|tools_suffix|>` with nothing the model
    could stop at, and no word. Refused, naming the stop tokens that train it; with them, it trains through the token."""
    from sft.data.chat_settings import configure_chat

    chat = WEATHER_CHAT[:2]
    with pytest.raises(Refused) as refused:
        chat_views(family_tokenizer("call_without_stop"), chat, WEATHER_TOOLS)
    assert refused.value.field == "messages[1]"
    assert ("ends this tool-calling turn with no token the model could stop at ('<|tools_prefix|>[{\"get_weather\": "
            "{\"city\": \"Paris\"}}]<|tools_suffix|>'; the stop tokens: '<|assistant_end|>')") in refused.value.reason
    assert ("add it to the stop tokens: tokenizer.stop_tokens=[<|assistant_end|>,<|tools_suffix|>]"
            in refused.value.reason)
    stopping = configure_chat(family_tokenizer("call_without_stop"), None, ["<|assistant_end|>", "<|tools_suffix|>"])
    assert labelled(stopping, chat, tools=WEATHER_TOOLS) == [
        ['<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>']]


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


def test_a_template_that_fails_on_an_argument_form_gets_the_form_it_takes_or_one_line_naming_it():
    """Apertus's first import concatenated a call's arguments as text: an object failed inside the template
    (`TypeError: can only concatenate str (not "dict") to str`). Where the form probe can tell, rows are converted to
    the text it takes and train; where it cannot (the probe chat refused), the refusal names the form."""
    from sft.data.chat_settings import configure_chat

    chat = [WEATHER_CHAT[0], {**WEATHER_CHAT[1], "content": ""}, WEATHER_CHAT[2], WEATHER_CHAT[3]]
    runs = labelled(family_tokenizer("arguments_concatenated"), chat, tools=WEATHER_TOOLS)
    assert sorted(run for sequence in runs for run in sequence) == [
        '<call>get_weather {"city": "Paris"}</call><|im_end|>', "It is 18 C and sunny.<|im_end|>"]
    strict = configure_chat(family_tokenizer("arguments_concatenated"), {"strict": True})
    with pytest.raises(Refused) as refused:
        chat_views(strict, [{"role": "system", "content": "Be brief."}, *chat], WEATHER_TOOLS)
    assert refused.value.reason == (
        'the chat template takes tool-call arguments as a JSON string and fails on them as an object (TypeError: can '
        'only concatenate str (not "dict") to str): give each call\'s arguments as a JSON string')
    as_text = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": '{"city": "Paris"}'}}
                                    for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in chat]
    assert chat_views(strict, [{"role": "system", "content": "Be brief."}, *as_text], WEATHER_TOOLS)
