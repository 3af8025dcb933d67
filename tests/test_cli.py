"""The `sft` console command (`sft.cli`): one name per tool; and a run made again from its recipe (`sft.recipe`)."""

import subprocess
import sys

import pytest
import yaml
from conftest import REPO, SMALL_EVAL, run_train


def sft(*args: str) -> subprocess.CompletedProcess:
    """`sft args...` as the console script runs it (the script calls sft.cli.main)."""
    return subprocess.run([sys.executable, "-c", "from sft.cli import main; main()", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_sft_help_lists_every_command_and_an_unknown_one_is_refused():
    from sft.cli import COMMANDS

    proc = sft("--help")
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.split("commands:\n")[1].splitlines()] == list(COMMANDS)
    proc = sft("tran")
    assert proc.returncode == 2 and proc.stderr.startswith("error: sft has no command 'tran'\nusage: sft <command>")


@pytest.mark.slow
def test_each_command_answers_its_own_help():
    for command in ("inspect", "merge", "recipe", "report", "compare"):
        proc = sft(command, "--help")
        assert "Traceback" not in proc.stderr, (command, proc.stderr)
    assert "== Configuration groups ==" in sft("train", "--help").stdout


@pytest.mark.slow
def test_a_runs_recipe_composes_its_config_again_and_trains_a_variant(tmp_path):
    run = tmp_path / "run"
    made = ["loss=ce", "lora=default", "+controllers=curriculum", "controllers.curriculum.chunk_size=8",
            "~controllers.watchdog", "trainer.max_steps=2", "trainer.eval_steps=2", f"data.eval_file={SMALL_EVAL}",
            "trainer.save_strategy=no",
            "+model.config_overrides.attention_dropout=0.0", "eval_buckets=[1.5,3]", f"hydra.run.dir={run}"]
    proc = run_train(*made)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = sft("recipe", str(run), "-o", str(tmp_path / "mine.yaml"))
    assert proc.returncode == 0, proc.stderr
    composed = sft("train", "--config-dir", str(tmp_path), "--config-name", "mine", "--cfg", "job")
    assert composed.returncode == 0, composed.stderr
    assert yaml.safe_load(composed.stdout) == yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    proc = sft("train", "--config-dir", str(tmp_path), "--config-name", "mine", "trainer.max_steps=3",
               f"hydra.run.dir={tmp_path / 'again'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "again" / ".hydra" / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 3 and list(saved["controllers"]) == ["guard", "curriculum"]
