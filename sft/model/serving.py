"""What a server reads of a fine-tuned model besides its weights: the tokens generation stops at, and the chat
template's arguments the model was trained with.

A model that is trained to end its answers with a token its server does not stop at rambles on (a base model's
`<|endoftext|>` eos under a ChatML template whose turns end `<|im_end|>`). `set_generation_stops` makes the model's
generation config stop at every token an answer is trained to end with (`sft.data.chat.template.stop_token_ids`: the
model's stop tokens and the template's own end of turn), so that `generation_config.json`, saved with a full model,
beside a LoRA adapter and into a merged model (`sft.model.merge`), says so to vLLM, SGLang, TGI and `generate`.

    set_generation_stops(model, tokenizer)  # eos_token_id 151643 -> [151643, 151645] (<|endoftext|>, <|im_end|>)

A run's `tokenizer.chat_template_kwargs` (Qwen3's `enable_thinking=false`) are not part of a saved tokenizer: a server
would render prompts without them, unlike every prompt the model was trained on. `template_with_defaults` makes them
the saved template's defaults, which a caller's own arguments still override:

    template_with_defaults(template, {"enable_thinking": False})
        -> "{%- if enable_thinking is not defined %}{%- set enable_thinking = false %}{%- endif %}" + template
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("sft")


def eos_ids(generation_config) -> list[int]:
    """A generation config's eos ids as a list (it holds one id, a list, or none)."""
    eos = generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos]


def set_generation_stops(model, tokenizer) -> list[int]:
    """Add every token an answer is trained to end with to the eos ids of `model`'s generation config (the base
    model's, under a PEFT wrapper); return the ids, logging those added."""
    from sft.data.chat.template import stop_token_ids

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.generation_config
    before = eos_ids(config)
    ids = list(dict.fromkeys(before + stop_token_ids(tokenizer)))
    config.eos_token_id = ids[0] if len(ids) == 1 else ids
    if added := [i for i in ids if i not in before]:
        log.info("generation_config.json: eos_token_id %s (added %s: answers are trained to end with %s)",
                 ids, added, ", ".join(tokenizer.convert_ids_to_tokens(added)))
    return ids


def template_with_defaults(template: str, kwargs: dict) -> str:
    """`template` with `kwargs` as the values of its variables where the caller gives none."""
    return "".join(f"{{%- if {name} is not defined %}}{{%- set {name} = {_jinja_literal(value)} %}}{{%- endif %}}"
                   for name, value in sorted(kwargs.items())) + template


def _jinja_literal(value) -> str:
    """A Python value as a Jinja literal: true/false/none, quoted strings, numbers, lists and dicts of them."""
    import json

    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_jinja_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_jinja_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # a string (quoted, escaped) or a number


@contextlib.contextmanager
def chat_defaults_saved(tokenizer):
    """While a model is saved: the tokenizer's chat template with the run's `chat_template_kwargs` as its defaults
    (`template_with_defaults`), so that the saved tokenizer renders prompts as training did; the template in memory
    is put back after. Nothing changes where there are no kwargs."""
    from sft.config.secrets import is_secret
    from sft.data.chat.settings import chat_settings

    kwargs, template = chat_settings(tokenizer).kwargs, tokenizer.chat_template
    if secrets := sorted(k for k in kwargs if is_secret(k)):  # never written into the saved template in clear
        log.warning("model/: tokenizer.chat_template_kwargs.%s is a secret: not made a default of the saved chat "
                    "template (a server passes it itself)", ", ".join(secrets))
    kwargs = {k: v for k, v in kwargs.items() if not is_secret(k)}
    if kwargs and template:
        tokenizer.chat_template = template_with_defaults(template, kwargs)
        log.info("model/: the chat template defaults to the run's chat_template_kwargs %s", kwargs)
    try:
        yield
    finally:
        tokenizer.chat_template = template
