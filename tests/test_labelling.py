"""`sft.data.labels.tokenize_batch` gives exactly the rows of sft 0.1's labelling (`sft.bench.baseline`, which renders
every prefix through `apply_chat_template` and reads every token's offsets) under every family's chat template:
multi-turn chats with reasoning, tool calls, per-turn weights, text whose tokens' offsets are not one character
each, rows cut, dropped or flagged as over-long, rows tokenised in part, and a loss's token weights."""

import json

import numpy as np
import pytest

from chat_templates import FAMILIES, family_tokenizer
from conftest import write_jsonl
from sft.bench import baseline as bench_baseline
from sft.data.templates import ChatRenderer, Refused
from sft.data.turns import chat_views
from sft.data.rows import scan_jsonl
from sft.data.labels import tokenize_batch
from sft.loss.builtin import KeywordLoss

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."},
     {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6", "weight": 2.5}],
    # offsets that are not a character a token: emoji, a combining accent, CJK, tabs; leading and trailing blanks
    [{"role": "user", "content": "Caf\u00e9 or cafe\u0301? \U0001F600\U0001F680 \u4f60\u597d\t\ttabs"},
     {"role": "assistant", "content": "  Both: e\u0301 and \u00e9 \U0001F44D\n\n"},
     {"role": "user", "content": "\u0645\u0631\u062d\u0628\u0627 carry on"},
     {"role": "assistant", "content": "\u0645\u0631\u062d\u0628\u0627! I carry the 1.", "train": False},
     {"role": "user", "content": "Last?"}, {"role": "assistant", "content": "Yes, carry the one."}],
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "content": "18 C, sunny", "name": "get_weather"},
     {"role": "assistant", "content": "It is 18 C and sunny: no need to carry an umbrella."}],
    # over-long at the test's max_length; the second is long enough to be tokenised in part (sft.data.labels.tokenized_part)
    [{"role": "user", "content": "Add these: " + " + ".join(str(7 * i) for i in range(60))},
     {"role": "assistant", "content": "The sum is " + str(sum(7 * i for i in range(60))) + ", with a carry."}],
    [{"role": "user", "content": "12 + 34 = 46. " * 1000}, {"role": "assistant", "content": "46, carry none."}],
]


def rows_of(tmp_path, tools: bool) -> dict:
    """The chats as a batch of validated rows, read from a JSONL file as preprocessing reads them."""
    rows = [{"messages": m, "difficulty_score": 1.0 + i, **({"tools": TOOLS} if tools and i == 2 else {})}
            for i, m in enumerate(CHATS)]
    scanned, rejected = scan_jsonl(write_jsonl(tmp_path / "rows.jsonl", rows))
    assert not rejected
    return {key: [r[key] for r in scanned] for key in scanned[0]}


def as_lists(columns: dict) -> dict:
    return {k: [np.asarray(v).tolist() if isinstance(v, (list, np.ndarray)) else v for v in values]
            for k, values in columns.items()}


def assert_same_rows(ours: dict, theirs: dict) -> None:
    """The baseline's columns, equal; and ours' counts of each sequence's trained (and reweighted) tokens."""
    ours, theirs = as_lists(ours), as_lists(theirs)
    assert {k: ours[k] for k in theirs} == theirs
    trained = [sum(label != -100 for label in labels[1:]) for labels in ours["labels"]]
    assert ours["trained_tokens"] == trained
    if "token_weights" in ours:
        assert ours["reweighted_tokens"] == [sum(label != -100 and w != 1 for label, w in zip(labels[1:], weights[1:]))
                                             for labels, weights in zip(ours["labels"], ours["token_weights"])]


# phi3: sft 0.1 trained the eos a Phi-3 template writes after the chat's last <|end|>; answers now end at their
# first stop token, <|end|> (tests/test_chat_templates.py)
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"phi3"}))
@pytest.mark.parametrize("overlong", ["truncate", "drop", "error"])
def test_tokenize_batch_gives_the_rows_of_the_prefix_rendering_labeller(tmp_path, family, overlong):
    tokenizer = family_tokenizer(family)
    batch = rows_of(tmp_path, tools=family == "qwen25_tools")
    kwargs = {"max_length": 200, "overlong": overlong, "turn_weighted": True}
    ours = tokenize_batch(batch, tokenizer, **kwargs).to_pydict()
    assert_same_rows(ours, bench_baseline.tokenize_batch(batch, tokenizer, **kwargs))
    assert sum(map(len, ours["labels"])) > 0


