"""What a run prints of its logs (`sft.training.observability.step_log`): short lines a person reads, or JSON lines;
every number in metrics.jsonl; no progress bars where stderr is no terminal."""

import json

import pytest
from conftest import run_train

from sft.training.observability.metrics_file import read_metrics
from sft.training.observability.step_log import ShortLines, json_line


def test_a_log_is_one_json_line_of_numbers_rounded_to_4_significant_digits():
    line = json_line(7, {"loss": 0.897812345, "grad_norm": float("nan"), "learning_rate": 1e-3, "epoch": 0.01,
                        "guard/skipped_steps": 0, "total_flos": 1e12})
    assert json.loads(line) == {"step": 7, "loss": 0.8978, "grad_norm": "nan", "learning_rate": 0.001, "epoch": 0.01,
                                "guard/skipped_steps": 0}


def test_short_lines_say_the_numbers_people_watch_in_at_most_120_characters():
    lines = ShortLines(max_steps=200)
    logs = {"loss": 0.897812345, "grad_norm": 1.9581, "learning_rate": 1e-3, "epoch": 0.01, "ce": 0.9,
            "tokens_per_second": 3120.4, "padding_fraction": 0.3, "clip/clipped_fraction": 0.5, "guard/spikes": 0,
            "guard/skipped_steps": 0, "weight_mean": 2.1, "num_input_tokens_seen": 1000}
    assert lines.lines(40, logs) == ["step 40/200  loss 0.8978  lr 1.00e-03  grad 1.96  3,120 tok/s"]
    first = {"eval_loss": 1.25, "eval_ce": 1.2, "eval_loss_hardest_bucket": 1.5, "eval_token_accuracy": 0.5}
    assert lines.lines(0, first) == ["eval @ 0  eval_loss 1.2500  eval_ce 1.2000  hardest 1.500  acc 0.500"]
    later = {"eval_loss": 0.8123, "eval_ce": 0.81, "eval_loss_hardest_bucket": 1.02, "eval_token_accuracy": 0.6}
    assert lines.lines(40, later) == ["eval @ 40 (vs step 0)  eval_loss 0.8123 (-0.4377)  eval_ce 0.8100 (-0.3900)  "
                                      "hardest 1.020 (-0.480)  acc 0.600 (+0.100)"]
    # what needs attention, once each time it happens
    assert lines.lines(60, {**logs, "guard/skipped_steps": 1})[1:] == [
        "attention @ 60: the guard skipped a step (non-finite or spiking loss): 1 so far (nan_batches/ names its rows)"]
    assert lines.lines(70, {**logs, "guard/skipped_steps": 1})[1:] == []
    clipped = lines.lines(80, {**logs, "guard/skipped_steps": 1, "clip/clipped_fraction": 1.0, "clip/threshold": 1.0})
    assert clipped[1].startswith("attention @ 80: every step so far was clipped (clip/threshold 1)")
    long = lines.lines(90, {f"eval_harness/task_{i}/acc": 0.5 for i in range(20)})
    assert all(len(line) <= 120 for line in lines.lines(40, logs) + clipped + long) and long[0].endswith("(metrics.jsonl)")


