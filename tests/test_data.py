"""Tokenisation, label masking, truncation, caching, collation and data errors."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import chat, labelled_runs, write_jsonl
from sft.data import labels, preprocess, split
from sft.data import rows as data_rows
from sft.data.rows import DataError, read_jsonl
from sft.data.collator import WeightedDataCollator
from sft.data.load import load_sft_datasets
from sft.data.labels import tokenize_batch
from sft.loss.builtin import HardSampleLoss
from sft.data.sources import Source

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42"},
    {"role": "user", "content": "Now add 8."},
    {"role": "assistant", "content": "42 + 8 = 50"},
]


def encode(tokenizer, messages, max_length=256):
    out = tokenize_batch({"messages": [messages], "difficulty_score": [1.0], "source_line": [1]},
                         tokenizer, max_length).to_pydict()
    return out


def test_exactly_the_assistant_tokens_are_labelled(tokenizer):
    out = encode(tokenizer, MULTI_TURN)
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
    out = tokenize_batch({"messages": [long_prompt], "difficulty_score": [1.0], "source_line": [1]},
                         tokenizer, max_length=64).to_pydict()
    assert out["truncated"] == [True] and len(out["input_ids"][0]) == 64
    trained = [t for t, lab in zip(out["input_ids"][0], out["labels"][0]) if lab != -100]
    assert tokenizer.decode(trained) == "ok then<|im_end|>"


def test_overlong_truncate_keeps_the_last_answer_of_a_multi_turn_chat(tokenizer):
    full = encode(tokenizer, MULTI_TURN)
    n = len(full["input_ids"][0])
    cut = encode(tokenizer, MULTI_TURN, max_length=n - 3)
    assert cut["truncated"] == [True] and full["truncated"] == [False]
    assert cut["input_ids"][0] == full["input_ids"][0][3:] and cut["labels"][0] == full["labels"][0][3:]


def test_an_answer_longer_than_max_length_keeps_its_start_after_some_prompt(tokenizer):
    chat_ = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(["1 2 3"] * 60)}]
    out = tokenize_batch({"messages": [chat_], "difficulty_score": [1.0], "source_line": [1]}, tokenizer, 64).to_pydict()
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
    in_part = encode(tokenizer, HUGE_CHATS[name], max_length=64)
    monkeypatch.setattr(labels, "tokenized_part", lambda n_chars, answer_start, reach: (0, n_chars))
    whole = encode(tokenizer, HUGE_CHATS[name], max_length=64)
    assert in_part["input_ids"] == whole["input_ids"] and in_part["labels"] == whole["labels"]
    assert in_part["truncated"] == whole["truncated"] == [True] * len(whole["input_ids"])
    assert all(len(ids) == 64 for ids in in_part["input_ids"])


def test_a_50_mb_row_costs_memory_of_max_length_not_of_the_row():
    script = """
