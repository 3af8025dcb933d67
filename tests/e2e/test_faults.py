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
from sft.training.checkpoints.store import CheckpointState
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
    # A kill is no hang, and leaves no lock: the process's sentinel tidies both once it is gone.
    assert wait_for_sentinel(tmp_path / "hangs" / "rank-0.txt") and wait_for_sentinel(tmp_path / ".sft.lock")
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
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, err[-3000:]
    results = json.loads((run / "results.json").read_text())
    step = results["global_step"]
    assert results["status"] == "preempted" and 4 < step < 12
    # the summary at the signal too: what the run got to, and the command that goes on (printed, and in the run dir)
    summary = (run / "summary.txt").read_text()
    assert summary.startswith(f"run preempted: {step} steps in ") and summary in out
    assert f"continue with: the same command plus resume=auto hydra.run.dir={run}" in summary
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


# --- issue 33: what a signal, a full disk, a read-only disk or a prepared run dir leaves ---------------------------

SHORT = ["trainer.max_steps=4", "trainer.save_steps=2", "trainer.eval_strategy=no", "trainer.logging_steps=1"]

SIGTERM_TWICE_AT_STEP_2 = """
import os, signal, time
from transformers import Trainer
from sft.training.step.preemption import Preemption
_on_step_end = Preemption.on_step_end
def on_step_end(self, args, state, control, **kwargs):
    if state.global_step == 2:
        os.kill(os.getpid(), signal.SIGTERM)  # handled now: the step's checkpoint is asked for
    return _on_step_end(self, args, state, control, **kwargs)
Preemption.on_step_end = on_step_end
_save = Trainer._save_checkpoint
def save(self, model, trial):
    if self.state.global_step == 2:
        time.sleep(2.5)  # past the window in which a launcher's copy of the first signal is ignored
        os.kill(os.getpid(), signal.SIGTERM)
    return _save(self, model, trial)
Trainer._save_checkpoint = save
"""


