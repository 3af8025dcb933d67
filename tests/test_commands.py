"""The `sft` console command (`sft.commands`): one name per command, its version, `python -m sft` the same."""

import re
import subprocess
import sys

import pytest
from conftest import REPO, sft


def test_sft_help_lists_every_command_and_an_unknown_one_is_refused():
    from sft.commands import COMMANDS

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


def test_the_version_is_the_distributions_and_python_m_sft_is_the_same_command():
    proc = sft("--version")
    declared = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert proc.returncode == 0 and proc.stdout.startswith(f"sft {declared} ({REPO / 'sft'})"), proc.stdout
    as_module = subprocess.run([sys.executable, "-m", "sft", "--help"], cwd=REPO, capture_output=True, text=True)
    assert as_module.returncode == 0 and as_module.stdout == sft("--help").stdout
