"""`sft inspect`: the rows as the model sees them, trained tokens marked, and the totals,
from the training config, without building the model."""

import pytest
from conftest import chat, write_jsonl

from sft.commands.inspect import inspect, main

ROWS = [chat("What is 1 + 1?", "2", 2.0), chat("Add 3 and 4.", "3 + 4 = 7", 1.0)]


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: inspection needs only the tokenizer and the data."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("inspect_data built a model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)


def test_rows_show_the_trained_answers_marked_with_their_weight_and_the_totals(tmp_path, tokenizer, no_model):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS + ["{not json"])
    report = inspect([f"data.train_file={path}", "data.on_error=skip", "loss=hard_sample", "loss.alpha=1"], rows=2)
    first, second, totals, template = report.strip().split("\n\n")
    assert first.startswith(f"-- {path}:1 · ") and first.endswith("<|im_start|>assistant\n⟦2<|im_end|>⟧×2")
    assert second.endswith("<|im_start|>assistant\n⟦3 + 4 = 7<|im_end|>⟧×1")
    assert "What is 1 + 1?" in first and "⟦" not in first.split("assistant\n")[0]  # the prompt is not trained
    rendered = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in ROWS]
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in rendered)
    trained = sum(len(tokenizer(r["messages"][-1]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"])
                  for r in ROWS)
    assert totals == (f"train: 2 rows read, 1 rejected, 0 dropped; 2 sequences (0 truncated, 0 turns trained from "
                      f"their own rendering); {tokens} tokens, {trained} trained ({100 * trained / tokens:.1f}%)")
    # the tiny model's generation_config.json says where answers end
    assert template == ("template: tiny's chat template; answers end at '<|im_end|>' (generation_config.json's "
                        "eos_token_id)\ntokenizer: Qwen2Tokenizer, tokenizer.ids_from=checked (its ids checked against "
                        "the tokenizer.json it came from: sft.model.tokenizer_ids)")


def test_a_stream_shows_its_first_sequences_as_the_rows_read_whole(tmp_path, no_model):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = [f"data.train_file={path}", "loss=hard_sample", "loss.alpha=1"]
    whole = inspect(args, rows=2).strip().split("\n\n")
    streamed = inspect([*args, "data.streaming=true", "trainer.max_steps=4"], rows=2).strip().split("\n\n")
    assert streamed[:2] == whole[:2] and streamed[3] == whole[3]
    assert streamed[2] == "train: streamed (data.streaming=true): its rows are read, and counted, as they train"


def test_a_bad_file_is_a_one_line_error_naming_the_line(tmp_path, capsys, no_model):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS + ['{"messages": []}'])
    with pytest.raises(SystemExit) as stop:
        main([f"data.train_file={path}", "--color", "never"])
    assert stop.value.code == 2
    assert f"{path}:3: messages: must be a non-empty list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data.train_file=/no/such.jsonl"])
    assert "error: config: data.train_file" in capsys.readouterr().err


def test_rows_the_loss_would_refuse_are_shown_and_the_refusal_said():
    """Rows without a difficulty_score under the default hard-sample loss: inspect shows them (it refused to), and
    says what training will refuse and how to train them."""
    from sft.commands.inspect import inspect

    report = inspect(["data=jsonl", "data.train_file=examples/data/chats.jsonl", "data.eval_file=null"], rows=1)
    assert report.startswith("-- examples/data/chats.jsonl:1 · ")
    assert ("note: loss=HardSampleLoss reads each row's difficulty_score, so training will refuse rows of this data: "
            "160 bad row(s) in the data: examples/data/chats.jsonl:1: difficulty_score: missing") in report