def wait_for_sentinel(path, timeout=5.0):
    """The sentinel tidies after the process is gone (it polls every 0.2 s): wait for `path` to go."""
    deadline = time.time() + timeout
    while path.exists() and time.time() < deadline:
        time.sleep(0.1)
    return not path.exists()


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once_recording_preempted_with_no_hang_report_nor_lock(tmp_path):
    proc = run_patched(SIGTERM_TWICE_AT_STEP_2, *SHORT, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "SIGTERM again: exiting now, without a checkpoint" in proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "preempted" and "checkpoint" not in results  # checkpoint-2 was never finished
    assert wait_for_sentinel(tmp_path / "hangs" / "rank-0.txt") and wait_for_sentinel(tmp_path / ".sft.lock")
    resumed = run_train(*SHORT, "resume=auto", f"hydra.run.dir={tmp_path}")  # its debris removed, from step 0
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "left incomplete by a crash" in resumed.stdout + resumed.stderr and not list(tmp_path.glob("*.foreign"))


SIGTERM_WHILE_SAVING_THE_MODEL = """
import os, signal
from sft.training.trainer import WeightedLossTrainer
_save_model = WeightedLossTrainer.save_model
def save_model(self, output_dir=None, *args, **kwargs):
    if output_dir and os.path.basename(output_dir) == "model":
        os.kill(os.getpid(), signal.SIGTERM)  # after training: the run finishes within signal_grace_s
    return _save_model(self, output_dir, *args, **kwargs)
WeightedLossTrainer.save_model = save_model
"""


@pytest.mark.slow
def test_a_sigterm_after_training_lets_the_run_finish(tmp_path):
    proc = run_patched(SIGTERM_WHILE_SAVING_THE_MODEL, *SHORT, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGTERM after training: finishing the run" in proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "ok" and results["global_step"] == 4
    assert (tmp_path / "model" / "model.safetensors").is_file() and not (tmp_path / "hangs").exists()


SIGTERM_IN_THE_FIRST_JOB = """
import os, signal
from sft.training.step.preemption import Preemption
_on_step_end = Preemption.on_step_end
def on_step_end(self, args, state, control, **kwargs):
    if state.global_step == 2 and args.output_dir.endswith("/0"):
        os.kill(os.getpid(), signal.SIGTERM)
    return _on_step_end(self, args, state, control, **kwargs)
Preemption.on_step_end = on_step_end
"""


@pytest.mark.slow
def test_sigterm_to_an_in_process_sweep_stops_the_sweep_with_75(tmp_path):
    # As ./launch.sh -m does: the machine is going away, so is the sweep; the job is preempted, not failed.
    proc = run_patched(SIGTERM_IN_THE_FIRST_JOB, "-m", "trainer.seed=1,2", *SHORT, f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert json.loads((tmp_path / "0" / "results.json").read_text())["status"] == "preempted"
    assert (tmp_path / "0" / "checkpoint-2" / "sft_state.json").is_file() and not (tmp_path / "1").exists()


SIGTERM_IN_THE_FIRST_JOBS_START_UP = """
import os, signal
import sft.run.build
_build_model = sft.run.build.build_model
def build_model(cfg, *args, **kwargs):
    from hydra.core.hydra_config import HydraConfig
    if HydraConfig.get().runtime.output_dir.endswith("/0"):
        os.kill(os.getpid(), signal.SIGTERM)  # while the model is built: nothing trained yet
    return _build_model(cfg, *args, **kwargs)
sft.run.build.build_model = build_model
"""

SIGTERM_AFTER_THE_FIRST_JOBS_TRAINING = SIGTERM_WHILE_SAVING_THE_MODEL.replace(
    'os.path.basename(output_dir) == "model"', 'output_dir.endswith("/0/model")')


@pytest.mark.slow
@pytest.mark.parametrize("patch, status", [(SIGTERM_IN_THE_FIRST_JOBS_START_UP, "preempted"),
                                           (SIGTERM_AFTER_THE_FIRST_JOBS_TRAINING, "ok")],
                         ids=["in-start-up", "after-training"])
def test_sigterm_anywhere_in_a_job_stops_an_in_process_sweep_with_75(tmp_path, patch, status):
    """In its start-up the job stops at once (it was killed, exit -15, with no results.json); after its training it
    finishes, and the next job does not start (it did, and the grace timer killed it later, rewriting the finished
    job's results as preempted)."""
    proc = run_patched(patch, "-m", "trainer.seed=1,2", *SHORT, f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert json.loads((tmp_path / "0" / "results.json").read_text())["status"] == status
    summary = (tmp_path / "0" / "summary.txt").read_text()  # this job's own, whether it stopped or finished
    assert summary.startswith("run preempted: 0 steps" if status == "preempted" else "run finished: ")
    assert not (tmp_path / "1").exists()
    assert wait_for_sentinel(tmp_path / "0" / ".sft.lock") and wait_for_sentinel(tmp_path / ".sft.lock")


SIGTERM_AGAIN_AFTER_THE_CHECKPOINT = """
import os, signal, time
from sft.training.step.preemption import Preemption
_on_step_end, _on_save = Preemption.on_step_end, Preemption.on_save
def on_step_end(self, args, state, control, **kwargs):
    if state.global_step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return _on_step_end(self, args, state, control, **kwargs)
def on_save(self, args, state, control, **kwargs):
    _on_save(self, args, state, control, **kwargs)
    if self.saved:
        time.sleep(2.5)  # past the window in which a launcher's copy of the first signal is ignored
        os.kill(os.getpid(), signal.SIGTERM)
Preemption.on_step_end, Preemption.on_save = on_step_end, on_save
"""


@pytest.mark.slow
def test_a_second_sigterm_once_the_checkpoint_is_saved_exits_75_with_it_recorded(tmp_path):
    proc = run_patched(SIGTERM_AGAIN_AFTER_THE_CHECKPOINT, *SHORT, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 75, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "preempted" and results["checkpoint"].endswith("checkpoint-2")


@pytest.mark.slow
def test_sigterm_to_launch_sh_m_stops_the_sweep_after_the_jobs_checkpoint(tmp_path):
    """./launch.sh -m: the running job saves and stops (accelerate's one-process launcher killed it 5 s after the
    signal, recorded failed), the sweep starts no other job, exits 75, and leaves no lock."""
    from conftest import REPO, free_port

    sweep = tmp_path / "sweep"
    launcher = subprocess.Popen([str(REPO / "launch.sh"), "-m", "trainer.seed=1,2", *RUN, f"hydra.sweep.dir={sweep}"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "MASTER_PORT": str(free_port())})
    deadline = time.time() + 300
    while not (sweep / "0" / "checkpoint-4" / "sft_state.json").exists() and launcher.poll() is None:
        assert time.time() < deadline, "no checkpoint-4 within 300 s"
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, err[-3000:]
    results = json.loads((sweep / "0" / "results.json").read_text())
    assert results["status"] == "preempted" and (Path(results["checkpoint"]) / "sft_state.json").is_file()
    assert not (sweep / "1").exists() and "the sweep stops: continue with the same command plus sweep.resume=true" in err
    assert wait_for_sentinel(sweep / "0" / ".sft.lock") and not (sweep / ".sft.lock").exists()


DISK_FULL_WRITING_THE_MODEL = """
import os
import transformers.modeling_utils as modeling_utils
from safetensors import SafetensorError
_save_file = modeling_utils.safe_save_file
def save_file(tensors, filename, *args, **kwargs):
    if os.path.basename(os.path.dirname(filename)) == "model":
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')
    return _save_file(tensors, filename, *args, **kwargs)
modeling_utils.safe_save_file = save_file
"""

READ_ONLY_FILE_SYSTEM = """
import errno, os, tempfile
_temporary_file = tempfile.TemporaryFile
def temporary_file(*args, dir=None, **kwargs):
    if dir is not None and "read-only" in str(dir):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    return _temporary_file(*args, dir=dir, **kwargs)
tempfile.TemporaryFile = temporary_file
"""


@pytest.mark.slow
def test_a_full_disk_while_saving_the_model_and_a_read_only_dir_are_one_line(tmp_path):
    full = run_patched(DISK_FULL_WRITING_THE_MODEL, *SHORT, f"hydra.run.dir={tmp_path}")
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: the disk is full: saving the final model (model/) in "
                                                     f"{tmp_path} failed with "), errors
    assert (tmp_path / "checkpoint-4" / "sft_state.json").is_file()  # resume=auto finishes the run from here
    (tmp_path / "read-only").mkdir()
    for key in ("hydra.run.dir", "trainer.output_dir"):
        proc = run_patched(READ_ONLY_FILE_SYSTEM, *SHORT, f"{key}={tmp_path}/read-only/run",
                           *([f"hydra.run.dir={tmp_path}/run"] if key != "hydra.run.dir" else []))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: config: {key}='{tmp_path}/read-only/run': cannot be written (Read-only file system: "
            f"{tmp_path}/read-only); give a writable dir")


@pytest.mark.slow
def test_a_prepared_run_dir_keeps_checkpoints_it_did_not_write_and_its_links_are_not_followed(tmp_path):
    # resume=auto deleted checkpoints without sft_state.json and trained from step 0; symlinks planted where a run
    # writes had it clobber their targets (issue 33).
    run, victim = tmp_path / "run", tmp_path / "victim"
    (run / "checkpoint-3").mkdir(parents=True)  # a plain Trainer's, copied in
    (run / "checkpoint-3" / "model.safetensors").write_bytes(b"their weights")
    victim.mkdir()
    for name in ("results.json", "train.log"):
        (victim / name).write_text("keep me\n")
        (run / name).symlink_to(victim / name)
    for name in ("model", "hangs", ".hydra"):
        (victim / name).mkdir()
        (run / name).symlink_to(victim / name, target_is_directory=True)
    proc = run_train(*SHORT, "resume=auto", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoint-3.foreign" / "model.safetensors").read_bytes() == b"their weights"
    log = proc.stdout + proc.stderr
    assert "checkpoint-3 has no sft_state.json" in log and "renamed checkpoint-3.foreign" in log
    assert json.loads((run / "results.json").read_text())["global_step"] == 4
    for name in ("results.json", "train.log"):
        assert (victim / name).read_text() == "keep me\n" and not (run / name).is_symlink()
    for name in ("model", "hangs", ".hydra"):
        assert list((victim / name).iterdir()) == [] and not (run / name).is_symlink()
    assert (run / "model" / "model.safetensors").is_file() and (run / ".hydra" / "config.yaml").is_file()


@pytest.mark.slow
def test_links_below_the_top_of_a_run_or_sweep_dir_are_not_followed(tmp_path):
    """A link planted inside .hydra/ or model/ of a run dir, or in a sweep's dir or job dir (its summary, a job's
    record and log), is removed, never written through (issue 41.9)."""
    run, sweep, victim = tmp_path / "run", tmp_path / "sweep", tmp_path / "victim"
    victim.mkdir()
    planted = {run / ".hydra" / "config.yaml", run / ".hydra" / "overrides.yaml", run / "model" / "config.json",
               sweep / "sweep_summary.md", sweep / "sweep_jobs.csv", sweep / "0" / "sweep_job.json",
               sweep / "0" / "train.log", sweep / "0" / ".hydra" / "config.yaml"}
    for i, path in enumerate(sorted(planted)):
        path.parent.mkdir(parents=True, exist_ok=True)
        (victim / str(i)).write_text("keep me\n")
        path.symlink_to(victim / str(i))
    proc = run_train(*SHORT, "resume=auto", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train("-m", "trainer.seed=1", *SHORT, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(p.read_text() == "keep me\n" for p in victim.iterdir())
    assert not any(path.is_symlink() for path in planted) and all(path.is_file() for path in planted)


@pytest.mark.slow
def test_a_secret_given_as_a_config_value_is_written_nowhere(tmp_path):
    secret = "hf_NotARealToken1234567890"
    run, wandb_dir = tmp_path / "run", tmp_path / "wandb"
    proc = run_train(*SHORT, "trainer.save_steps=4", f"trainer.hub_token={secret}",
                     "trainer.report_to=[tensorboard,mlflow,wandb]", f"hydra.run.dir={run}",
                     env={"WANDB_DIR": str(wandb_dir), "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
                          "MLFLOW_ALLOW_FILE_STORE": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoint-4" / "training_args.bin").is_file() and (tmp_path / "mlruns").is_dir()
    recorded = next(wandb_dir.rglob("*.wandb")).read_bytes()  # W&B's run, with the argv it records
    assert b"trainer.hub_token=${oc.env:SFT_SECRET_TRAINER__HUB_TOKEN}" in recorded
    leaks = [str(p) for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaks == [] and secret not in proc.stdout + proc.stderr
    saved = json.loads((run / "checkpoint-4" / "sft_state.json").read_text())["config"]["trainer"]["hub_token"]
    assert saved == "<secret>"


PICKLE_PAYLOAD = """
import os, torch
class Payload:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
torch.save({{"state": Payload()}}, "{path}")
"""


@pytest.mark.slow
def test_a_checkpoint_with_a_pickled_payload_is_refused_in_one_line_and_never_run(tmp_path, uninterrupted):
    import subprocess
    import sys
    import zlib

    run, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(uninterrupted, run)
    for later in (8, 12):
        shutil.rmtree(run / f"checkpoint-{later}")
    optimizer = run / "checkpoint-4" / "optimizer.pt"
    subprocess.run([sys.executable, "-c", PICKLE_PAYLOAD.format(marker=marker, path=optimizer)], check=True)
    state_file = run / "checkpoint-4" / "sft_state.json"
    state = json.loads(state_file.read_text())  # its maker can forge the manifest too
    state["files"]["optimizer.pt"] = {"size": optimizer.stat().st_size, "crc32": zlib.crc32(optimizer.read_bytes())}
    state_file.write_text(json.dumps(state))
    proc = run_train(*RUN, "resume=auto", f"hydra.run.dir={run}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: config: resume='{run / 'checkpoint-4'}': optimizer.pt holds Python objects, not only tensors, which "
        "torch.load(weights_only=True) refuses to run: a checkpoint is code, so resume only from checkpoints you "
        "trust (docs/checkpoints.md)")
    assert not marker.exists()
