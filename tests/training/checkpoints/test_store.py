"""Checkpoints: rotation, verification, and a resume that continues the same run (data and settings
changed since the checkpoint, a new learning rate, another model, a used or busy run dir). Faults
(kills, damage, a full disk, signals) are in test_faults.py."""

import json
import os
import shutil

import pytest
from conftest import RESUME_RUN as RUN
from conftest import SMALL_EVAL, run_train, train_log, zero_bytes

from sft import sample_data
from sft.training.checkpoints.run_dir import run_outputs


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


KILLED_WHILE_ROTATING = """
import os, shutil, signal
_rmtree = shutil.rmtree
def rmtree(path, *args, **kwargs):
    files = sorted(p for p in __import__("pathlib").Path(path).rglob("*") if p.is_file())
    if "checkpoint-2" in str(path) and len(files) > 2:
        for f in [*[f for f in files if f.name == "sft_state.json"], *files[:2]]:
            f.unlink()  # part of the checkpoint deleted, its marker first, then the process killed
        os.kill(os.getpid(), signal.SIGKILL)
    return _rmtree(path, *args, **kwargs)
shutil.rmtree = rmtree
"""


@pytest.mark.slow
def test_a_kill_in_the_middle_of_a_rotation_leaves_nothing_a_resume_sets_aside(tmp_path):
    """A SIGKILL while rotation deleted checkpoint-2 left it with its weights and optimizer but no sft_state.json; the
    resume renamed it `.foreign` ("not a checkpoint sft wrote") and kept it for ever (15+ GB at 7B). Now a delete
    renames the dir first: the resume finishes the delete, sets nothing aside, and goes on from checkpoint-4."""
    from conftest import run_patched

    run = ["trainer.max_steps=6", "trainer.save_steps=2", "trainer.save_total_limit=1", "trainer.eval_steps=100",
           f"hydra.run.dir={tmp_path}"]
    killed = run_patched(KILLED_WHILE_ROTATING, *run)
    assert killed.returncode == -9, killed.stderr[-3000:]
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert left[0] == "checkpoint-2.deleting-" + left[0].rsplit("-", 1)[1] and left[1:] == ["checkpoint-4"], left
    resumed = run_train(*run, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # (the one resumed from is kept beside the newest, as rotation keeps it)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4",
                                                                                         "checkpoint-6"]
    assert "finished deleting" in (tmp_path / "train.log").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["resumed_from"].endswith("checkpoint-4")


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


DAMAGE = {
    "optimizer-deleted": (lambda f: (f / "optimizer.pt").unlink(), "optimizer.pt: missing"),
    "trainer-state-truncated": (lambda f: (f / "trainer_state.json").write_text('{"glo'),
                                "trainer_state.json: 5 bytes, 18 when saved"),
    "model-bytes-zeroed": (lambda f: zero_bytes(f / "model.safetensors"),
                           "model.safetensors: its bytes changed since it was saved (CRC-32)"),
    "marker-truncated": (lambda f: (f / "sft_state.json").write_text('{"files": {'),
                         "sft_state.json: unreadable (JSONDecodeError"),
}


def fake_checkpoint(folder, checksum_all=True):
    from sft.training.checkpoints.store import STATE_FILE, manifest, write_json_atomic

    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 10)
    (folder / "optimizer.pt").write_bytes(b"x" * 100)
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    write_json_atomic(folder / STATE_FILE, {"files": manifest(folder, checksum_all)})
    return folder


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_verification_names_the_file_a_checkpoint_lost_or_changed(tmp_path, name):
    from sft.training.checkpoints.store import verify

    folder = fake_checkpoint(tmp_path / "checkpoint-3")
    assert verify(folder) is None
    damage, problem = DAMAGE[name]
    damage(folder)
    assert verify(folder).startswith(problem)


