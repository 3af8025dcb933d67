"""A tokenised split's columns read in one go (`sft.data.tokens.columns`), against reading it row by row."""

import math

from datasets import Dataset

from sft.data.tokens.columns import assistant_tokens, column, row_keys, row_scores


def test_columns_read_whole_give_what_the_rows_hold_with_a_selection_applied():
    rows = {"input_ids": [[1, 2, 3], [4, 5], [6], []], "labels": [[-100, 2, 3], [4, -100], [6], []],
            "source_line": [1, 2, 3, 4], "difficulty_score": [1.0, math.nan, 2.5, 0.5]}
    split = Dataset.from_dict(rows)
    assert column(split, "source_line") == [1, 2, 3, 4]
    assert row_keys(split) == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert row_scores(split) == {(0, 1): 1.0, (0, 3): 2.5, (0, 4): 0.5}  # a row without a score: none
    # the trained tokens: labels other than -100 after the first position (which is never a target)
    by_row = [sum(1 for i, label in enumerate(labels) if i and label != -100) for labels in rows["labels"]]
    assert assistant_tokens(split).tolist() == by_row == [2, 0, 0, 0]
    chosen = split.select([3, 0])
    assert column(chosen, "source_line") == [4, 1] and assistant_tokens(chosen).tolist() == [0, 2]
    mixed = split.add_column("source", [1, 0, 1, 0])
    assert row_keys(mixed) == [(1, 1), (0, 2), (1, 3), (0, 4)]
    counted = split.add_column("trained_tokens", [9, 8, 7, 6])  # counted while tokenising: taken as counted
    assert assistant_tokens(counted).tolist() == [9, 8, 7, 6]
