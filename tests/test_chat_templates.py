"""Assistant-only labels under the chat templates of the major families (`tests/chat_templates.py`): a
multi-turn chat trains exactly each answer and its end-of-turn token, in every turn, as the model writes it
after the rendering of the chat before it; turns a template rewrites later are trained from their own
rendering, or refused; a chat a template cannot label is refused with its line, never mislabelled.
"""

import json

import pytest
import torch

from chat_templates import FAMILIES, family_tokenizer
from conftest import labelled_runs, write_jsonl
from sft.data import DataError, load_sft_datasets, tokenize_batch

SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "3 and 3 make 6."},
]


def trained_runs(tokenizer, messages, **kwargs) -> list[list[str]]:
    """For each sequence a chat trains as, the decoded runs of consecutive labelled tokens."""
    out = tokenize_batch({"messages": [messages], "difficulty_score": [1.0], "source_line": [7]}, tokenizer, 4096,
                         **kwargs).to_pydict()
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
    out = tokenize_batch({"messages": [[SYSTEM, *TURNS]], "difficulty_score": [1.0], "source_line": [3]},
                         tokenizer, 4096).to_pydict()
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
    out = tokenize_batch({"messages": [[SYSTEM, *turns]], "difficulty_score": [1.0], "source_line": [3]},
                         tokenizer, 4096, rewritten_turns="refuse").to_pydict()
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
                                        r"Conversation roles must alternate"):
        load_sft_datasets(tokenizer, None, train_file=str(path), max_length=256)
    rejected = tmp_path / "rejected.jsonl"
    data = load_sft_datasets(tokenizer, None, train_file=str(path), max_length=256, on_error="skip",
                             rejected_file=str(rejected))
    assert len(data.train) == 1 and data.summary["train"].rejected == 1
    record = json.loads(rejected.read_text())
    assert record["line"] == 2 and record["field"] == "messages" and json.loads(record["row"]) == bad
    with pytest.raises(DataError, match="chats.jsonl:2"):  # the cache a skipping run wrote does not hide it
        load_sft_datasets(tokenizer, None, train_file=str(path), max_length=256)


def test_evaluation_counts_every_sequence_of_a_chat_once(tmp_path):
    """A Qwen3 chat of two answers evaluates as two sequences of the same line: the exact eval loss is the
    token mean over both, as the model's own loss computes it on each."""
    from transformers import TrainingArguments

    from sft.data import WeightedDataCollator
    from sft.losses import CrossEntropyLoss
    from sft.model import load_model
    from sft.trainer import WeightedLossTrainer

    tokenizer = family_tokenizer("qwen3")
    rows = [{"messages": [SYSTEM, *TURNS], "difficulty_score": 1.0},
            {"messages": TURNS[:2], "difficulty_score": 2.0}]
    path = write_jsonl(tmp_path / "eval.jsonl", rows)
    data = load_sft_datasets(tokenizer, None, train_file=str(path), eval_file=str(path), max_length=256)
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