import resource
from sft.data.labels import tokenize_batch
from sft.model.loading import load_tokenizer
tok = load_tokenizer("tiny")
chat = [{"role": "user", "content": "12 + 34 = 46. " * 3_600_000}, {"role": "assistant", "content": "46."}]
batch = {"messages": [chat], "difficulty_score": [1.0], "source_line": [1]}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = tokenize_batch(batch, tok, 256).to_pydict()
print(len(out["input_ids"][0]), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept, grew_mb = map(int, proc.stdout.split()[-2:])
    assert kept == 256
    assert grew_mb < 1000, grew_mb  # the row itself and its renderings; tokenised whole it took over 14 GB


def test_a_score_is_required_only_where_the_run_uses_it(tokenizer, tmp_path):
    from sft.data.split import row_scores
    from sft.loss.builtin import CrossEntropyLoss

    unscored = {k: v for k, v in chat("Add 7 and 8.", "15").items() if k != "difficulty_score"}
    f = write_jsonl(tmp_path / "mixed.jsonl", [chat("What is 1 + 1?", "2", 3.0), unscored])
    plain = load_sft_datasets(tokenizer, CrossEntropyLoss(), str(f), max_length=64)  # alpha 0 reads no score
    assert split.column(plain.train, "loss_weight") == [1.0, 1.0]
    assert row_scores(plain.train) == {(0, 1): 3.0}  # the unscored row is in no difficulty bucket
    missing = (f"{f}:2: difficulty_score: missing (used by loss.alpha=1: set data.default_score=<score> to give every "
               "such row one, map the file's score column with data.columns.score=<column>, or train without "
               "difficulty weights: loss=ce)")
    with pytest.raises(DataError, match=missing.replace("(", r"\(").replace(")", r"\)")):
        load_sft_datasets(tokenizer, HardSampleLoss(), str(f), max_length=64)  # the same cached rows
    skipped = load_sft_datasets(tokenizer, HardSampleLoss(), str(f), max_length=64, on_error="skip")
    assert split.column(skipped.train, "source_line") == [1] and skipped.summary["train"].rejected == 1
    with pytest.raises(DataError, match="used by controllers.curriculum"):
        load_sft_datasets(tokenizer, CrossEntropyLoss(), str(f), max_length=64,
                          scores_needed_by=["controllers.curriculum"])


def test_overlong_drop_and_error(tokenizer, tmp_path):
    rows = [chat("word " * 200, "ok", 1.0), chat("What is 1 + 1?", "2", 1.0)]
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    dropped = load_sft_datasets(tokenizer, None, train_file=str(f), max_length=64, overlong="drop")
    assert dropped.train["source_line"] == [2]
    with pytest.raises(DataError) as e:
        load_sft_datasets(tokenizer, None, train_file=str(f), max_length=64, overlong="error")
    assert f"{f}:1: row: longer than data.max_length=64" in str(e.value)
    only_long = write_jsonl(tmp_path / "eval.jsonl", rows[:1])  # e.g. an eval file of long rows only
    with pytest.raises(DataError, match=f"{only_long}: file: no row left with an assistant token at "
                                        "data.max_length=64 \\(data.overlong=drop\\)"):
        load_sft_datasets(tokenizer, None, str(f), str(only_long), max_length=64, overlong="drop")


@pytest.mark.parametrize("packing", [False, True])
def test_loss_weights_are_the_sample_weight_on_assistant_tokens_only(tokenizer, tmp_path, packing):
    f = write_jsonl(tmp_path / "t.jsonl", [chat("What is 1 + 1?", "2", 3.0), chat("Add 5 and 6.", "11", 0.5)])
    d = load_sft_datasets(tokenizer, HardSampleLoss(alpha=2.0), train_file=str(f))
    assert d.train["loss_weight"] == [9.0, 0.25]
    batch = WeightedDataCollator(tokenizer, packing=packing)(list(d.train))
    rows = zip(batch["loss_weights"], batch["labels"]) if not packing else [
        (batch["loss_weights"][0][a:b], batch["labels"][0][a:b])
        for a, b in [(0, len(d.train[0]["input_ids"])), (len(d.train[0]["input_ids"]), None)]]
    for (weights, labels), w in zip(rows, (9.0, 0.25)):
        assert weights[labels != -100].tolist() == [w] * int((labels != -100).sum()) and (labels != -100).any()
        assert weights[labels == -100].eq(0).all()


def test_second_load_reuses_the_cache_and_a_change_invalidates_it(tokenizer, tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "t.jsonl", [chat("What is 1 + 1?", "2", 1.0)] * 3)
    first = load_sft_datasets(tokenizer, None, train_file=str(f), max_length=128)
    calls = []
    real = data_rows.iter_jsonl
    monkeypatch.setattr(data_rows, "iter_jsonl", lambda *a, **k: calls.append(a) or real(*a, **k))
    again = load_sft_datasets(tokenizer, None, train_file=str(f), max_length=128)
    assert calls == [] and again.data_hash == first.data_hash
    assert again.train["input_ids"] == first.train["input_ids"]
    other = load_sft_datasets(tokenizer, None, train_file=str(f), max_length=96)
    assert len(calls) == 1 and other.data_hash != first.data_hash


def test_collator_pads_to_a_multiple_of_8_with_zero_weights(tokenizer):
    feats = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "loss_weight": 2.0,
              "difficulty_score": 2.0, "source_line": 1},
             {"input_ids": [5] * 10, "labels": [5] * 10, "loss_weight": 1.0,
              "difficulty_score": 1.0, "source_line": 2}]
    batch = WeightedDataCollator(tokenizer, pad_to_multiple_of=8)(feats)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "loss_weights", "source_lines", "source_views"}
    assert batch["source_lines"].tolist() == [1, 2]
    assert batch["input_ids"].shape == (2, 16)
    assert batch["loss_weights"][0].tolist() == [0.0, 2.0, 2.0] + [0.0] * 13
    assert batch["labels"][0, 3:].eq(-100).all() and batch["attention_mask"][0].sum() == 3
    assert batch["loss_weights"].dtype == torch.float32


def test_packing_collator_flattens_the_batch_with_restarting_positions(tokenizer):
    feats = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "loss_weight": 2.0, "source_line": 1},
             {"input_ids": [8, 9], "labels": [8, 9], "loss_weight": 1.0, "source_line": 2}]
    batch = WeightedDataCollator(tokenizer, packing=True)(feats)
    assert set(batch) == {"input_ids", "labels", "position_ids", "loss_weights", "source_lines", "source_views",
                          "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # The first token of each sample is never a target: no sample is predicted from the one before it.
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert batch["loss_weights"].tolist() == [[0.0, 2.0, 2.0, 0.0, 1.0]]


@pytest.mark.parametrize(
    "line, field, reason",
    [
        ("{not json", "row", "invalid JSON"),
        ("[1, 2]", "row", "must be a JSON object"),
        ('{"difficulty_score": 1}', "messages", "missing"),
        ('{"messages": [{"role": "user", "content": "hi"}], "difficulty_score": 1}', "messages", "no assistant"),
        ('{"messages": [{"role": "bot", "content": "hi"}], "difficulty_score": 1}', "messages[0].role", "unknown"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], '
         '"difficulty_score": 1}', "messages[0].content", "must be a string"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
         '"difficulty_score": "hard"}', "difficulty_score", "finite number"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
         '"difficulty_score": -1}', "difficulty_score", "finite number"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
         "difficulty_score", "missing"),
    ],
)
def test_bad_rows_are_reported_with_file_line_and_field(tmp_path, line, field, reason):
    good = json.dumps(chat("q", "a", 1.0))
    f = write_jsonl(tmp_path / "bad.jsonl", [good, line, good])
    with pytest.raises(DataError) as e:
        read_jsonl(f)
    assert f"{f}:2: {field}: " in str(e.value) and reason in str(e.value)
    assert e.value.total == 1


