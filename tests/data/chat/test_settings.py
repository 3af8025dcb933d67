"""What a tokenizer is given beside its template (`sft.data.chat.settings`): the stop tokens (the model's own unless
named), the template's kwargs, a template from a file."""

import json

import pytest
from chat_templates import QUIRKS, family_tokenizer
from chat_views import PLAIN, answers, labelled, tokenizer_stop
from conftest import write_jsonl

from sft.data.chat.template import ChatRenderer
from sft.data.chat.turns import chat_views
from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec


def test_template_kwargs_reach_the_template_and_the_reasoning_it_then_drops_is_counted(tmp_path):
    from sft.data.chat.settings import configure_chat

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


def test_the_stop_tokens_are_the_models_own_unless_named_and_a_template_may_be_a_file(tmp_path):
    """load_tokenizer reads the eos ids of the model's generation_config.json (and the tokenizer's eos);
    tokenizer.stop_tokens replaces them (each one token); tokenizer.chat_template may name a .jinja file."""
    import shutil

    from sft.config import ConfigError
    from sft.data.chat.settings import chat_settings
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
