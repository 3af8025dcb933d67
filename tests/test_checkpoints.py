"""Exact resume after SIGKILL, crash while a checkpoint is written, a damaged checkpoint passed over, and
data changed since a checkpoint."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_EVAL, log_history, run_patched, run_train
from sft import sample_data

# 12 steps of 2 micro-batches, a checkpoint every 4, autoclip and the curriculum moving every 2 steps.
RUN = ["trainer.max_steps=12", "trainer.save_steps=4", "trainer.save_total_limit=5", "trainer.logging_steps=1",
       "trainer.eval_steps=2", "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2",
       "clip=autoclip", "clip.warmup_steps=3", "+controllers=curriculum", "controllers.curriculum.chunk_size=12",
       "controllers.curriculum.temperature=2.0", f"data.eval_file={SMALL_EVAL}"]

KILL_AFTER_CHECKPOINT_8 = """
import os, signal
from sft.checkpoints import CheckpointState
_on_save = CheckpointState.on_save
def on_save(self, args, state, control, **kwargs):
    _on_save(self, args, state, control, **kwargs)
    if state.global_step == 8:
        os.kill(os.getpid(), signal.SIGKILL)
CheckpointState.on_save = on_save
"""

KILL_INSIDE_ACCUMULATION_OF_STEP_10 = """
import os, signal
from sft.trainer import WeightedLossTrainer
_compute = WeightedLossTrainer.compute_loss
calls = {}
def compute_loss(self, model, inputs, *args, **kwargs):
    if model.training:
        calls[self.state.global_step] = calls.get(self.state.global_step, 0) + 1
        if self.state.global_step == 9 and calls[9] == 2:  # second micro-batch of the 10th step
            os.kill(os.getpid(), signal.SIGKILL)
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


def train_log(run_dir, step=12):
    return {e["step"]: e for e in log_history(run_dir, step) if "loss" in e}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted")
    proc = run_train(*RUN, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def assert_exact_continuation(run, reference):
    ours, theirs = train_log(run), train_log(reference)
    for step in (9, 10, 11, 12):
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], abs=1e-6), step
        assert ours[step]["clip/threshold"] == pytest.approx(theirs[step]["clip/threshold"], abs=1e-6), step
        assert ours[step]["curriculum/temperature"] == theirs[step]["curriculum/temperature"], step
        assert ours[step]["ce"] == pytest.approx(theirs[step]["ce"], abs=1e-6), step
    a, b = load_file(run / "model" / "model.safetensors"), load_file(reference / "model" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("patch", [KILL_AFTER_CHECKPOINT_8, KILL_INSIDE_ACCUMULATION_OF_STEP_10],
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
def test_rotation_keeps_the_newest_complete_checkpoints_and_the_resumed_one(tmp_path):
    first = run_train("trainer.max_steps=4", "trainer.save_steps=2", "trainer.save_total_limit=1",
                      "trainer.eval_steps=100", f"hydra.run.dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]
    second = run_train("trainer.max_steps=8", "trainer.save_steps=2", "trainer.save_total_limit=1",
                       "trainer.eval_steps=100", "resume=auto", f"hydra.run.dir={tmp_path}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]


@pytest.mark.slow
def test_resume_with_changed_data_is_refused_unless_forced(tmp_path):
    train = tmp_path / "train.jsonl"  # 300 rows: tokenised three times below
    train.write_text("".join(sample_data.TRAIN_FILE.read_text().splitlines(keepends=True)[:300]))
    common = ["data=jsonl", f"data.train_file={train}", f"data.eval_file={SMALL_EVAL}",
              "trainer.eval_steps=100", "trainer.save_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_train(*common, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["CheckpointState"]["attributes"]["data_hash"] == json.loads(
        (tmp_path / "run" / "results.json").read_text())["data_hash"]

    lines = train.read_text().splitlines()
    train.write_text("\n".join(lines[:-100]) + "\n")  # the data changed
    refused = run_train(*common, "trainer.max_steps=4", "resume=auto")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "the data changed since this checkpoint (train_file:" in refused.stderr
    assert "resume_force=true" in refused.stderr
    forced = run_train(*common, "trainer.max_steps=4", "resume=auto", "resume_force=true")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["global_step"] == 4


def _zero_bytes(path, at=1000, n=64):
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(n)
    path.write_bytes(bytes(data))


DAMAGE = {
    "optimizer-deleted": (lambda f: (f / "optimizer.pt").unlink(), "optimizer.pt: missing"),
    "trainer-state-truncated": (lambda f: (f / "trainer_state.json").write_text('{"glo'),
                                "trainer_state.json: 5 bytes, 18 when saved"),
    "model-bytes-zeroed": (lambda f: _zero_bytes(f / "model.safetensors"),
                           "model.safetensors: its bytes changed since it was saved (CRC-32)"),
    "marker-truncated": (lambda f: (f / "sft_state.json").write_text('{"files": {'),
                         "sft_state.json: unreadable (JSONDecodeError"),
}


def fake_checkpoint(folder, checksum_all=False):
    from sft.checkpoints import STATE_FILE, manifest, write_json_atomic

    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 10)
    (folder / "optimizer.pt").write_bytes(b"x" * 100)
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    write_json_atomic(folder / STATE_FILE, {"files": manifest(folder, checksum_all)})
    return folder


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_verification_names_the_file_a_checkpoint_lost_or_changed(tmp_path, name):
    from sft.checkpoints import verify

    folder = fake_checkpoint(tmp_path / "checkpoint-3")
    assert verify(folder) is None
    damage, problem = DAMAGE[name]
    damage(folder)
    assert verify(folder).startswith(problem)


def test_large_files_are_checksummed_only_when_asked(tmp_path, monkeypatch):
    from sft import checkpoints

    monkeypatch.setattr(checkpoints, "SMALL_FILE", 1000)  # model.safetensors (2,560 bytes) is "large" now
    sizes_only, summed = fake_checkpoint(tmp_path / "a"), fake_checkpoint(tmp_path / "b", checksum_all=True)
    for folder in (sizes_only, summed):
        _zero_bytes(folder / "model.safetensors")
    assert checkpoints.verify(sizes_only) is None
    assert checkpoints.verify(summed).startswith("model.safetensors: its bytes changed")


@pytest.mark.slow
def test_resume_auto_passes_over_damaged_checkpoints_to_a_whole_one(tmp_path, uninterrupted):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "checkpoint-12" / "optimizer.pt").unlink()  # a "complete" checkpoint missing a file
    _zero_bytes(run / "checkpoint-8" / "model.safetensors")  # bytes changed, the size unchanged
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

