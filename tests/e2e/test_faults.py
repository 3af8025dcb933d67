"""Fault injection: SIGKILL at a seeded random step and inside a checkpoint write, damaged checkpoints, a
full disk, SIGTERM to the launcher, and two runs started into one dir. After each, nothing is lost: the
resumed run ends with the uninterrupted run's step losses and parameters (`assert_exact_continuation`),
or the fault is refused in one line with the earlier checkpoints untouched."""

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import RESUME_RUN as RUN
from conftest import assert_exact_continuation, run_patched, run_train, zero_bytes

# Where the SIGKILLs land: drawn once from a fixed seed, the same on every machine and run.
_draw = random.Random(20261201)


KILL_STEP, KILL_MICRO_BATCH = _draw.randint(9, 11), _draw.randint(1, 2)


KILL_AFTER_CHECKPOINT_8 = """
import os, signal
from sft.training.checkpoints import CheckpointState
_on_save = CheckpointState.on_save
def on_save(self, args, state, control, **kwargs):
    _on_save(self, args, state, control, **kwargs)
    if state.global_step == 8:
        os.kill(os.getpid(), signal.SIGKILL)
CheckpointState.on_save = on_save
"""


KILL_INSIDE_ACCUMULATION = f"""
import os, signal
from sft.training.trainer import WeightedLossTrainer
_compute = WeightedLossTrainer.compute_loss
calls = {{}}
def compute_loss(self, model, inputs, *args, **kwargs):
    if model.training:
        calls[self.state.global_step] = calls.get(self.state.global_step, 0) + 1
        if self.state.global_step == {KILL_STEP - 1} and calls[{KILL_STEP - 1}] == {KILL_MICRO_BATCH}:
            os.kill(os.getpid(), signal.SIGKILL)  # inside step {KILL_STEP}'s gradient accumulation
    return _compute(self, model, inputs, *args, **kwargs)
WeightedLossTrainer.compute_loss = compute_loss
"""


CRASH_WHILE_WRITING_CHECKPOINT_8 = """
import os, signal
from transformers import Trainer
_save_rng = Trainer._save_rng_state
def save_rng(self, output_dir):
    if self.state.global_step == 8:  # model and optimizer of checkpoint-8 are written, the rest is not
        os.kill(os.getpid(), signal.SIGKILL)
    return _save_rng(self, output_dir)
Trainer._save_rng_state = save_rng
"""


DISK_FULL_AT_CHECKPOINT_8 = """
import errno
from transformers import Trainer
_save = Trainer._save_optimizer_and_scheduler
def save(self, output_dir):
    if self.state.global_step == 8:  # the model of checkpoint-8 is written, its optimizer does not fit
        raise OSError(errno.ENOSPC, "No space left on device")
    return _save(self, output_dir)
Trainer._save_optimizer_and_scheduler = save
"""


@pytest.mark.slow
@pytest.mark.parametrize("patch", [KILL_AFTER_CHECKPOINT_8, KILL_INSIDE_ACCUMULATION],
                         ids=["after-checkpoint-8", "inside-accumulation"])
