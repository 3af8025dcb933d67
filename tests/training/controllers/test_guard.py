"""The guard's advice when it stops (`TrainingGuard.failure`): where the loss was steady until the bad steps, the
saved weights are sound and resume=auto continues; where it had been rising, the weights had blown up before the
bad steps, and the advice is a checkpoint from before the rise, not resume=auto, nor the rows."""

import math

from sft.training.controllers.guard import TrainingGuard


def stopped(tmp_path, losses: list[float], checkpoints: list[int]) -> TrainingGuard:
    for step in checkpoints:
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "sft_state.json").write_text("{}")
    guard = TrainingGuard(max_consecutive=2)
    guard._output_dir = str(tmp_path)
    for step, loss in enumerate(losses, start=1):
        guard.judge(step, loss, 1.0)
    guard.stopped_at_step = len(losses)
    return guard


def test_nan_after_a_steady_loss_blames_the_rows_and_resume_auto_continues(tmp_path):
    advice = stopped(tmp_path, [1.0, 0.9, 0.95, 0.9, math.nan, math.nan], [2, 4]).failure()
    assert "The loss was steady before them" in advice and advice.endswith("then resume with resume=auto")


def test_nan_after_the_loss_blew_up_points_before_the_rise_not_to_resume_auto(tmp_path):
    losses = [1.0, 0.9, 0.95, 0.9, 3.0, 40.0, 900.0, math.inf, math.nan]
    advice = stopped(tmp_path, losses, [2, 4, 6]).failure()
    assert "from step 5 on, before any step went non-finite" in advice
    assert f"Continue from before step 5: resume={tmp_path / 'checkpoint-4'}, with a lower trainer.learning_rate" in advice
    assert "resume=auto would continue from the blown-up weights" in advice
