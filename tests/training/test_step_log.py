"""Logs as lines of numbers (`sft.training.step_log`), and no progress bars where stderr is no terminal."""

import json

import pytest
from conftest import run_train

from sft.training.step_log import log_line


def test_a_log_is_one_json_line_of_numbers_rounded_to_4_significant_digits():
    line = log_line(7, {"loss": 0.897812345, "grad_norm": float("nan"), "learning_rate": 1e-3, "epoch": 0.01,
                        "guard/skipped_steps": 0, "total_flos": 1e12})
    assert json.loads(line) == {"step": 7, "loss": 0.8978, "grad_norm": "nan", "learning_rate": 0.001, "epoch": 0.01,
                                "guard/skipped_steps": 0}


@pytest.mark.slow
def test_without_a_terminal_the_run_logs_numbers_into_train_log_and_draws_no_bars(tmp_path):
    run = tmp_path / "run"
    proc = run_train("trainer.max_steps=4", "trainer.logging_steps=2", "trainer.eval_strategy=no",
                     "trainer.save_strategy=no", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr + proc.stdout  # no bar redrawn over itself: each line is a line
    logged = [json.loads(line[line.index("{"):]) for line in (run / "train.log").read_text().splitlines()
              if '{"step": ' in line]
    steps = [entry for entry in logged if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 4]  # (trainer.logging_first_step)
    assert all(isinstance(entry["loss"], float) and entry["loss"] > 0 for entry in steps)
