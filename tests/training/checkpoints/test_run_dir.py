"""One run per run dir (sft.training.checkpoints.run_dir) and a resume that continues the same run
(sft.training.checkpoints.store): the lock, the refusal of a used dir, checkpoints after the resumed one set aside,
rotation of this run's only, and the settings a resume applies or refuses."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from sft.config import ConfigError
from sft.training.checkpoints.run_dir import LOCK_FILE, RunDirLock, claim
from sft.training.checkpoints.store import STATE_FILE, find_checkpoint, manifest, write_json_atomic


def checkpoint(folder, run_id="run-a", config=None):
    """A complete checkpoint of `run_id` (marker and manifest), as `CheckpointState` writes it."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 100)
    write_json_atomic(folder / STATE_FILE, {"run_id": run_id, "config": config or {"trainer": {"seed": 42}},
                                            "files": manifest(folder)})
    return folder


def test_a_second_run_in_a_locked_dir_is_refused_naming_the_holder(tmp_path):
    first = RunDirLock(tmp_path)
    first.acquire()
    with pytest.raises(ConfigError) as refused:
        RunDirLock(tmp_path).acquire()
    assert f"another run is using it: pid {os.getpid()} on {socket.gethostname()} since" in str(refused.value)
    assert str(tmp_path / LOCK_FILE) in str(refused.value)
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    second = RunDirLock(tmp_path)
    second.acquire()  # free again
    second.release()


RACE = """
import sys, time
from sft.config import ConfigError
from sft.training.checkpoints.run_dir import RunDirLock
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all start together
try:
    RunDirLock(sys.argv[1]).acquire()
    print("took")
    time.sleep(0.3)
except ConfigError as refused:
    print(refused)
"""


@pytest.mark.slow
def test_runs_starting_at_the_same_moment_one_takes_the_lock_the_others_are_told_who(tmp_path):
    for attempt in range(3):
        run_dir = tmp_path / str(attempt)
        at = time.time() + 0.5
        racers = [subprocess.Popen([sys.executable, "-c", RACE, str(run_dir), str(at)], stdout=subprocess.PIPE,
                                   text=True) for _ in range(4)]
        said = [racer.communicate(timeout=60)[0].strip() for racer in racers]
        assert sorted(said)[-1] == "took" and said.count("took") == 1, said
        # Never a lock caught before its holder wrote it: each refusal names the winner's pid.
        assert all("another run is using it: pid " in line for line in said if line != "took"), said
        assert sorted(p.name for p in run_dir.iterdir()) == [], said  # released, no draft left


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                                  "started": "earlier"}))
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_held_on_another_host_is_refused(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "node-17", "started": "2026-12-01 08:00:00"}))
    with pytest.raises(ConfigError, match="pid 1 on node-17 since 2026-12-01 08:00:00"):
        RunDirLock(tmp_path).acquire()


def test_a_lock_of_another_host_that_nobody_refreshes_is_taken_over(tmp_path):
    """A run killed with its sentinel (a container stopped) leaves its lock; a requeue on another node takes it once it
    has gone unrefreshed for LOCK_STALE_S, where a live run refreshes it every LOCK_HEARTBEAT_S."""
    from sft.training.checkpoints.run_dir import LOCK_HEARTBEAT_S, LOCK_STALE_S

    assert LOCK_STALE_S >= 5 * LOCK_HEARTBEAT_S
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": 1, "host": "node-17", "started": "2026-12-01 08:00:00"}))
    old = time.time() - LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    taken = RunDirLock(tmp_path)
    taken.acquire()
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()


def test_a_new_run_is_refused_over_another_runs_outputs_unless_overwrite(tmp_path):
    claim(tmp_path, overwrite=False)  # an empty dir: fine
    checkpoint(tmp_path / "checkpoint-8")
    (tmp_path / "results.json").write_text('{"status": "ok"}')
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "notes.txt").write_text("the user's own file")
    with pytest.raises(ConfigError) as refused:
        claim(tmp_path, overwrite=False)
    assert str(refused.value).startswith(f"hydra.run.dir='{tmp_path}': holds another run: checkpoint-8 (run run-a, "
                                         "config ")
    assert "resume=auto continues it; another hydra.run.dir" in str(refused.value)
    assert "overwrite=true deletes" in str(refused.value)
    with pytest.raises(ConfigError, match="sweep.resume=true continues that sweep; another hydra.sweep.dir"):
        claim(tmp_path, overwrite=False, sweep_job=True)  # a job dir of a multirun run again
    claim(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "notes.txt"]  # only the run's outputs went


def test_resume_sets_aside_later_and_damaged_checkpoints(tmp_path):
    for step in (4, 8, 12):
        checkpoint(tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-12" / "model.safetensors").write_bytes(b"w" * 99)  # damaged
    assert find_checkpoint("auto", str(tmp_path), force=False) == str(tmp_path / "checkpoint-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12.damaged", "checkpoint-4", "checkpoint-8"]
    # An explicit resume from an earlier checkpoint of the dir: the later branch is kept, never written into.
    assert find_checkpoint(str(tmp_path / "checkpoint-4"), str(tmp_path), force=False) == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12.damaged", "checkpoint-4",
                                                          "checkpoint-8.abandoned"]


def test_rotation_deletes_only_this_runs_checkpoints(tmp_path):
    from sft.training.checkpoints.store import CheckpointState

    checkpoint(tmp_path / "checkpoint-2", run_id="other")
    for step in (4, 6, 8):
        checkpoint(tmp_path / f"checkpoint-{step}", run_id="mine")
    CheckpointState({"run_id": "mine", "data_hash": ""}, {}, keep=1, resumed_from=None).rotate(str(tmp_path), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-8"]


def test_a_lock_that_cannot_be_written_is_one_config_error_naming_the_knob(tmp_path, monkeypatch):
    # A read-only trainer.output_dir set in a config file (the command line's are checked before Hydra) met EROFS.
    import errno
    import os

    from sft.config.schema import ConfigError
    from sft.training.checkpoints.run_dir import RunDirLock

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(RunDirLock, "_create", read_only)
    with pytest.raises(ConfigError) as e:
        RunDirLock(tmp_path / "ckpt", "trainer.output_dir").acquire()
    assert str(e.value) == (f"trainer.output_dir='{tmp_path / 'ckpt'}': cannot be written (Read-only file system: "
                            f"{tmp_path / 'ckpt' / '.sft.lock'}); give a writable dir")
