"""The ids a run trains on are those of the tokenizer's own file: transformers 5 loads a tokenizer as the class of the
model type in `config.json` (any `qwen2` config gets `Qwen2Tokenizer`, with Qwen2's own pre-tokenisation), taking
only the vocabulary and merges from `tokenizer.json`. Where the model and the tokenizer came from different places (a
body paired with another tokenizer), that class splits text otherwise than the file does, and every row trains on
ids the tokenizer's author never produced.

`check_ids` renders a few probe chats with the chat template and encodes them twice: with the loaded class and with
`tokenizers`' own reading of `tokenizer.json` (`tokenizers.Tokenizer.from_file`, which transformers does not touch).
`tokenizer.ids_from` says what to do:

- `checked` (default): transformers' class, refused in one line naming both where the two differ;
- `file`: the file's own tokenisation (`TokenizersBackend`, transformers' class for a plain `tokenizer.json`);
- `class`: transformers' class, whatever the file says (the difference logged).

    SmolLM2's tokenizer.json beside a qwen2 config.json: Qwen2Tokenizer encodes "...\n\n  Ünïcode" as 39 ids,
    the file as 38  ->  refused under `checked`
"""

from __future__ import annotations

import logging
from pathlib import Path

from sft.config.schema import Choice, ConfigError

log = logging.getLogger("sft")


# `tokenizer.ids_from`'s choices (the functional form: `class` is a keyword; OmegaConf reads members by name)
IdsFrom = Choice("IdsFrom", [(name, name) for name in ("checked", "file", "class")])


# Chats whose renderings cross what pre-tokenisers split differently: runs of spaces and newlines, digits, contractions,
# punctuation, accents, CJK, code.
PROBE_CHATS = [
    [{"role": "user", "content": "What's 36 + 96?  And 1,234.5 x 7?"},
     {"role": "assistant", "content": "36 + 96 = 132.\n\n  1,234.5 x 7 = 8,641.5"}],
    [{"role": "user", "content": "Écris « déjà vu » — and 平方 in Python:\n\tdef f(x):"},
     {"role": "assistant", "content": "def f(x):\n    return x ** 2  # 平方\n\n\n   done."}],
    [{"role": "system", "content": "You're brief; don't ramble!!!"}, {"role": "user", "content": "I'll ask: hello??"},
     {"role": "assistant", "content": "Hello — hi...   ok 😊 2026-12-05T12:00Z"}],
]


def file_tokenizer(path: str | Path):
    """`tokenizers`' own reading of the dir's `tokenizer.json`, or None where it has none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def probe_texts(tokenizer) -> list[str]:
    """The probe chats as the chat template renders them (their plain text where the template cannot render them)."""
    texts = []
    for chat in PROBE_CHATS:
        try:
            texts.append(tokenizer.apply_chat_template(chat, tokenize=False))
        except Exception:  # noqa: BLE001 - a template that refuses the probe (a system turn, say): its contents
            texts.append("\n".join(m["content"] for m in chat))
    return texts


def first_difference(tokenizer, file, texts: list[str]) -> tuple[list[int], list[int]] | None:
    """The ids of the first text the two encode differently (the class's, the file's); None where all agree."""
    for text in texts:
        loaded = tokenizer(text, add_special_tokens=False)["input_ids"]
        own = file.encode(text, add_special_tokens=False).ids
        if loaded != own:
            return loaded, own
    return None


def check_ids(tokenizer, path: str | Path, ids_from: str) -> None:
    """Refuse (`checked`) or log (`class`) a tokenizer whose class encodes the probe chats otherwise than the
    `tokenizer.json` of `path`; nothing to check without that file, or where the class is the file's own."""
    file = file_tokenizer(path)
    if file is None or ids_from == IdsFrom.file.value or type(tokenizer).__name__ == "TokenizersBackend":
        return
    found = first_difference(tokenizer, file, probe_texts(tokenizer))
    if found is None:
        return
    loaded, own = found
    at = next((i for i, (a, b) in enumerate(zip(loaded, own)) if a != b), min(len(loaded), len(own)))
    cls = type(tokenizer).__name__
    near = file.decode(own[max(0, at - 2):at + 3], skip_special_tokens=False)
    detail = (f"on a rendered probe chat {cls} gives {len(loaded)} ids and the file {len(own)}, first differing at "
              f"token {at} ({loaded[at:at + 3]} vs {own[at:at + 3]}, near {near!r})")
    if ids_from == IdsFrom["class"].value:
        log.warning("tokenizer.ids_from=class: training with %s's ids, not its tokenizer.json's: %s", cls, detail)
        return
    raise ConfigError("tokenizer.ids_from", str(ids_from), f"transformers loads {path} as {cls} (the class of its "
                      f"config.json's model type), which tokenizes otherwise than the dir's own tokenizer.json: "
                      f"{detail}; tokenizer.ids_from=file trains on the file's ids (its author's), "
                      f"tokenizer.ids_from=class on {cls}'s")


def load_file_tokenizer(path: str | Path, **kwargs):
    """The tokenizer as its `tokenizer.json` is written (`TokenizersBackend`), whatever the model type."""
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(path, **kwargs)
