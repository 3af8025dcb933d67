"""What training needs beside a chat template (`ChatSettings`): the keyword arguments it is rendered with
(`tokenizer.chat_template_kwargs`) and the model's stop tokens, set on a tokenizer by `configure_chat` (from
`tokenizer.stop_tokens`, or the model's generation config and eos) and read back by `chat_settings`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatSettings:
    """What training needs beside the template: the keyword arguments it is rendered with
    (`tokenizer.chat_template_kwargs`, e.g. `enable_thinking`) and the model's stop tokens, with where they came
    from (for messages)."""

    kwargs: dict = field(default_factory=dict)
    stop_tokens: tuple[str, ...] = ()
    stops_from: str = "the tokenizer's eos_token"
    template_name: str = "the chat template"

    def identity(self) -> dict:
        """What of these settings decides the labels (part of the data hash)."""
        from sft.config.secrets import masked  # a secret of the template's (api_key) is in no hash nor record

        return {"chat_template_kwargs": masked(dict(sorted(self.kwargs.items()))), "stop_tokens": list(self.stop_tokens)}


def chat_settings(tokenizer) -> ChatSettings:
    """The settings `configure_chat` gave the tokenizer; for one it did not (a tokenizer made by hand), no kwargs
    and its `eos_token` as the only stop token."""
    settings = getattr(tokenizer, "sft_chat", None)
    if settings is None:
        settings = ChatSettings(stop_tokens=(tokenizer.eos_token,) if tokenizer.eos_token else ())
    return settings


def configure_chat(tokenizer, kwargs: dict | None = None, stop_tokens: list[str] | None = None,
                   model_dir: str | None = None, template_name: str | None = None):
    """Give the tokenizer its `ChatSettings` (as `tokenizer.sft_chat`, read by `chat_settings`): the template
    kwargs, and the stop tokens: `stop_tokens` where given, else the eos ids of the model's
    `generation_config.json` (in `model_dir`, where there is one) and the tokenizer's `eos_token`. A stop token
    must be one token of the vocabulary. Returns the tokenizer."""
    if stop_tokens:
        stops, source = list(stop_tokens), "tokenizer.stop_tokens"
        for token in stops:
            ids = tokenizer.encode(token, add_special_tokens=False)
            if len(ids) != 1 or tokenizer.convert_ids_to_tokens(ids[0]) != token:
                raise ValueError(f"tokenizer.stop_tokens: {token!r} is not one token of the vocabulary (it encodes as "
                                 f"{len(ids)} tokens); a stop token is a special token such as the template's "
                                 "end-of-turn token")
    else:
        stops, sources = [], []
        for token_id in _generation_eos_ids(model_dir):
            token = tokenizer.convert_ids_to_tokens(token_id) if 0 <= token_id < len(tokenizer) else None
            if token is not None and token not in stops:
                stops.append(token)
        if stops:
            sources.append("generation_config.json's eos_token_id")
        if tokenizer.eos_token and tokenizer.eos_token not in stops:
            stops.append(tokenizer.eos_token)
            sources.append("the tokenizer's eos_token")
        source = " and ".join(sources) or "none (no generation_config.json eos_token_id, no eos_token)"
    tokenizer.sft_chat = ChatSettings(dict(kwargs or {}), tuple(stops), source,
                                      template_name or "the chat template")
    return tokenizer


def _generation_eos_ids(model_dir: str | None) -> list[int]:
    """The eos ids of a model's generation config (one id or a list), where the model has one on disk."""
    if model_dir is None:
        return []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):  # no generation_config.json (a local folder without one, or a hub id offline)
        return []
    return [eos] if isinstance(eos, int) else [int(e) for e in eos or []]