def test_sigkill_then_resume_auto_equals_the_uninterrupted_run(tmp_path, uninterrupted, patch):
    killed = run_patched(patch, *RUN, f"hydra.run.dir={tmp_path}")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / "checkpoint-8" / "sft_state.json").exists() and not (tmp_path / "results.json").exists()
    resumed = run_train(*RUN, "resume=auto", f"hydra.run.dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "results.json").read_text())["resumed_from"] == str(tmp_path / "checkpoint-8")
    assert_exact_continuation(tmp_path, uninterrupted)


@pytest.mark.slow
def test_a_checkpoint_half_written_by_a_crash_is_never_resumed_from(tmp_path, uninterrupted):
    crashed = run_patched(CRASH_WHILE_WRITING_CHECKPOINT_8, *RUN, f"hydra.run.dir={tmp_path}")
    assert crashed.returncode == -9
    half = tmp_path / "checkpoint-8"
    assert half.is_dir() and not (half / "sft_state.json").exists()  # what get_last_checkpoint would pick
    resumed = run_train(*RUN, "resume=auto", f"hydra.run.dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["resumed_from"] == str(tmp_path / "checkpoint-4") and results["global_step"] == 12
    assert "left incomplete by a crash" in resumed.stdout + resumed.stderr
    assert (tmp_path / "checkpoint-8" / "sft_state.json").exists()  # rewritten whole this time
    assert_exact_continuation(tmp_path, uninterrupted)


@pytest.mark.slow
def test_resume_auto_passes_over_damaged_checkpoints_to_a_whole_one(tmp_path, uninterrupted):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "checkpoint-12" / "optimizer.pt").unlink()  # a "complete" checkpoint missing a file
    zero_bytes(run / "checkpoint-8" / "model.safetensors")  # bytes changed, the size unchanged
    explicit = run_train(*RUN, f"resume={run / 'checkpoint-12'}", f"hydra.run.dir={run}")
    assert explicit.returncode == 2
    assert explicit.stderr.strip().splitlines()[-1] == (
        f"error: config: resume='{run / 'checkpoint-12'}': optimizer.pt: missing; an older checkpoint, or "
        "resume_force=true to resume anyway")
    resumed = run_train(*RUN, "resume=auto", f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert f"passing over {run / 'checkpoint-12'}: optimizer.pt: missing" in log
    assert f"passing over {run / 'checkpoint-8'}: model.safetensors: its bytes changed" in log
    assert json.loads((run / "results.json").read_text())["resumed_from"] == str(run / "checkpoint-4")
    assert_exact_continuation(run, uninterrupted)


@pytest.mark.slow
def test_a_full_disk_while_saving_stops_with_one_line_and_loses_no_checkpoint(tmp_path):
    full = run_patched(DISK_FULL_AT_CHECKPOINT_8, *RUN, f"hydra.run.dir={tmp_path}")
    assert full.returncode == 1 and "Traceback" not in full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: the disk is full: saving checkpoint-8 in {tmp_path} "
                                                     "failed with ")
    assert (tmp_path / "checkpoint-4" / "sft_state.json").exists()  # the earlier one untouched
    assert (tmp_path / "checkpoint-8").is_dir() and not (tmp_path / "checkpoint-8" / "sft_state.json").exists()
    assert not (tmp_path / "hangs").exists()  # an error is not a hang: the watchdog's armed report is removed


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in proc.joinpath("cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_sigterm_to_launch_sh_saves_stops_and_resumes_to_the_uninterrupted_run(tmp_path, uninterrupted):
    from conftest import REPO, free_port

    run = tmp_path / "run"
    launcher = subprocess.Popen([str(REPO / "launch.sh"), *RUN, f"hydra.run.dir={run}"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "MASTER_PORT": str(free_port())})
    deadline = time.time() + 300
    while not (run / "checkpoint-4" / "sft_state.json").exists() and launcher.poll() is None:
        assert time.time() < deadline, "no checkpoint-4 within 300 s"
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)  # what a scheduler sends: to the launcher only
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, err[-3000:]
    results = json.loads((run / "results.json").read_text())
    step = results["global_step"]
    assert results["status"] == "preempted" and 4 < step < 12
    saved = run / f"checkpoint-{step}"
    assert results["checkpoint"] == str(saved) and (saved / "sft_state.json").exists()
    assert f"continue with the same command plus resume=auto hydra.run.dir={run}" in err
    time.sleep(1)
    assert processes_mentioning(f"hydra.run.dir={run}") == []  # nothing outlived the launcher
    assert not (run / "hangs").exists()  # a signal is not a hang
    resumed = run_train(*RUN, "resume=auto", f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["resumed_from"] == str(run / f"checkpoint-{step}")
    assert_exact_continuation(run, uninterrupted)


@pytest.mark.slow
def test_two_runs_started_into_one_dir_at_once_one_refuses(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    short = ["trainer.max_steps=3", "trainer.save_steps=1", "trainer.eval_strategy=no", f"hydra.run.dir={tmp_path}"]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda seed: run_train(*short, f"trainer.seed={seed}"), (1, 2)))
    assert sorted(r.returncode for r in runs) == [0, 2], [r.stderr[-2000:] for r in runs]
    refused = next(r for r in runs if r.returncode == 2).stderr.strip().splitlines()[-1]
    # Refused by the lock, or (had the first finished already) as a new run over its outputs.
    assert (f"hydra.run.dir='{tmp_path}': another run is using it: pid " in refused
            or f"hydra.run.dir='{tmp_path}': holds another run" in refused), refused
    winner = next(r for r in runs if r.returncode == 0)
    seed = json.loads((tmp_path / "checkpoint-3" / "sft_state.json").read_text())["config"]["trainer"]["seed"]
    assert f"trainer.seed={seed}" in winner.args  # every checkpoint is the winner's: nothing interleaved
    for step in (1, 2, 3):
        state = json.loads((tmp_path / f"checkpoint-{step}" / "sft_state.json").read_text())
        assert state["config"]["trainer"]["seed"] == seed
    assert not (tmp_path / ".sft.lock").exists()
