"""Batches (`sft.data.tokens.collator`): padded to a multiple with zero weights, or packed into one row with restarting
positions."""

import torch

from sft.data.tokens.collator import WeightedDataCollator


def test_collator_pads_to_a_multiple_of_8_with_zero_weights(tokenizer):
    feats = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "sample_weight": 2.0,
              "difficulty_score": 2.0, "source_line": 1},
             {"input_ids": [5] * 10, "labels": [5] * 10, "sample_weight": 1.0,
              "difficulty_score": 1.0, "source_line": 2}]
    batch = WeightedDataCollator(tokenizer, pad_to_multiple_of=8)(feats)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "weights", "source_lines", "source_views",
                          "target_rows", "target_cols", "target_samples", "num_samples"}
    assert batch["source_lines"].tolist() == [1, 2]
    assert batch["input_ids"].shape == (2, 16)
    assert batch["weights"][0].tolist() == [0.0, 2.0, 2.0] + [0.0] * 13
    assert batch["labels"][0, 3:].eq(-100).all() and batch["attention_mask"][0].sum() == 3
    assert batch["weights"].dtype == torch.float32


def test_packing_collator_flattens_the_batch_with_restarting_positions(tokenizer):
    feats = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "sample_weight": 2.0, "source_line": 1},
             {"input_ids": [8, 9], "labels": [8, 9], "sample_weight": 1.0, "source_line": 2}]
    batch = WeightedDataCollator(tokenizer, packing=True)(feats)
    assert set(batch) == {"input_ids", "labels", "position_ids", "weights", "source_lines", "source_views",
                          "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "target_rows",
                          "target_cols", "target_samples", "num_samples"}
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # The first token of each sample is never a target: no sample is predicted from the one before it.
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert batch["weights"].tolist() == [[0.0, 2.0, 2.0, 0.0, 1.0]]
    # where the trained tokens are, found here on the CPU for the loss: position t predicts label t + 1
    assert batch["target_cols"].tolist() == [0, 1, 3] and batch["target_rows"].tolist() == [0, 0, 0]
    assert batch["target_samples"].tolist() == [0, 0, 1] and batch["num_samples"] == 2
