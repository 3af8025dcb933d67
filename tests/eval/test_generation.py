"""Exact match of greedy answers per difficulty bucket (`sft.eval.generation.bucket_exact_match`), against answers
generated here with the model's own `generate` on the chat template's prompt."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO

from sft.eval.generation import bucket_exact_match, bucket_rows


def test_rows_fall_into_buckets_by_their_edges_and_each_bucket_is_capped():
    rows = [{"difficulty_score": s} for s in (0.5, 1.0, 1.5, 2.5, 2.0, 3.0, 4.0, None)]
    buckets = bucket_rows(rows, [1.0, 2.0, 3.0], max_rows=2)
    assert {k: [r["difficulty_score"] for r in v] for k, v in buckets.items()} == {
        0: [0.5, None], 1: [1.0, 1.5], 2: [2.5, 2.0], 3: [3.0, 4.0]}


def test_each_buckets_exact_match_is_the_share_of_answers_equal_to_their_reference(tokenizer):
    from sft.model.loading import load_model

    model = load_model("tiny").eval()
    lines = (REPO / "sft" / "sample_data" / "validation.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:24]]
    for i, row in enumerate(rows):
        if i % 3 == 0:  # the model's own greedy answer becomes the reference: a hit by construction
            prompt = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)
            with torch.no_grad():
                out = model.generate(**prompt, max_new_tokens=12, do_sample=False,
                                     eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
            row["messages"][-1]["content"] = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:],
                                                              skip_special_tokens=True)
    trainer = SimpleNamespace(model=model, model_wrapped=model, is_zero3=False, shards_parameters=False,
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    metrics = bucket_exact_match(trainer, tokenizer, rows, [1.0, 2.0, 3.0], max_rows=100, max_new_tokens=12,
                                 each=True)
    edges = [1.0, 2.0, 3.0]
    for k, chosen in bucket_rows([dict(r, i=i) for i, r in enumerate(rows)], edges, 100).items():
        assert metrics[f"eval_exact/bucket_{k}"] == pytest.approx(sum(r["i"] % 3 == 0 for r in chosen) / len(chosen))
    assert metrics["eval_exact/all"] == pytest.approx(8 / 24)
    assert metrics["eval_exact_match_hardest"] == metrics[f"eval_exact/bucket_{max(bucket_rows(rows, edges, 100))}"]
    assert bucket_exact_match(trainer, tokenizer, rows, edges, 100, 12) == {
        "eval_exact_match_hardest": metrics["eval_exact_match_hardest"]}


def test_answers_cut_at_max_new_tokens_are_named_in_a_warning(tokenizer, caplog):
    from sft.model.loading import load_model

    model = load_model("tiny").eval()
    rows = [json.loads(line) for line in (REPO / "sft" / "sample_data" / "validation.jsonl").read_text().splitlines()[:6]]
    trainer = SimpleNamespace(model=model, model_wrapped=model, is_zero3=False, shards_parameters=False,
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    with caplog.at_level("WARNING", logger="sft"):
        bucket_exact_match(trainer, tokenizer, rows, [1.0, 2.0, 3.0], max_rows=100, max_new_tokens=2, each=True)
    assert ("exact_match: 6 of 6 answers reached exact_match.max_new_tokens=2 before their stop token, cut there "
            "(scored as they are): raise it if the answers are longer") in caplog.text