def test_the_record_of_a_resumed_run_goes_on_after_its_checkpoint_and_survives_a_line_cut_short(tmp_path):
    from types import SimpleNamespace

    from sft.training.observability.step_log import MetricsFile

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.2}\n{"step": 4, "lo')
    record = MetricsFile(path, resumed_step=2)  # the run resumes from checkpoint-2: steps 3 and 4 are trained again
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    state = SimpleNamespace(is_world_process_zero=True, global_step=3)
    record.on_log(None, state, None, logs={"loss": 1.25, "grad_norm": float("nan")})
    assert read_metrics(path)[-1] == {"step": 3, "loss": 1.25, "grad_norm": None}  # numbers as numbers, NaN as null
    MetricsFile(path)  # a new run into the dir: a record of its own
    assert read_metrics(path) == []


@pytest.mark.slow
def test_without_a_terminal_the_run_logs_numbers_into_train_log_and_draws_no_bars(tmp_path):
    run = tmp_path / "run"
    proc = run_train("trainer.max_steps=4", "trainer.logging_steps=2", "trainer.eval_strategy=no",
                     "trainer.save_strategy=no", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr + proc.stdout  # no bar redrawn over itself: each line is a line
    logged = [line for line in (run / "train.log").read_text().splitlines() if "] - step " in line]
    assert [line.split("] - ")[1].split()[1] for line in logged] == ["1/4", "2/4", "4/4"]  # (logging_first_step)
    steps = [entry for entry in read_metrics(run / "metrics.jsonl") if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 4]
    assert all(isinstance(entry["loss"], float) and entry["loss"] > 0 for entry in steps)
    assert all(f"loss {entry['loss']:.4f}" in line for entry, line in zip(steps, logged))


def run_in_a_terminal(*overrides: str, timeout: int = 600) -> tuple[int, str]:
    """`python -m sft.train overrides...` with a pseudo-terminal for its stdin, stdout and stderr, as a person runs
    it: its exit code and everything the terminal received."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios

    from conftest import REPO

    master, slave = pty.openpty()
    # a 120-column terminal of 40 rows (a fresh pseudo-terminal is 0 x 0, where tqdm draws a bar of no width)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "sft.train", *overrides], stdin=slave, stdout=slave, stderr=slave,
                            cwd=REPO, env={**os.environ, "TERM": "xterm", "COLUMNS": "120"})
    os.close(slave)
    received = b""
    while select.select([master], [], [], timeout)[0]:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    return proc.wait(timeout=60), received.decode(errors="replace")


@pytest.mark.slow
def test_in_a_terminal_a_run_shows_its_bar_short_lines_then_a_summary_and_leaves_its_record_and_picture(tmp_path):
    from conftest import SMALL_EVAL

    from sft.experiments.curves import series

    run = tmp_path / "run"
    code, screen = run_in_a_terminal("lora=default", "trainer.max_steps=20", "trainer.logging_steps=5",
                                     "trainer.eval_steps=10", f"data.eval_file={SMALL_EVAL}", "trainer.save_strategy=no",
                                     f"hydra.run.dir={run}")
    assert code == 0, screen[-3000:]
    lines = [line.strip() for part in screen.split("\n") for line in part.split("\r") if line.strip()]
    assert any("%|" in line and "20/20 [" in line for line in lines)  # transformers' bar, to its end
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/20", "5/20", "10/20", "15/20", "20/20"]
    assert all(len(line) <= 120 for line in steps + [line for line in lines if line.startswith("eval @")])
    assert not any('{"step"' in line or "{'loss'" in line for line in lines)  # no dict of twenty keys
    assert "Setting accelerator to CPU" not in screen and "is_gradient_checkpointing" not in screen  # no noise
    # every number of every log, as numbers, in metrics.jsonl; the console's are among them
    metrics = read_metrics(run / "metrics.jsonl")
    logged = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in logged] == [1, 5, 10, 15, 20]
    assert all({"grad_norm", "learning_rate", "tokens_per_second", "ce", "guard/skipped_steps"} <= set(m) for m in logged)
    assert all(f"loss {m['loss']:.4f}" in line for m, line in zip(logged, steps))
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evals] == [0, 10, 20] and all(isinstance(m["eval_loss"], float) for m in evals)
    # the summary: eval loss first -> last, best, and the next commands with this run's paths
    summary = (run / "summary.txt").read_text()
    assert f"eval_loss {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}" in summary
    assert f"sft merge checkpoint={run} output={run}/merged" in summary and f"sft compare run={run}" in summary
    assert summary.splitlines()[0] in screen and f"adapter: {run}/model" in screen
    # the picture, drawn from those very logs
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = series(metrics)
    assert drawn["train loss"] == ([m["step"] for m in logged], [m["loss"] for m in logged])
    assert drawn["eval loss"] == ([m["step"] for m in evals], [m["eval_loss"] for m in evals])
