"""Preprocessing (`sft.data.preprocess`): a large file tokenised on several processes trains the same rows as on one."""

from conftest import chat, write_jsonl

from sft.data import preprocess
from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec


def test_a_large_jsonl_file_preprocessed_on_several_processes_trains_the_same_rows(tmp_path, tokenizer, monkeypatch):
    f = write_jsonl(tmp_path / "rows.jsonl", [chat(f"What is {i} + {i}?", str(2 * i), 1.0 + i % 4) for i in range(60)])
    one = load_sft_datasets(DataSpec(train_file=str(f), max_length=64, num_proc=1), tokenizer)
    monkeypatch.setattr(preprocess, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(preprocess, "PARALLEL_ROWS", 1)
    monkeypatch.setenv("SFT_CACHE", str(tmp_path / "other-cache"))
    several = load_sft_datasets(DataSpec(train_file=str(f), max_length=64, num_proc=2), tokenizer)
    assert several.train.to_dict() == one.train.to_dict() and several.data_hash == one.data_hash
