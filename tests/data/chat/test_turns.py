"""Assistant-only labels under the chat templates of the major families (`tests/chat_templates.py`): a
multi-turn chat trains exactly each answer and its end-of-turn token, in every turn, as the model writes it
after the rendering of the chat before it; turns a template rewrites later are trained from their own
rendering, or refused; a chat a template cannot label is refused with its line, never mislabelled. Tool calls
train with their turn, tool results and definitions are context."""

import json

import pytest
import torch
from chat_templates import family_tokenizer
from chat_views import AGENT, PLAIN, SYSTEM, TOOLS, TURNS, answers, call, expected, labelled, trained_runs
from conftest import write_jsonl
from tool_chats import WEATHER_CALL, WEATHER_CHAT, WEATHER_TOOLS, trained_on

from sft.data.chat.template import ChatRenderer, Refused, stop_token_ids
from sft.data.chat.turns import chat_views
from sft.data.load import load_sft_datasets
from sft.data.rows.reading import DataError
from sft.data.spec import DataSpec, Labelling
from sft.data.tokens.labels import tokenize_batch


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


def test_llama3_date_in_the_system_header_is_context_not_trained():
    tokenizer = family_tokenizer("llama3")
    text = tokenizer.apply_chat_template(TURNS, tokenize=False)
    assert "Today Date: " in text and "Cutting Knowledge Date" in text
    assert trained_runs(tokenizer, TURNS) == [expected("llama3", [("4", ""), ("6", "")])]


def test_evaluation_counts_every_sequence_of_a_chat_once(tmp_path):
    """A Qwen3 chat of two answers evaluates as two sequences of the same line: the exact eval loss is the
    token mean over both, as the model's own loss computes it on each."""
    from transformers import TrainingArguments

    from sft.data.tokens.collator import WeightedDataCollator
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


def test_calls_are_refused_where_the_template_never_shows_the_tool_definitions():
    """DeepSeek-V3.1: the definitions are not in the prompt, whatever the answers mention: a call would train with
    nothing in the prompt that defines it (the check looked for the tool's name anywhere, answers included)."""
    tokenizer = family_tokenizer("no_definitions")
    mentioning = [AGENT[0], call('{"city": "Paris"}'), AGENT[2], {"role": "assistant", "content": "get_weather says 18"}]
    with pytest.raises(Refused) as refused:
        chat_views(tokenizer, mentioning, TOOLS)
    assert refused.value.field == "tools" and "does not render the tool definitions" in refused.value.reason


@pytest.mark.parametrize("prefill", ["refuse", "after"])
def test_a_call_the_template_writes_otherwise_once_the_chat_goes_on_still_trains_its_stop(prefill):
    """Apriel-1.6: a call is written with its id and an end token only once more follows; the call trained (as the
    model writes it, last) ends with the end token the template writes after it (it trained with none)."""
    tokenizer = family_tokenizer("ids_once_continued")
    runs = labelled(tokenizer, AGENT, tools=TOOLS, prefill=prefill)  # the call, rewritten later: a sequence of its own
    assert sorted(run for sequence in runs for run in sequence) == [
        '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>\n<|im_end|>',
        "It is 18 C.\n<|im_end|>"]


def test_a_chat_ending_with_a_call_the_template_ends_with_no_stop_is_refused_naming_the_stop_that_trains_it():
    """Apertus: a call ends with <|tools_suffix|> and the turn goes on with the tool's result, so no stop token follows
    a call, in the chat or once it goes on; it trained `<|tools_prefix|>...<|tools_suffix|>` with nothing the model
    could stop at, and no word. Refused, naming the stop tokens that train it; with them, it trains through the token."""
    from sft.data.chat.settings import configure_chat

    chat = WEATHER_CHAT[:2]
    with pytest.raises(Refused) as refused:
        chat_views(family_tokenizer("call_without_stop"), chat, WEATHER_TOOLS)
    assert refused.value.field == "messages[1]"
    assert ("ends this tool-calling turn with no token the model could stop at ('<|tools_prefix|>[{\"get_weather\": "
            "{\"city\": \"Paris\"}}]<|tools_suffix|>'; the stop tokens: '<|assistant_end|>')") in refused.value.reason
    assert ("""add it to the stop tokens: 'tokenizer.stop_tokens=["<|assistant_end|>","<|tools_suffix|>"]'"""
            in refused.value.reason)  # as Hydra parses it, pasted into a shell
    stopping = configure_chat(family_tokenizer("call_without_stop"), None, ["<|assistant_end|>", "<|tools_suffix|>"])
    assert labelled(stopping, chat, tools=WEATHER_TOOLS) == [
        ['<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>']]
