"""What a server reads (`sft.model.serving`): the generation config stops at every token answers are trained to end
with, for every template fixture."""

from types import SimpleNamespace

import pytest
from chat_templates import FAMILIES, QUIRKS, family_tokenizer
from transformers import GenerationConfig

from sft.data.chat.template import stop_token_ids
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


CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"}]


def test_the_saved_template_defaults_to_the_runs_kwargs_which_a_caller_still_overrides():
    from chat_templates import THINKING_SWITCH

    from sft.model.serving import template_with_defaults

    tokenizer = family_tokenizer("thinking_switch")
    saved = template_with_defaults(THINKING_SWITCH, {"enable_thinking": False, "note": 'a "quoted" word',
                                                     "depth": 2, "tags": ["x", None]})

    def render(template, **kwargs):
        return tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=False, add_generation_prompt=True,
                                             **kwargs)

    assert render(saved) == render(THINKING_SWITCH, enable_thinking=False) != render(THINKING_SWITCH)
    assert render(saved, enable_thinking=True) == render(THINKING_SWITCH, enable_thinking=True)
    shown = "{{ note }}|{{ depth + 1 }}|{{ tags[0] }}{{ tags[1] is none }}"
    assert tokenizer.apply_chat_template(CHAT, chat_template=template_with_defaults(shown, {
        "note": 'a "quoted" word', "depth": 2, "tags": ["x", None]}), tokenize=False) == 'a "quoted" word|3|xTrue'


@pytest.mark.slow
def test_a_run_with_template_kwargs_saves_a_tokenizer_that_renders_as_training_did(tmp_path):
    from chat_templates import THINKING_SWITCH
    from conftest import run_train
    from transformers import AutoTokenizer

    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_SWITCH)
    run = tmp_path / "run"
    proc = run_train(f"tokenizer.chat_template={template}", "+tokenizer.chat_template_kwargs.enable_thinking=false",
                     "trainer.max_steps=1", "trainer.eval_strategy=no", "trainer.save_strategy=no",
                     "trainer.report_to=[]", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = AutoTokenizer.from_pretrained(run / "model")  # as vLLM or transformers load it, no kwargs given
    trained = served.apply_chat_template(CHAT, chat_template=THINKING_SWITCH, tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert served.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == trained
    assert "<think>\n\n</think>" in trained
