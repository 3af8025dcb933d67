"""Labels (`sft.data.tokens.labels`): exactly the assistant tokens labelled, over-long rows cut from the left keeping the
answer, huge rows tokenised in part with the same result."""

import json
import subprocess
import sys

import numpy as np
import pytest
from chat_templates import FAMILIES, family_tokenizer
from conftest import labelled_runs, tokenize_chat, write_jsonl

from sft.bench import baseline as bench_baseline
from sft.data.tokens import labels
from sft.data.tokens.labels import tokenize_batch
from sft.data.rows.reading import scan_jsonl
from sft.data.spec import Labelling
from sft.data.chat.template import ChatRenderer, Refused
from sft.data.chat.turns import chat_views
from sft.loss.builtin import KeywordLoss

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42"},
    {"role": "user", "content": "Now add 8."},
    {"role": "assistant", "content": "42 + 8 = 50"},
]


def test_exactly_the_assistant_tokens_are_labelled(tokenizer):
    out = tokenize_chat(tokenizer, MULTI_TURN)
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert ids == tokenizer.apply_chat_template(MULTI_TURN, tokenize=True, return_dict=True)["input_ids"]
    # Labelled positions form two runs, each exactly one assistant turn's content plus <|im_end|>.
    runs = labelled_runs(ids, labels)
    assert [tokenizer.decode(r) for r in runs] == ["12 + 30 = 42<|im_end|>", "42 + 8 = 50<|im_end|>"]
    # Nothing of the system or user turns, nor the role headers, is labelled.
    n_trained = sum(lab != -100 for lab in labels)
    expected = sum(len(tokenizer(m["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"])
                   for m in MULTI_TURN if m["role"] == "assistant")
    assert n_trained == expected


def test_overlong_truncate_cuts_the_prompt_from_the_left_and_keeps_the_answer(tokenizer):
    long_prompt = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok then"}]
    out = tokenize_batch({"messages": [long_prompt], "difficulty_score": [1.0], "source_line": [1]}, tokenizer,
                         Labelling(max_length=64)).to_pydict()
    assert out["truncated"] == [True] and len(out["input_ids"][0]) == 64
    trained = [t for t, lab in zip(out["input_ids"][0], out["labels"][0]) if lab != -100]
    assert tokenizer.decode(trained) == "ok then<|im_end|>"


def test_overlong_truncate_keeps_the_last_answer_of_a_multi_turn_chat(tokenizer):
    full = tokenize_chat(tokenizer, MULTI_TURN)
    n = len(full["input_ids"][0])
    cut = tokenize_chat(tokenizer, MULTI_TURN, max_length=n - 3)
    assert cut["truncated"] == [True] and full["truncated"] == [False]
    assert cut["input_ids"][0] == full["input_ids"][0][3:] and cut["labels"][0] == full["labels"][0][3:]


def test_an_answer_longer_than_max_length_keeps_its_start_after_some_prompt(tokenizer):
    chat_ = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(["1 2 3"] * 60)}]
    out = tokenize_batch({"messages": [chat_], "difficulty_score": [1.0], "source_line": [1]}, tokenizer,
                         Labelling(max_length=64)).to_pydict()
    labels = out["labels"][0]
    assert len(labels) == 64 and labels[-1] != -100  # the answer runs to the end of the window
    first = next(i for i, lab in enumerate(labels) if lab != -100)
    assert 0 < first <= 64 // 4 + 1  # at most a quarter of the window is prompt


