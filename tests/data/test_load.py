"""The data stage (`sft.data.load`): a score required only where the run uses it, over-long rows dropped or refused,
the sample weight on assistant tokens, the preprocessing cache reused and invalidated."""

import pytest
from conftest import chat, write_jsonl

from sft.data.rows import reading as data_rows
from sft.data.tokens import columns as split
from sft.data.tokens.collator import WeightedDataCollator
from sft.data.load import load_sft_datasets
from sft.data.rows.reading import DataError
from sft.data.spec import DataSpec
from sft.loss.builtin import HardSampleLoss


def test_a_score_is_required_only_where_the_run_uses_it(tokenizer, tmp_path):
    from sft.data.tokens.columns import row_scores
    from sft.loss.builtin import CrossEntropyLoss

    unscored = {k: v for k, v in chat("Add 7 and 8.", "15").items() if k != "difficulty_score"}
    f = write_jsonl(tmp_path / "mixed.jsonl", [chat("What is 1 + 1?", "2", 3.0), unscored])
    plain = load_sft_datasets(DataSpec(train_file=str(f), max_length=64), tokenizer,
                              CrossEntropyLoss())  # alpha 0 reads no score
    assert split.column(plain.train, "sample_weight") == [1.0, 1.0]
    assert row_scores(plain.train) == {(0, 1): 3.0}  # the unscored row is in no difficulty bucket
    missing = (f"{f}:2: difficulty_score: missing (used by loss.alpha=1: set data.default_score=<score> to give every "
               "such row one, map the file's score column with data.columns.score=<column>, or train without "
               "difficulty weights: loss=ce)")
    with pytest.raises(DataError, match=missing.replace("(", r"\(").replace(")", r"\)")):
        load_sft_datasets(DataSpec(train_file=str(f), max_length=64), tokenizer,
                          HardSampleLoss())  # the same cached rows
    skipped = load_sft_datasets(DataSpec(train_file=str(f), max_length=64, on_error="skip"), tokenizer,
                                HardSampleLoss())
    assert split.column(skipped.train, "source_line") == [1] and skipped.summary["train"].rejected == 1
    with pytest.raises(DataError, match="used by controllers.curriculum"):
        load_sft_datasets(DataSpec(train_file=str(f), max_length=64), tokenizer, CrossEntropyLoss(),
                          scores_needed_by=["controllers.curriculum"])


def test_overlong_drop_and_error(tokenizer, tmp_path):
    rows = [chat("word " * 200, "ok", 1.0), chat("What is 1 + 1?", "2", 1.0)]
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    dropped = load_sft_datasets(DataSpec(train_file=str(f), max_length=64, overlong="drop"), tokenizer)
    assert dropped.train["source_line"] == [2]
    with pytest.raises(DataError) as e:
        load_sft_datasets(DataSpec(train_file=str(f), max_length=64, overlong="error"), tokenizer)
    assert f"{f}:1: row: longer than data.max_length=64" in str(e.value)
    only_long = write_jsonl(tmp_path / "eval.jsonl", rows[:1])  # e.g. an eval file of long rows only
    with pytest.raises(DataError, match=f"{only_long}: file: no row left with an assistant token at "
                                        "data.max_length=64 \\(data.overlong=drop\\)"):
        load_sft_datasets(DataSpec(train_file=str(f), eval_file=str(only_long), max_length=64, overlong="drop"),
                          tokenizer)


@pytest.mark.parametrize("packing", [False, True])
def test_token_weights_are_the_sample_weight_on_assistant_tokens_only(tokenizer, tmp_path, packing):
    f = write_jsonl(tmp_path / "t.jsonl", [chat("What is 1 + 1?", "2", 3.0), chat("Add 5 and 6.", "11", 0.5)])
    d = load_sft_datasets(DataSpec(train_file=str(f)), tokenizer, HardSampleLoss(alpha=2.0))
    assert d.train["sample_weight"] == [9.0, 0.25]
    batch = WeightedDataCollator(tokenizer, packing=packing)(list(d.train))
    rows = zip(batch["weights"], batch["labels"]) if not packing else [
        (batch["weights"][0][a:b], batch["labels"][0][a:b])
        for a, b in [(0, len(d.train[0]["input_ids"])), (len(d.train[0]["input_ids"]), None)]]
    for (weights, labels), w in zip(rows, (9.0, 0.25)):
        assert weights[labels != -100].tolist() == [w] * int((labels != -100).sum()) and (labels != -100).any()
        assert weights[labels == -100].eq(0).all()


def test_second_load_reuses_the_cache_and_a_change_invalidates_it(tokenizer, tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "t.jsonl", [chat("What is 1 + 1?", "2", 1.0)] * 3)
    first = load_sft_datasets(DataSpec(train_file=str(f), max_length=128), tokenizer)
    calls = []
    real = data_rows.iter_jsonl
    monkeypatch.setattr(data_rows, "iter_jsonl", lambda *a, **k: calls.append(a) or real(*a, **k))
    again = load_sft_datasets(DataSpec(train_file=str(f), max_length=128), tokenizer)
    assert calls == [] and again.data_hash == first.data_hash
    assert again.train["input_ids"] == first.train["input_ids"]
    other = load_sft_datasets(DataSpec(train_file=str(f), max_length=96), tokenizer)
    assert len(calls) == 1 and other.data_hash != first.data_hash
