"""Multirun sweeps: job dirs, the report, failure isolation, isolation between jobs, Optuna, launch.sh -m."""

import csv
import json
import subprocess
import sys

import pytest

from conftest import REPO, free_port, launch, run_train

QUICK = ["trainer.max_steps=3", "trainer.eval_steps=2", "trainer.save_steps=3", "trainer.logging_steps=1",
         "trainer.per_device_train_batch_size=8"]


def sweep(tmp_path, *overrides):
    proc = run_train("-m", *QUICK, *overrides, f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def summary(sweep_dir):
    with open(sweep_dir / "sweep_summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_2x2_sweep_writes_job_dirs_and_a_report(tmp_path):
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


@pytest.mark.slow
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    sweep(tmp_path, "clip.max_norm=-1,0.5")
    rows = summary(tmp_path)
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert "clip.max_norm=-1.0: must be >= 0" in rows[0]["error"] and rows[1]["eval_loss"]


@pytest.mark.slow
def test_a_job_of_a_sweep_equals_the_same_config_run_alone(tmp_path):
    sweep(tmp_path / "sweep", "loss.alpha=0.5,2")
    alone = run_train(*QUICK, "loss.alpha=2", f"hydra.run.dir={tmp_path / 'alone'}")
    assert alone.returncode == 0, alone.stderr[-3000:]

    def losses(run):
        state = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())
        return [e["loss"] for e in state["log_history"] if "loss" in e]

    assert losses(tmp_path / "sweep" / "1") == pytest.approx(losses(tmp_path / "alone"), abs=1e-6)
    a = json.loads((tmp_path / "sweep" / "1" / "results.json").read_text())
    b = json.loads((tmp_path / "alone" / "results.json").read_text())
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=1e-6)


@pytest.mark.slow
def test_report_rebuilds_the_summary_from_disk_also_for_an_interrupted_sweep(tmp_path):
    sweep(tmp_path, "loss.alpha=0.5,2")
    before = (tmp_path / "sweep_summary.csv").read_text()
    for name in ("sweep_summary.csv", "sweep_summary.md", "sweep_summary.png"):
        (tmp_path / name).unlink()
    proc = subprocess.run([sys.executable, "-m", "sft.report", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and (tmp_path / "sweep_summary.csv").read_text() == before
    (tmp_path / "1" / "results.json").unlink()  # as if the sweep had been killed during job 1
    subprocess.run([sys.executable, "-m", "sft.report", str(tmp_path)], cwd=REPO, check=True, capture_output=True)
    assert [r["status"] for r in summary(tmp_path)] == ["ok", "interrupted"]


@pytest.mark.slow
def test_optuna_preset_minimises_the_returned_eval_ce(tmp_path):
    proc = run_train("-m", "hydra/sweeper=optuna_alpha_clip", "hydra.sweeper.n_trials=2", *QUICK,
                     f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import yaml

    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    values = [json.loads((tmp_path / j / "results.json").read_text())["eval_ce"] for j in ("0", "1")]
    assert best["best_value"] == pytest.approx(min(values))
    assert set(best["best_params"]) == {"loss.alpha", "clip.max_norm"}


@pytest.mark.slow
def test_launch_sh_sweep_runs_each_job_through_accelerate_with_two_processes(tmp_path):
    proc = launch("--nproc", "2", "-m", "loss.alpha=0.5,1", *QUICK, f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["loss.alpha"] for r in rows] == ["0.5", "1"]
    state = json.loads((tmp_path / "0" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["log_history"][-1]["num_input_tokens_seen"] > 3 * 2 * 8 * 20  # two ranks trained together


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
