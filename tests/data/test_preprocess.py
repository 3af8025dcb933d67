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


def test_a_template_that_jinjas_sandbox_stops_is_one_config_error_not_a_refusal_of_every_row(tokenizer):
    # It was reported as thousands of bad rows (issue 33).
    import copy

    import pytest

    from sft.config.schema import ConfigError

    blocked = copy.deepcopy(tokenizer)
    blocked.chat_template = ("{% for m in messages %}{{ m['content'].__class__.__mro__[1].__subclasses__() }}"
                             "{% endfor %}")
    with pytest.raises(ConfigError) as e:
        preprocess.log_template_profile(blocked)
    assert str(e.value).startswith("tokenizer.chat_template: ") and "stopped by jinja's sandbox" in str(e.value)
