"""sft as a user installs it without a checkout: the wheel built from this tree, installed into a fresh virtual
environment outside it (no `-e`), trains the default run and inspects data from another directory, with the config
groups the wheel carries (`sft/conf/`), not the checkout's.

The fresh environment gets sft from the wheel alone. Its dependencies (torch, transformers, ... several GB) are
those of the environment running the tests, reached through a `.pth` line naming that environment's
site-packages: a plain path entry, so that environment's own `.pth` files (the editable install of sft among them)
are not processed and its `sft` is not importable there. The wheel's declared requirements are then checked to be
met there (`UNMET`).
"""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_EVAL


# The requirements the installed sft declares (extras aside) that its environment does not meet: [] where all are.
UNMET = ("from importlib.metadata import requires, version; from packaging.requirements import Requirement; "
         "print([str(r) for r in map(Requirement, requires('sft')) if r.marker is None "
         "and not r.specifier.contains(version(r.name), prereleases=True)])")


def tree_copy(dest: Path) -> Path:
    """The project's files as a clone has them (tracked and untracked-not-ignored: the working tree under test),
    copied to `dest`: the build writes its `build/` and `*.egg-info` there, not into the checkout."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(source.read_bytes())
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this tree installed; returns its bin dir."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tree_copy(tmp / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("sft-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "deps_of_the_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    return venv / "bin"


@pytest.mark.slow
def test_the_wheel_carries_the_configs_and_trains_and_inspects_from_another_directory(installed, tmp_path):
    env = {**os.environ, "PATH": f"{installed}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    elsewhere = tmp_path / "elsewhere"  # no checkout here: only what the wheel installed
    elsewhere.mkdir()

    def sft(*args):
        return subprocess.run([str(installed / "sft"), *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=600)

    check = subprocess.run([str(installed / "python"), "-c", UNMET], env=env, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "[]", check.stdout + check.stderr
    version = sft("--version")
    site = installed.parent / "lib"
    assert version.returncode == 0 and str(site) in version.stdout, version.stdout + version.stderr

    run = tmp_path / "run"
    proc = sft("train", "trainer.max_steps=2", "trainer.eval_steps=2", "trainer.save_strategy=no",
               f"data.eval_file={SMALL_EVAL}", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["global_step"] == 2
    sources = json.dumps(yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["config_sources"])
    assert f"{site}" in sources and str(REPO / "sft" / "conf") not in sources, sources  # the wheel's own configs

    proc = sft("inspect", "--rows", "1", "--color", "never")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train: 4,000 rows read, 0 rejected" in proc.stdout and "⟦" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_the_wheel_lists_every_config_file_of_the_package(tmp_path):
    """What `pip install` gets: every YAML of sft/conf/ (and the sample data, the lm-eval tasks, the chat templates sft
    supplies for base models), no test or example."""
    source = tree_copy(tmp_path / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("sft-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {str(p.relative_to(REPO)) for p in (REPO / "sft" / "conf").rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert {"sft/sample_data/train.jsonl", "sft/eval/tasks/sft_sample_addition.yaml"} <= names
    templates = {str(p.relative_to(REPO)) for p in (REPO / "sft" / "model" / "chat_templates").glob("*.jinja")}
    assert templates and templates <= names, sorted(templates - names)
    assert not any(n.startswith(("tests/", "examples/")) for n in names)
