"""The text of rendered chats: where two renderings part (`common_prefix`, `divergence`), token boundaries in it
(`token_boundary`, `token_start`), the stop tokens in it (`first_stop`, `stop_at`), and a tool definition's name.
Pure string work on what a chat template rendered; the template itself is `sft.data.chat.template`."""

from __future__ import annotations


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of two texts."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # bisect on the first difference: a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def token_boundary(text: str, k: int, tokens: list[str]) -> int:
    """`k`, moved back to the start of an added token of `text` that it falls inside (the common prefix of
    `<|START_THINKING|>` and `<|START_RESPONSE|>` is `<|START_`, not a place between tokens)."""
    moved = True
    while moved:
        moved = False
        for t in tokens:
            j = text.find(t, max(0, k - len(t) + 1), k + len(t) - 1)
            if j != -1 and j < k < j + len(t):
                k, moved = j, True
    return k


def token_start(tokenizer, text: str, k: int) -> int:
    """`k`, moved back to the start of the token of `text`'s encoding that it falls inside."""
    for start, end in tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).offsets:
        if start < k < end:
            return start
    return k


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special tokens (its added tokens marked special, the named ones)."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return list(dict.fromkeys(added + list(tokenizer.all_special_tokens)))


def added_tokens(tokenizer) -> list[str]:
    """Every added token of the tokenizer (special or not: `<think>` of Qwen3 is not), which text never splits."""
    return [t.content for t in tokenizer.added_tokens_decoder.values()]


def first_stop(text: str, stops) -> tuple[int, str] | None:
    """The first stop token in `text`: (where it ends, the token)."""
    found = [(at, t) for t in stops if (at := text.find(t)) != -1]
    if not found:
        return None
    at, token = min(found)
    return at + len(token), token


def divergence(a: str, b: str) -> str:
    """Where two renderings part: a few characters of each from the first difference."""
    i = common_prefix(a, b)
    return f"{a[max(0, i - 20):i + 30]!r} vs {b[max(0, i - 20):i + 30]!r}"


def first_stop_with_space(text: str, stops) -> str:
    """The first stop token in `text` with the white space right before it (`"\n<|end|>"`), or ""."""
    found = first_stop(text, stops)
    if found is None:
        return ""
    end, token = found
    before = text[:end - len(token)]
    return text[len(before.rstrip()):end]


def stop_at(text: str, stops) -> str:
    """The stop token `text` begins with, after white space (with that white space), or ""."""
    gap = len(text) - len(text.lstrip())
    return next((text[:gap + len(t)] for t in stops if text.startswith(t, gap)), "")


def listed(tokens) -> str:
    return ", ".join(map(repr, tokens)) or "none"


def tool_name(tool: dict) -> str | None:
    """A tool definition's name: OpenAI's {"type": "function", "function": {"name"}} or a bare {"name"}."""
    function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return function.get("name") if isinstance(function.get("name"), str) else None