@pytest.mark.parametrize("family", ["chatml", "qwen3", "llama3"])
def test_a_losss_token_weights_get_the_same_offsets(tmp_path, family):
    tokenizer = family_tokenizer(family)
    batch = rows_of(tmp_path, tools=False)
    kwargs = {"max_length": 4096, "token_weights": KeywordLoss(phrases=["carry"], factor=4.0).token_weights}
    ours = tokenize_batch(batch, tokenizer, **kwargs).to_pydict()
    assert_same_rows(ours, bench_baseline.tokenize_batch(batch, tokenizer, **kwargs))
    assert any(4.0 in w for w in ours["token_weights"])


def outcome(render, *args, **kwargs) -> str:
    """The text, or the template's refusal (Refused wraps the template's own error)."""
    from jinja2 import TemplateError

    try:
        return render(*args, **kwargs)
    except (TemplateError, Refused) as e:
        return f"refused: {str(e).rsplit('refuses this chat: ', 1)[-1]}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_renderer_renders_as_apply_chat_template(tmp_path, family):
    tokenizer = family_tokenizer(family)
    batch = rows_of(tmp_path, tools=family == "qwen25_tools")
    render = ChatRenderer(tokenizer)
    for messages, tools in zip(batch["messages"], batch["tools"]):
        messages = [{k: json.loads(v) if k == "tool_calls" else v for k, v in m.items()
                     if v is not None and k != "weight"} for m in messages]
        tools = json.loads(tools) if tools else None
        for cut in range(1, len(messages) + 1):
            for prompt in (False, True):
                assert outcome(render, messages[:cut], tools=tools, add_generation_prompt=prompt) == outcome(
                    tokenizer.apply_chat_template, messages[:cut], tools=tools, add_generation_prompt=prompt,
                    tokenize=False)


def test_a_chat_costs_two_renders_a_trained_turn_the_last_ones_end_being_the_whole_chat(tmp_path):
    tokenizer = family_tokenizer("chatml")
    batch = rows_of(tmp_path, tools=False)
    calls = []
    counted = ChatRenderer(tokenizer)
    counted.profile  # the template's probes: once a renderer (a batch), not a chat
    counted.__class__ = type("Counted", (ChatRenderer,), {"__call__": lambda self, *a, **k: calls.append(1) or
                                                          ChatRenderer.__call__(self, *a, **k)})
    chat_views(tokenizer, batch["messages"][0], render=counted)
    assert len(calls) == 4  # the whole chat, then each of its 2 trained answers' prompt, and the first's end


@pytest.fixture(scope="module")
def sentencepiece_style_tokenizer():
    """A Unigram tokenizer with Metaspace pre-tokenisation (`▁` for spaces, as Llama 2 and Mistral's), trained here on
    the chats' own text: offsets that start before a word's first character, unlike the byte-level BPE's."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sft.model.loading import CHATML_TEMPLATE

    corpus = [m["content"] for chat in CHATS for m in chat] * 3
    unigram = Tokenizer(models.Unigram())
    unigram.normalizer = normalizers.NFKC()
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.train_from_iterator(corpus, trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"], unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=unigram, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_sentencepiece_style_tokenizer_gets_the_rows_of_the_prefix_rendering_labeller(
        tmp_path, sentencepiece_style_tokenizer, overlong):
    batch = rows_of(tmp_path, tools=False)
    kwargs = {"max_length": 200, "overlong": overlong, "turn_weighted": True,
              "token_weights": KeywordLoss(phrases=["carry"], factor=4.0).token_weights}
    ours = tokenize_batch(batch, sentencepiece_style_tokenizer, **kwargs).to_pydict()
    assert_same_rows(ours, bench_baseline.tokenize_batch(batch, sentencepiece_style_tokenizer, **kwargs))
    assert sum(map(len, ours["labels"])) > 0 and any(4.0 in w for w in ours["token_weights"])