def test_missing_score_uses_default_and_bom_crlf_blank_lines_are_accepted(tmp_path):
    row = json.dumps({"messages": chat("q", "a")["messages"]})
    f = tmp_path / "odd.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + row.encode() + b"\r\n\r\n" + row.encode() + b"\r\n")
    rows = read_jsonl(f, default_score=1.5)
    assert [r["difficulty_score"] for r in rows] == [1.5, 1.5] and [r["source_line"] for r in rows] == [1, 3]


@pytest.mark.parametrize("processes", [2, 3, 5])
def test_a_jsonl_file_validated_on_several_processes_gives_the_rows_and_rejections_of_one(tmp_path, processes):
    from datasets import Dataset, concatenate_datasets

    from sft.data.preprocess import write_rows_in_parallel
    from sft.data.formats import RowFormat

    lines = ['{"no": "format"}', "", "not json", json.dumps(chat("1 + 1?", "2", 1.0))]
    for i in range(40):
        lines.append(json.dumps(chat(f"{i} + 1?", str(i + 1), 1.0 + i % 3)) if i % 7 else "\xff bad utf-8")
        lines += [""] if i % 5 == 0 else []
    lines.append('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}')  # sharegpt
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf-8", "surrogateescape").replace(
        "\xff".encode(), b"\xff") + b"\n")
    rows, rejected = data_rows.scan_jsonl(path, score_required=False)
    found: list = []
    files, count, _ = write_rows_in_parallel(Source(str(path)), found, tmp_path / "shards", processes, None, False,
                                             RowFormat(), "all")
    assert len(files) > 1 and count == len(rows)
    parallel = concatenate_datasets([Dataset.from_file(str(f)) for f in files])
    assert parallel["source_line"] == [r["source_line"] for r in rows]
    assert [json.loads(m) for m in parallel["messages"]] == [r["messages"] for r in rows]  # stored as JSON text
    assert [str(r) for r in found] == [str(r) for r in rejected]
    assert any("a sharegpt row in a file whose first row is messages" in str(r) for r in found)


@pytest.mark.parametrize("processes", [2, 3])
def test_a_table_validated_on_several_processes_gives_the_rows_and_rejections_of_one(tmp_path, processes):
    from datasets import Dataset, concatenate_datasets

    from sft.data.preprocess import write_rows_in_parallel
    from sft.data.formats import RowFormat

    rows = [{"text": "no format"}] + [chat(f"{i} + 1?", str(i + 1), 1.0 + i % 3) if i % 6 else
                                      {"messages": [{"role": "robot", "content": "x"}]} for i in range(30)]
    rows.append({"prompt": "q", "completion": "a"})  # prompt_completion, in a messages table
    keys = sorted({k for r in rows for k in r})  # (from_list would take the first row's keys alone)
    Dataset.from_dict({k: [r.get(k) for r in rows] for k in keys}).to_parquet(path := tmp_path / "rows.parquet")
    scanned, rejected = data_rows.scan_table(Source(str(path)), score_required=False)
    found: list = []
    files, count, _ = write_rows_in_parallel(Source(str(path)), found, tmp_path / "shards", processes, None, False,
                                             RowFormat(), "all")
    assert len(files) == processes and count == len(scanned)
    parallel = concatenate_datasets([Dataset.from_file(str(f)) for f in files])
    assert parallel["source_line"] == [r["source_line"] for r in scanned]
    assert [json.loads(m) for m in parallel["messages"]] == [r["messages"] for r in scanned]
    assert [str(r) for r in found] == [str(r) for r in rejected] and len(found) == 7


def test_a_large_jsonl_file_preprocessed_on_several_processes_trains_the_same_rows(tmp_path, tokenizer, monkeypatch):
    f = write_jsonl(tmp_path / "rows.jsonl", [chat(f"What is {i} + {i}?", str(2 * i), 1.0 + i % 4) for i in range(60)])
    one = load_sft_datasets(tokenizer, None, str(f), max_length=64, num_proc=1)
    monkeypatch.setattr(preprocess, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(preprocess, "PARALLEL_ROWS", 1)
    monkeypatch.setenv("SFT_CACHE", str(tmp_path / "other-cache"))
    several = load_sft_datasets(tokenizer, None, str(f), max_length=64, num_proc=2)
    assert several.train.to_dict() == one.train.to_dict() and several.data_hash == one.data_hash
