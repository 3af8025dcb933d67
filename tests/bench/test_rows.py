"""The bench's rows (`sft.bench.rows`): the realistic chats have the spread they claim, in the run's own tokens."""

import json
import statistics

from sft.bench.rows import REALISTIC_MEAN, REALISTIC_MEDIAN, REALISTIC_RANGE, realistic_lengths, realistic_rows


def test_realistic_chats_follow_the_published_spread_in_the_runs_tokens(tmp_path, tokenizer):
    """The lengths drawn have the published median and mean (393, 528 tokens) within a few percent once cut to
    100-4,000, and the chats written are those lengths in the tokenizer's own tokens (the template's few added);
    a fifth of each is the question; the same seed gives the same rows."""
    lengths = realistic_lengths(20000)
    assert min(lengths) == REALISTIC_RANGE[0] and max(lengths) <= REALISTIC_RANGE[1]
    assert abs(statistics.median(lengths) / REALISTIC_MEDIAN - 1) < 0.03
    assert abs(statistics.mean(lengths) / REALISTIC_MEAN - 1) < 0.05
    assert realistic_lengths(50) == lengths[:50]
    realistic_rows(path := tmp_path / "rows.jsonl", 200, tokenizer)
    chats = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    tokens = [len(tokenizer(tokenizer.apply_chat_template(m, tokenize=False))["input_ids"]) for m in chats]
    drawn = realistic_lengths(200)
    assert statistics.median(t / d for t, d in zip(tokens, drawn)) < 1.15  # the template's tokens on top
    assert statistics.median(t / d for t, d in zip(tokens, drawn)) > 0.9
    question = [len(tokenizer(m[0]["content"])["input_ids"]) / len(tokenizer(m[1]["content"])["input_ids"])
                for m in chats]
    assert 0.15 < statistics.median(question) < 0.35
