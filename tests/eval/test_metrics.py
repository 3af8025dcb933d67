"""Evaluation's metrics from its rows (`sft.eval.metrics`): exact ratios over the eval set, by task and by difficulty
bucket, against the sums written out."""

import pytest

from sft.eval.metrics import eval_metrics


def test_the_metrics_are_ratios_of_sums_over_rows_tasks_and_buckets():
    # (source, line, view) -> numerator, denominator, ce sum, tokens, correct
    rows = {(0, 1, 0): [2.0, 1.0, 3.0, 2, 1], (0, 1, 1): [1.0, 1.0, 1.0, 1, 1],  # two views of one row
            (0, 2, 0): [6.0, 2.0, 8.0, 4, 2], (1, 1, 0): [1.0, 4.0, 2.0, 5, 5]}
    tasks, scores = {0: "math", 1: "chat"}, {(0, 1): 0.5, (0, 2): 2.5, (1, 1): 5.0}
    m = eval_metrics(rows, "eval", tasks, scores, [1.0, 3.0])
    assert m["eval_loss"] == pytest.approx(10 / 8) and m["eval_ce"] == pytest.approx(14 / 12)
    assert m["eval_token_accuracy"] == pytest.approx(9 / 12)
    assert m["eval_loss_task_math"] == pytest.approx(9 / 4) and m["eval_ce_task_math"] == pytest.approx(12 / 7)
    assert m["eval_loss_task_chat"] == pytest.approx(1 / 4) and m["eval_ce_task_chat"] == pytest.approx(2 / 5)
    # buckets cut at 1 and 3: a row's views together, by its score
    assert m["eval_loss_bucket_0"] == pytest.approx(4 / 3) and m["eval_loss_bucket_1"] == pytest.approx(8 / 4)
    assert m["eval_loss_bucket_2"] == m["eval_loss_hardest_bucket"] == pytest.approx(2 / 5)
    plain = eval_metrics(rows, "test", {}, {}, [])
    assert set(plain) == {"test_loss", "test_ce", "test_token_accuracy"}
