"""Multirun sweeps: job dirs, the report, failure isolation, isolation between jobs, launch.sh -m (Optuna: the
example, tests/e2e/test_examples.py)."""

import csv
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SMALL_EVAL, free_port, launch, run_train, step_losses

QUICK = ["trainer.max_steps=3", "trainer.eval_steps=2", "trainer.save_steps=3", "trainer.logging_steps=1",
         "trainer.per_device_train_batch_size=8", f"data.eval_file={SMALL_EVAL}"]


def sweep(tmp_path, *overrides):
    proc = run_train("-m", *QUICK, *overrides, f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def summary(sweep_dir):
    """The report's job rows."""
    with open(sweep_dir / "sweep_jobs.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_2x2_sweep_writes_job_dirs_and_a_report_that_rebuilds_from_disk(tmp_path):
    proc = sweep(tmp_path, "loss.alpha=0.5,2", "clip.max_norm=0.5,1.0")
    jobs = sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())
    assert jobs == ["0", "1", "2", "3"] and all((tmp_path / j / "results.json").exists() for j in jobs)
    rows = summary(tmp_path)
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert {(r["loss.alpha"], r["clip.max_norm"]) for r in rows} == {("0.5", "0.5"), ("0.5", "1.0"), ("2", "0.5"),
                                                                      ("2", "1.0")}
    assert "trainer.max_steps" not in rows[0]  # the same in every job: not a column
    assert all(float(r["eval_loss"]) < 6 and float(r["best_eval_loss"]) <= float(r["eval_loss"]) for r in rows)
    assert "| loss.alpha |" in (tmp_path / "sweep_summary.md").read_text().replace("| clip.max_norm ", "")
    assert "| job |" in proc.stdout  # the table is printed at the end
    png = tmp_path / "sweep_summary.png"
    assert png.stat().st_size > 20_000
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97]}) > 20  # a drawing, not a blank

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "0" / "runs" / "hparams"))
    events.Reload()
    assert "hparams" in events.PluginTagToContent("hparams") or events.PluginTagToContent("hparams")

    before = (tmp_path / "sweep_summary.csv").read_text()
    for name in ("sweep_summary.csv", "sweep_jobs.csv", "sweep_summary.md", "sweep_summary.png"):
        (tmp_path / name).unlink()
    proc = subprocess.run([sys.executable, "-m", "sft", "report", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and (tmp_path / "sweep_summary.csv").read_text() == before
    (tmp_path / "1" / "results.json").unlink()  # as if the sweep had been killed during job 1
    subprocess.run([sys.executable, "-m", "sft", "report", str(tmp_path)], cwd=REPO, check=True, capture_output=True)
    assert [r["status"] for r in summary(tmp_path)] == ["ok", "interrupted", "ok", "ok"]


@pytest.mark.slow
def test_a_failing_job_is_recorded_the_sweep_goes_on_and_exits_non_zero_after_its_report(tmp_path):
    """The summary named the failed job and the command said success (exit 0): now it exits 3, in one line naming the
    job, after the report of every job."""
    from sft.experiments.report import SWEEP_FAILED_EXIT_CODE

    proc = run_train("-m", *QUICK, "clip.max_norm=-1,0.5", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == SWEEP_FAILED_EXIT_CODE == 3, proc.stderr[-3000:]
    rows = summary(tmp_path)
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert "clip.max_norm=-1.0: must be >= 0" in rows[0]["error"] and rows[1]["eval_loss"]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: 1 job(s) of the sweep in {tmp_path} did not finish: #0 (failed: ") and "exit code 3" in last


def test_a_sweep_whose_job_failed_or_vanished_names_them_and_exits_3_one_that_all_finished_nothing(tmp_path, capsys):
    from sft.experiments.results import RunResults
    from sft.experiments.report import exit_if_a_job_failed

    for number, results in enumerate([RunResults(), RunResults.failed("ConfigError: clip.max_norm=-1", 1.0), None]):
        (tmp_path / str(number)).mkdir()
        if results is not None:
            results.write(tmp_path / str(number))
    with pytest.raises(SystemExit) as stopped:
        exit_if_a_job_failed(tmp_path)
    assert stopped.value.code == 3
    said = capsys.readouterr().err
    assert "2 job(s)" in said and "#1 (failed: ConfigError: clip.max_norm=-1)" in said and "#2 (no results.json" in said
    (tmp_path / "1" / "results.json").unlink()
    RunResults().write(tmp_path / "1")
    RunResults().write(tmp_path / "2")
    exit_if_a_job_failed(tmp_path)  # every job finished: nothing said, no exit


def model_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


KILL_JOB_1_AT_STEP_3 = """
import os
from transformers import TrainerCallback
import sft.training.trainer

class Kill(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        from hydra.core.hydra_config import HydraConfig
        if HydraConfig.get().job.num == 1 and state.global_step == 3:
            os._exit(137)  # as a preempted node: no cleanup, no results.json

init = sft.training.trainer.WeightedLossTrainer.__init__
def with_kill(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.add_callback(Kill())
sft.training.trainer.WeightedLossTrainer.__init__ = with_kill
"""


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_to_the_results_of_an_uninterrupted_one(tmp_path):
    """Also reproducibility on CPU: a job of a sweep gives the same step losses, eval metrics and final
    parameters, bit for bit, as the same config run alone (one process keeps nothing from job to job)."""
    from conftest import run_patched

    jobs = ["loss.alpha=0.5,1,2", "trainer.max_steps=4", "trainer.save_steps=2"]
    quick = [o for o in QUICK if not o.startswith(("trainer.max_steps", "trainer.save_steps"))]

    def sweep(sweep_dir, *overrides):
        proc = run_train("-m", *quick, *overrides, f"hydra.sweep.dir={sweep_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]

    sweep(tmp_path / "whole", *jobs)
    alone = run_train(*quick, *jobs[1:], "loss.alpha=1", f"hydra.run.dir={tmp_path / 'alone'}")
    assert alone.returncode == 0, alone.stderr[-3000:]
    job_1, alone = tmp_path / "whole" / "1", tmp_path / "alone"
    assert step_losses(job_1, 4) == step_losses(alone, 4)
    a, b = (json.loads((run / "results.json").read_text()) for run in (job_1, alone))
    assert (a["eval_loss"], a["eval_ce"]) == (b["eval_loss"], b["eval_ce"])
    theirs, ours = model_weights(job_1), model_weights(alone)
    assert theirs.keys() == ours.keys() and all((theirs[k] == ours[k]).all() for k in ours)

    cut = tmp_path / "cut"
    killed = run_patched(KILL_JOB_1_AT_STEP_3, "-m", *quick, *jobs, f"hydra.sweep.dir={cut}")
    assert killed.returncode == 137 and not (cut / "1" / "results.json").exists() and not (cut / "2").exists()
    finished = (cut / "0" / "results.json").read_text()
    sweep(cut, *jobs, "sweep.resume=true")
    assert (cut / "0" / "results.json").read_text() == finished  # skipped, not run again
    assert json.loads((cut / "1" / "results.json").read_text())["resumed_from"].endswith("checkpoint-2")
    for number in "012":
        a = json.loads((tmp_path / "whole" / number / "results.json").read_text())
        b = json.loads((cut / number / "results.json").read_text())
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], abs=1e-6) and b["global_step"] == 4
    assert [r["status"] for r in summary(cut)] == ["ok", "ok", "ok"]

    other = run_train("-m", *quick, "loss.alpha=3,4", "sweep.resume=true", f"hydra.sweep.dir={cut}")
    assert other.returncode == 2
    assert "sweep.resume=True: job 0 in" in other.stderr and "another sweep" in other.stderr
    records = {p: p.read_bytes() for p in cut.rglob("*") if p.is_file() and p.name != ".sft.lock"}
    again = run_train("-m", *quick, "loss.alpha=3,4", f"hydra.sweep.dir={cut}")  # a new sweep into that dir
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip() == (f"error: config: hydra.sweep.dir='{cut}': holds another sweep's jobs (3: 0, 1, 2): "
                                    "sweep.resume=true continues that sweep; another hydra.sweep.dir starts a new one "
                                    "beside it")
    assert {p: p.read_bytes() for p in cut.rglob("*") if p.is_file() and p.name != ".sft.lock"} == records


def test_a_sweep_started_into_a_dir_another_sweep_runs_in_is_refused(tmp_path):
    from sft.training.checkpoints.run_dir import RunDirLock

    lock = RunDirLock(tmp_path / "busy", "hydra.sweep.dir")
    lock.acquire()  # the first sweep, still running
    try:
        proc = run_train("-m", "loss.alpha=0,1", f"hydra.sweep.dir={tmp_path / 'busy'}")
    finally:
        lock.release()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: config: hydra.sweep.dir='{tmp_path / 'busy'}': ") and str(os.getpid()) in proc.stderr
    assert not list((tmp_path / "busy").glob("[0-9]"))  # no job of the second sweep started


def mlflow_store(tmp_path) -> dict:
    """A local MLflow file store for a run's environment (MLflow 3 refuses file stores unless allowed)."""
    return {"MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}


def mlflow_runs(store: dict, experiment: str) -> dict:
    """{run name: (run, {artifact name: text})} of an experiment, read back with MLflow's own client."""
    import os

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store["MLFLOW_TRACKING_URI"])
    found = client.get_experiment_by_name(experiment)
    assert found is not None, [e.name for e in client.search_experiments()]
    runs = {}
    for run in client.search_runs([found.experiment_id]):
        local = download_artifacts(run_id=run.info.run_id, tracking_uri=store["MLFLOW_TRACKING_URI"])
        texts = {a.path: open(os.path.join(local, a.path), errors="replace").read()
                 for a in client.list_artifacts(run.info.run_id)}
        runs[run.info.run_name] = (run, texts)
    return runs


def job_run(runs: dict, alpha: str):
    """The job's run: runs are named by their job's overrides, as W&B runs are."""
    (name,) = [name for name in runs if f"loss.alpha={alpha}" in name.split()]
    return runs[name]


def assert_job_logged(run, texts, job_dir, alpha: str) -> None:
    """A job's MLflow run: finished, the flattened config and Trainer's fields as params, the final eval metrics
    of results.json, results.json itself as an artifact."""
    results = json.loads((job_dir / "results.json").read_text())
    assert run.info.status == "FINISHED"
    assert float(run.data.params["loss.alpha"]) == float(alpha) and run.data.params["trainer.max_steps"] == "3"
    assert run.data.params["max_steps"] == "3"  # Trainer's MLflowCallback logged into the same run
    assert run.data.metrics["eval_loss"] == pytest.approx(results["eval_loss"], rel=1e-12)
    assert json.loads(texts["results.json"]) == results and "eval_rows.jsonl" in texts


@pytest.mark.slow
def test_mlflow_logs_each_job_of_a_sweep_and_its_report_under_one_experiment(tmp_path):
    pytest.importorskip("mlflow")
    store = mlflow_store(tmp_path)
    sweep_dir = tmp_path / "sweep"
    proc = run_train("-m", *QUICK, "trainer.report_to=[mlflow]", "loss.alpha=0.5,1", f"hydra.sweep.dir={sweep_dir}",
                     env=store)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = mlflow_runs(store, f"sweep {sweep_dir}")
    assert len(runs) == 3 and "sweep report" in runs
    for number, alpha in ((0, "0.5"), (1, "1")):
        assert_job_logged(*job_run(runs, alpha), sweep_dir / str(number), alpha)
    report_run, report = runs["sweep report"]
    assert report["sweep_summary.md"] == (sweep_dir / "sweep_summary.md").read_text()
    assert {"sweep_summary.csv", "sweep_jobs.csv", "sweep_summary.png"} <= set(report)


@pytest.mark.slow
def test_launch_sh_sweep_runs_each_job_through_accelerate_with_two_processes(tmp_path):
    """Also MLflow through ./launch.sh -m: each job a run of the sweep's experiment, named by its overrides."""
    store = mlflow_store(tmp_path)
    sweep_dir = tmp_path / "sweep"
    proc = launch("--nproc", "2", "-m", "loss.alpha=0.5,1", *QUICK, "trainer.report_to=[mlflow]",
                  f"hydra.sweep.dir={sweep_dir}", env=store)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[sweep] #0 (1/2, 0 done): loss.alpha=0.5" in proc.stdout and "[sweep] #1 (2/2, 1 done)" in proc.stdout
    rows = summary(sweep_dir)
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["loss.alpha"] for r in rows] == ["0.5", "1"]
    state = json.loads((sweep_dir / "0" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["log_history"][-1]["num_input_tokens_seen"] > 3 * 2 * 8 * 20  # two ranks trained together
    runs = mlflow_runs(store, f"sweep {sweep_dir}")
    assert len(runs) == 3 and "sweep report" in runs  # rank 0 only: one run per job
    for number, alpha in ((0, "0.5"), (1, "1")):
        assert_job_logged(*job_run(runs, alpha), sweep_dir / str(number), alpha)


@pytest.mark.slow
def test_multirun_inside_a_multi_process_launch_is_refused():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "sft.train", "-m", "loss.alpha=0.5,1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "./launch.sh -m" in proc.stderr and "hydra/launcher=slurm" in proc.stderr


def test_slurm_launcher_preset_composes():
    proc = subprocess.run([sys.executable, "-m", "sft.train", "hydra/launcher=slurm", "--cfg", "hydra", "--resolve"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "submitit" in proc.stdout and "tasks_per_node: 8" in proc.stdout


def test_the_loss_zoo_sweeps_each_loss_of_its_group_over_three_seeds():
    from hydra.utils import get_class

    from sft.commands.sweep import expand
    from sft.config import compose

    jobs = [sorted(o for o in job if not o.startswith("+experiment=")) for job in expand(["+experiment=loss_zoo"])]
    zoo = {"ce": "CrossEntropyLoss", "hard_sample": "HardSampleLoss", "keywords": "KeywordLoss", "focal": "FocalLoss",
           "dft": "DFTLoss", "length": "LengthLoss"}
    assert jobs == [[f"+loss_zoo={loss}", f"trainer.seed={seed}"] for loss in zoo for seed in (1, 2, 3)]
    for name, target in zoo.items():
        cfg = compose("train", ["+experiment=loss_zoo", f"+loss_zoo={name}"])
        assert get_class(cfg.loss._target_).__name__ == target and cfg.sweep.baseline == "+loss_zoo=ce"
