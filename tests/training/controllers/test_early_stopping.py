"""Early stopping (`sft.training.controllers.early_stopping`): after `patience` evaluations without improvement, in min
and max mode."""

from sft.training.controllers import EarlyStopping


def test_early_stopping_after_patience_evaluations_without_improvement():
    es = EarlyStopping(patience=2, min_delta=0.01)
    decisions = [es.should_stop(v) for v in [3.0, 2.5, 2.495, 2.6, 2.0, 2.1, 2.1]]
    # 2.495 is within min_delta: no improvement; 2.6 worse: stop. After 2.0 the count restarts.
    assert decisions == [False, False, False, True, False, False, True]


def test_early_stopping_in_max_mode():
    es = EarlyStopping(metric="eval_token_accuracy", patience=1, mode="max")
    assert [es.should_stop(v) for v in [0.5, 0.6, 0.55]] == [False, False, True]