def _huge(text: str, n_chars: int) -> str:
    return (text * (n_chars // len(text) + 1))[:n_chars]


HUGE_CHATS = {  # each far longer than twice the characters 64 tokens can cover: tokenised in part
    "huge-prompt": [{"role": "user", "content": _huge("Add these: 12 + 30, 7 + 8. ", 60_000)},
                    {"role": "assistant", "content": "42 and 15"}],
    "huge-answer": [{"role": "user", "content": "Count up."},
                    {"role": "assistant", "content": _huge("1 2 3 4 ", 60_000)}],
    "huge-middle-turns": [{"role": "user", "content": _huge("a b ", 30_000)},
                          {"role": "assistant", "content": _huge("c d ", 30_000)},
                          {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Done."}],
}


@pytest.mark.parametrize("name", sorted(HUGE_CHATS))
def test_a_huge_row_is_tokenised_in_part_with_the_same_result(tokenizer, monkeypatch, name):
    in_part = tokenize_chat(tokenizer, HUGE_CHATS[name], max_length=64)
    monkeypatch.setattr(labels, "tokenized_part", lambda n_chars, answer_start, reach: (0, n_chars))
    whole = tokenize_chat(tokenizer, HUGE_CHATS[name], max_length=64)
    assert in_part["input_ids"] == whole["input_ids"] and in_part["labels"] == whole["labels"]
    assert in_part["truncated"] == whole["truncated"] == [True] * len(whole["input_ids"])
    assert all(len(ids) == 64 for ids in in_part["input_ids"])


@pytest.mark.slow
def test_a_50_mb_row_costs_memory_of_max_length_not_of_the_row():
    script = """
import resource
from sft.data.tokens.labels import tokenize_batch
from sft.data.spec import Labelling
from sft.model.loading import load_tokenizer
tok = load_tokenizer("tiny")
chat = [{"role": "user", "content": "12 + 34 = 46. " * 3_600_000}, {"role": "assistant", "content": "46."}]
batch = {"messages": [chat], "difficulty_score": [1.0], "source_line": [1]}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = tokenize_batch(batch, tok, Labelling(max_length=256)).to_pydict()
print(len(out["input_ids"][0]), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept, grew_mb = map(int, proc.stdout.split()[-2:])
    assert kept == 256
    assert grew_mb < 1000, grew_mb  # the row itself and its renderings; tokenised whole it took over 14 GB


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
    # over-long at the test's max_length; the second is long enough to be tokenised in part (sft.data.tokens.labels.tokenized_part)
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
    # a refusal: the baseline's reason, which ours follows with its advice
    assert all(mine.startswith(reason) and bool(mine) == bool(reason)
               for mine, reason in zip(ours["refused"], theirs.pop("refused"), strict=True))
    assert {k: ours[k] for k in theirs} == theirs
    trained = [sum(label != -100 for label in labels[1:]) for labels in ours["labels"]]
    assert ours["trained_tokens"] == trained
    if "token_weights" in ours:
        assert ours["reweighted_tokens"] == [sum(label != -100 and w != 1 for label, w in zip(labels[1:], weights[1:]))
                                             for labels, weights in zip(ours["labels"], ours["token_weights"])]


# phi3: sft 0.1 trained the eos a Phi-3 template writes after the chat's last <|end|>; answers now end at their
# first stop token, <|end|> (tests/data/test_turns.py)
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"phi3"}))
@pytest.mark.parametrize("overlong", ["truncate", "drop", "error"])
def test_tokenize_batch_gives_the_rows_of_the_prefix_rendering_labeller(tmp_path, family, overlong):
    tokenizer = family_tokenizer(family)
    batch = rows_of(tmp_path, tools=family == "qwen25_tools")
    ours = tokenize_batch(batch, tokenizer, Labelling(max_length=200, overlong=overlong),
                          turn_weighted=True).to_pydict()
    assert_same_rows(ours, bench_baseline.tokenize_batch(batch, tokenizer, max_length=200, overlong=overlong,
                                                         turn_weighted=True))
    assert sum(map(len, ours["labels"])) > 0


@pytest.mark.parametrize("family", ["chatml", "qwen3", "llama3"])
def test_a_losss_token_weights_get_the_same_offsets(tmp_path, family):
    tokenizer = family_tokenizer(family)
    batch = rows_of(tmp_path, tools=False)
    token_weights = KeywordLoss(phrases=["carry"], factor=4.0).token_weights
    ours = tokenize_batch(batch, tokenizer, Labelling(max_length=4096), token_weights).to_pydict()
    assert_same_rows(ours, bench_baseline.tokenize_batch(batch, tokenizer, max_length=4096,
                                                         token_weights=token_weights))
    assert any(4.0 in w for w in ours["token_weights"])


def outcome(render, *args, **kwargs) -> str:
    """The text, or the template's refusal (Refused wraps the template's own error)."""
    from jinja2 import TemplateError

    try:
        return render(*args, **kwargs)
    except (TemplateError, Refused) as e:
        return f"refused: {str(e).rsplit('refuses this chat: ', 1)[-1].split(' (data.on_error=skip', 1)[0]}"


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
    kwargs = {"turn_weighted": True, "token_weights": KeywordLoss(phrases=["carry"], factor=4.0).token_weights}
    ours = tokenize_batch(batch, sentencepiece_style_tokenizer, Labelling(max_length=200, overlong=overlong),
                          **kwargs).to_pydict()
    assert_same_rows(ours, bench_baseline.tokenize_batch(batch, sentencepiece_style_tokenizer, max_length=200,
                                                         overlong=overlong, **kwargs))
    assert sum(map(len, ours["labels"])) > 0 and any(4.0 in w for w in ours["token_weights"])


# A template whose generation prompt ends with a space and whose answers may begin with "=": the tiny vocabulary
# has " =" as one token, which would straddle the prompt/answer boundary (Qwen3.5's `<think>\n` + `\n</think>`).
STRADDLING = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}{{ 'Sum: ' }}"
              "{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\nSum: ' }}{% endif %}")


def test_an_answer_that_begins_inside_a_token_is_trained_whole_and_tokenised_as_inference_sees_it():
    from sft.model.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny", chat_template=STRADDLING)
    assert tokenizer.tokenize("Sum: = 12")[-4:] == ["Ġ=", "Ġ", "1", "2"]  # the fixture's mechanism: " =" one token
    chat = [{"role": "user", "content": "What is 5 + 7?"}, {"role": "assistant", "content": "= 12"},
            {"role": "user", "content": "And 1 + 1?"}, {"role": "assistant", "content": "= 2"}]
    row = tokenize_chat(tokenizer, chat)
    trained = [tokenizer.decode(run) for run in labelled_runs(row["input_ids"][0], row["labels"][0])]
    assert trained == ["= 12<|im_end|>", "= 2<|im_end|>"]  # the oracle: each answer as rendered, with its stop
    render = ChatRenderer(tokenizer)
    prompt = render(chat[:1], add_generation_prompt=True)
    first_answer = tokenizer("= 12<|im_end|>", add_special_tokens=False)["input_ids"]
    assert row["input_ids"][0][:len(tokenizer(prompt)["input_ids"]) + len(first_answer)] == \
        tokenizer(prompt, add_special_tokens=False)["input_ids"] + first_answer  # the prompt's tokens, then the answer's