def test_every_file_is_checksummed_by_default_large_ones_too(tmp_path, monkeypatch):
    # At 7B every shard is over 64 MiB: zeroed bytes inside one must be found by default (issue 33).
    from sft.training.checkpoints import store as checkpoints

    monkeypatch.setattr(checkpoints, "SMALL_FILE", 1000)  # model.safetensors (2,560 bytes) is "large" now
    default, sizes_only = fake_checkpoint(tmp_path / "a"), fake_checkpoint(tmp_path / "b", checksum_all=False)
    for folder in (default, sizes_only):
        zero_bytes(folder / "model.safetensors")
    assert checkpoints.verify(default).startswith("model.safetensors: its bytes changed")
    assert checkpoints.verify(sizes_only) is None  # checkpoint_checksums=small: sizes only above SMALL_FILE
    from sft.config.registry import compose

    assert compose("train", []).checkpoint_checksums == "all"


def test_checksums_of_many_files_equal_one_file_at_a_time(tmp_path):
    import zlib

    from sft.training.checkpoints.store import crc32_all

    paths = []
    for i in range(5):
        paths.append(tmp_path / f"shard-{i}")
        paths[-1].write_bytes(os.urandom(3000 + 1000 * i))
    assert crc32_all(paths) == [zlib.crc32(p.read_bytes()) for p in paths]


def test_resume_auto_sets_aside_checkpoints_it_did_not_write_and_deletes_only_its_own_debris(tmp_path, caplog):
    # A plain Trainer's checkpoint copied in has no sft_state.json: it is renamed, never deleted (issue 33).
    from sft.training.checkpoints.store import WRITING_FILE, find_checkpoint

    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"weights")
    fake_checkpoint(tmp_path / "checkpoint-6")
    debris = tmp_path / "checkpoint-8"
    debris.mkdir()
    (debris / WRITING_FILE).write_text("123\n")
    with caplog.at_level("WARNING", logger="sft"):
        found = find_checkpoint("auto", str(tmp_path), force=False)
    assert found == str(tmp_path / "checkpoint-6")
    assert not debris.exists()
    for step in (2, 4):
        kept = tmp_path / f"checkpoint-{step}.foreign"
        assert (kept / "model.safetensors").read_bytes() == b"weights" and not (tmp_path / f"checkpoint-{step}").exists()
        assert f"checkpoint-{step} has no sft_state.json" in caplog.text and f"renamed checkpoint-{step}.foreign" in caplog.text
    assert "removed " + str(debris) in caplog.text


def test_a_deepspeed_checkpoint_is_trusted_by_this_users_record_of_writing_it_not_by_where_it_lies(tmp_path, caplog):
    # DeepSpeed unpickles its files (weights_only=False): resuming from a stranger's checkpoint runs its code, and a
    # stranger may plant one in a shared run dir, sft_state.json and all (issue 41.7).
    from sft.config.schema import ConfigError
    from sft.training.checkpoints.store import find_checkpoint, record_written

    def deepspeed(path):
        fake_checkpoint(path)
        (path / "latest").write_text("global_step3")
        (path / "global_step3").mkdir()
        (path / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"pickled")
        return path

    elsewhere = deepspeed(tmp_path / "downloaded" / "checkpoint-3")
    run_dir = tmp_path / "run"
    planted = deepspeed(run_dir / "checkpoint-3")
    for checkpoint in (elsewhere, planted):
        with pytest.raises(ConfigError) as refused:
            find_checkpoint(str(checkpoint), str(run_dir), force=False)
        assert str(refused.value).startswith(f"resume='{checkpoint}': a DeepSpeed checkpoint this user's sft has no "
                                             "record of writing")
        assert "trust_checkpoint=true" in str(refused.value)
    assert find_checkpoint(str(elsewhere), str(run_dir), force=False, trust=True) == str(elsewhere)
    with caplog.at_level("WARNING", logger="sft"):
        assert find_checkpoint("auto", str(run_dir), force=False) is None  # passed over, never unpickled
    assert "passing over" in caplog.text
    own = deepspeed(run_dir / "checkpoint-5")
    record_written(own)  # as CheckpointState does when it saves one
    assert find_checkpoint(str(own), str(run_dir), force=False) == str(own)
    (own / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"pickles")  # rewritten since
    with pytest.raises(ConfigError, match="no record of writing"):
        find_checkpoint(str(own), str(run_dir), force=False)


