"""What a server reads (`sft.model.serving`): the generation config stops at every token answers are trained to end
with, for every template fixture."""

from types import SimpleNamespace

import pytest
from chat_templates import FAMILIES, QUIRKS, family_tokenizer
from transformers import GenerationConfig

from sft.data.templates import stop_token_ids
from sft.model.serving import eos_ids, set_generation_stops


@pytest.mark.parametrize("family", [*FAMILIES, *QUIRKS])
def test_the_generation_config_stops_at_each_token_an_answer_is_trained_to_end_with(family):
    tokenizer = family_tokenizer(family)
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=tokenizer.eos_token_id))
    ids = set_generation_stops(model, tokenizer)
    assert eos_ids(model.generation_config) == ids and ids[0] == tokenizer.eos_token_id
    assert set(stop_token_ids(tokenizer)) <= set(ids) and len(ids) == len(set(ids))


def test_a_base_models_eos_under_chatml_gains_the_turns_end():
    # A base model's <|endoftext|> eos under ChatML: answers end <|im_end|>, which its server would not stop at.
    tokenizer = family_tokenizer("base_chatml")
    wrapped = SimpleNamespace(get_base_model=lambda: base)  # as a PEFT model: the base's config is the one saved
    base = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=[tokenizer.eos_token_id]))
    ids = set_generation_stops(wrapped, tokenizer)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|endoftext|>", "<|im_end|>"]
    assert base.generation_config.eos_token_id == ids
