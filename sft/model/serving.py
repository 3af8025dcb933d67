"""What a server reads of a fine-tuned model besides its weights: the tokens generation stops at.

A model that is trained to end its answers with a token its server does not stop at rambles on (a base model's
`<|endoftext|>` eos under a ChatML template whose turns end `<|im_end|>`). `set_generation_stops` makes the model's
generation config stop at every token an answer is trained to end with (`sft.data.templates.stop_token_ids`: the
model's stop tokens and the template's own end of turn), so that `generation_config.json`, saved with a full model,
beside a LoRA adapter and into a merged model (`sft.model.merge`), says so to vLLM, SGLang, TGI and `generate`.

    set_generation_stops(model, tokenizer)  # eos_token_id 151643 -> [151643, 151645] (<|endoftext|>, <|im_end|>)
"""

from __future__ import annotations

import logging

log = logging.getLogger("sft")


def eos_ids(generation_config) -> list[int]:
    """A generation config's eos ids as a list (it holds one id, a list, or none)."""
    eos = generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos]


def set_generation_stops(model, tokenizer) -> list[int]:
    """Add every token an answer is trained to end with to the eos ids of `model`'s generation config (the base
    model's, under a PEFT wrapper); return the ids, logging those added."""
    from sft.data.templates import stop_token_ids

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.generation_config
    before = eos_ids(config)
    ids = list(dict.fromkeys(before + stop_token_ids(tokenizer)))
    config.eos_token_id = ids[0] if len(ids) == 1 else ids
    if added := [i for i in ids if i not in before]:
        log.info("generation_config.json: eos_token_id %s (added %s: answers are trained to end with %s)",
                 ids, added, ", ".join(tokenizer.convert_ids_to_tokens(added)))
    return ids