@pytest.mark.slow
def test_resume_applies_a_new_learning_rate_from_the_resumed_step(tmp_path, uninterrupted):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    saved_lr = json.loads((run / "checkpoint-8" / "sft_state.json").read_text())["config"]["trainer"]["learning_rate"]
    resumed = run_train(*RUN, f"resume={run / 'checkpoint-8'}", f"trainer.learning_rate={saved_lr / 4}",
                        "clip.warmup_steps=5", f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert f"trainer.learning_rate: {saved_lr!r} -> {saved_lr / 4!r} (applied)" in log
    assert "clip.warmup_steps: 3 -> 5 (applied)" in log
    assert (run / "checkpoint-12.abandoned" / "sft_state.json").exists()  # the first run's later branch, kept
    ours, theirs = train_log(run), train_log(uninterrupted)
    for step in (9, 10, 11, 12):  # the same cosine schedule, at a quarter of the rate
        assert ours[step]["learning_rate"] == pytest.approx(theirs[step]["learning_rate"] / 4, rel=1e-9), step
    assert train_log(run)[8] == theirs[8]  # history before the resumed step is the first run's


@pytest.mark.slow
def test_resume_refuses_another_model_in_one_line(tmp_path, uninterrupted):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    # The tiny model's architecture with a narrower MLP, random weights.
    other = ("+model.random_init={model_type:qwen2,hidden_size:128,intermediate_size:96,num_attention_heads:4,"
             "num_hidden_layers:4,num_key_value_heads:2,vocab_size:320,tie_word_embeddings:true}")
    refused = run_train(*RUN, "resume=auto", other, f"hydra.run.dir={run}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config: model.random_init.hidden_size=128: was '<absent>' when "
                           f"{run / 'checkpoint-12'} was saved (and model.random_init.intermediate_size, "), last
    assert "model.random_init.intermediate_size: '<absent>' -> 96 (refused)" in refused.stdout + refused.stderr
    forced = run_train(*RUN, "resume=auto", other, "resume_force=true", f"hydra.run.dir={run}")
    assert forced.returncode == 2 and "Traceback" not in forced.stderr
    last = forced.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: config: resume='{run / 'checkpoint-12'}': its weights do not fit this model "
                           "(size mismatch for "), last


@pytest.mark.slow
def test_a_new_run_into_a_used_or_busy_dir_is_refused(tmp_path, uninterrupted):
    import socket

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    before = {p.name: p.stat().st_mtime_ns for p in run_outputs(run)}
    refused = run_train(*RUN, f"hydra.run.dir={run}")  # no resume: a new run
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: config: hydra.run.dir='{run}': holds another run: checkpoint-12 (run "), last
    assert "resume=auto continues it" in last and "overwrite=true" in last
    (run / ".sft.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                               "started": "2026-12-01 09:00:00"}))
    busy = run_train(*RUN, "overwrite=true", f"hydra.run.dir={run}")
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines()[-1].startswith(
        f"error: config: hydra.run.dir='{run}': another run is using it: pid {os.getpid()} on {socket.gethostname()} "
        "since 2026-12-01 09:00:00")
    assert {p.name: p.stat().st_mtime_ns for p in run_outputs(run)} == before  # neither touched the run's outputs
    (run / ".sft.lock").unlink()
    over = run_train("trainer.max_steps=1", "trainer.save_steps=1", "trainer.eval_strategy=no", "overwrite=true",
                     f"hydra.run.dir={run}")
    assert over.returncode == 0, over.stderr[-3000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]
    assert json.loads((run / "results.json").read_text())["global_step"] == 1
    assert not (run / ".sft.lock").exists()  # released at the end


@pytest.mark.slow
def test_a_finished_run_resumed_stays_finished(tmp_path, uninterrupted):
    """resume=auto on a run that trained its max_steps (the SLURM recipe always passes it) trains nothing more: the
    same weights, no step past 12, the schedule not climbing back; twice over."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    for _ in range(2):
        resumed = run_train(*RUN, "resume=auto", f"hydra.run.dir={run}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "holds every step of the run (12): nothing trained" in (run / "train.log").read_text()
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "ok" and results["global_step"] == 12
    assert not list(run.glob("checkpoint-1[3-9]"))
    ours, theirs = load_file(run / "model" / "model.safetensors"), load_file(uninterrupted / "model" / "model.safetensors")
    assert all(ours[k].equal(theirs[k]) for k in theirs)
