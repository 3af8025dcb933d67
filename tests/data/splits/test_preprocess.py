"""Preprocessing (`sft.data.splits.preprocess`): a large file tokenised on several processes trains the same rows as on one."""

import os

from conftest import chat, write_jsonl

from sft.data.splits import preprocess
from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec


def test_a_large_jsonl_file_preprocessed_on_several_processes_trains_the_same_rows(tmp_path, tokenizer, monkeypatch):
    f = write_jsonl(tmp_path / "rows.jsonl", [chat(f"What is {i} + {i}?", str(2 * i), 1.0 + i % 4) for i in range(60)])
    one = load_sft_datasets(DataSpec(train_file=str(f), max_length=64, num_proc=1), tokenizer)
    monkeypatch.setattr(preprocess, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(preprocess, "PARALLEL_ROWS", 1)
    monkeypatch.setenv("SFT_CACHE", str(tmp_path / "other-cache"))
    environ = os.environ
    several = load_sft_datasets(DataSpec(train_file=str(f), max_length=64, num_proc=2), tokenizer)
    assert several.train.to_dict() == one.train.to_dict() and several.data_hash == one.data_hash
    # datasets' parallel map rebinds os.environ to a copy; kept, so that this test's variable does not leak
    assert os.environ is environ and os.environ["SFT_CACHE"] == str(tmp_path / "other-cache")


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


def test_every_family_and_quirk_trains_each_answer_through_a_stop_token(tmp_path):
    # The start-up check (issue 31): a probe chat of two answers, labelled as every row is, ends each trained answer
    # with a token the model stops at, for every template fixture (GLM's next role, gpt-oss's eos after the last,
    # Command-R7B's next header, a base model's ChatML); a template with no end at all is the one exception, warned of.
    from chat_templates import FAMILIES, QUIRKS, family_tokenizer

    from sft.data.splits.preprocess import untrained_stop
    from sft.data.spec import Labelling
    from sft.data.chat.template import ChatRenderer

    for family in [*FAMILIES, *QUIRKS]:
        tokenizer = family_tokenizer(family)
        profile = ChatRenderer(tokenizer).profile
        assert profile.no_end == (family == "plain_text"), family
        problem = untrained_stop(tokenizer, Labelling(prefill="after"))
        assert (problem is None) == (family != "plain_text"), (family, problem)
    preprocess.log_template_profile(family_tokenizer("plain_text"))  # warned of (the profile's note), not refused


def test_a_labelling_that_misses_the_stop_token_is_refused_at_start_naming_the_template(monkeypatch):
    import pytest
    from chat_templates import family_tokenizer

    from sft.config.schema import ConfigError
    from sft.data.chat import template as templates
    from sft.data.chat.settings import configure_chat

    tokenizer = family_tokenizer("llama3")  # its answers end <|eot_id|>
    configure_chat(tokenizer, template_name="the llama3 fixture")
    # a model (or a labelling) whose stop tokens are not what its answers are trained to end with
    monkeypatch.setattr(templates, "stop_token_ids", lambda tok: [tok.convert_tokens_to_ids("<|begin_of_text|>")])
    with pytest.raises(ConfigError) as e:
        preprocess.log_template_profile(tokenizer)
    assert str(e.value).startswith("tokenizer.chat_template: the llama3 fixture: an answer would train ending ")
    assert "without a token the model stops at (<|begin_of_text|>)" in str(e.value)
