"""The guard's advice when it stops (`TrainingGuard.failure`): where the loss was steady until the bad steps, the
saved weights are sound and resume=auto continues; where it had been rising, the weights had blown up before the
bad steps, and the advice is a checkpoint from before the rise, not resume=auto, nor the rows."""

import math

import pytest

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
    assert (f"Continue from before step 5: resume={tmp_path / 'checkpoint-4'}, with a lower learning rate than "
            "trainer.learning_rate") in advice
    assert "resume=auto would continue from the blown-up weights" in advice


def judged(losses: list[float], **knobs) -> TrainingGuard:
    guard = TrainingGuard(**knobs)
    for step, loss in enumerate(losses, start=1):
        guard.judge(step, loss, 1.0)
    return guard


def test_a_finite_divergence_stops_the_run_naming_its_learning_rate(tmp_path):
    """SmolLM2-135M fully fine-tuned at 2e-3 (measured: 0.864, 0.863, 7.59, 8.74): stopped at step 4, no checkpoint
    written, and the failure names the rate, a tenth of it, and the checkpoint before the rise."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "sft_state.json").write_text("{}")
    guard = TrainingGuard()
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=2e-3, report_to=[])
    guard.on_train_begin(args, TrainerState(), TrainerControl())
    for step, loss in enumerate([0.864, 0.863, 7.59], start=1):
        guard.judge(step, loss, 1.0)
    assert guard.diverged is None  # one high step is no median of three
    guard.judge(4, 8.74, 1.0)
    control = TrainerControl(should_save=True)
    guard.on_step_end(args, TrainerState(global_step=4), control)
    assert control.should_training_stop and not control.should_save
    reason = guard.failure()
    assert "the last 3 steps' median is 7.59 at step 4 (rising from step 3)" in reason
    assert "too high for this model: trainer.learning_rate=0.002" in reason
    assert "trainer.learning_rate=0.0002" in reason and f"resume={tmp_path / 'checkpoint-2'}" in reason


@pytest.mark.parametrize("losses", [
    [1.0, 0.9, 5.0, 0.9, 0.8, 0.85],  # one noisy batch
    [0.05, 0.04, 0.2, 0.3, 0.25, 0.3],  # a loss near 0 that rises sevenfold: under 2 nats
    [0.5, 0.4, 1.8, 2.0, 1.9, 2.1],  # harder rows (a curriculum's next stage): 4x but not 2 nats up
    [6.0, 4.0, 2.0, 1.0, 0.5, 0.3],  # learning
])
def test_a_loss_that_does_not_run_away_is_no_divergence(losses):
    assert judged(losses).diverged is None


def test_the_divergence_check_can_be_turned_off():
    assert judged([0.86, 0.86, 7.6, 8.7, 9.0]).diverged is not None
    assert judged([0.86, 0.86, 7.6, 8.7, 9.0], divergence_factor=0).diverged is None
