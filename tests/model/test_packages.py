"""Packages installed the first time they are needed (`sft.model.packages`): one line saying what and why, pip's own
output, then importable in the same process; SFT_NO_INSTALL=1 installs nothing and says so; a failed install is said."""

import sys

import pytest

from sft.model.packages import OnDemand, ensure

PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"
[project]
name = "sft-probe-package"
version = "1.0"
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A local package, installed with --target into a folder on sys.path (this environment stays as it was)."""
    source = tmp_path / "source"
    (source / "sft_probe_package").mkdir(parents=True)
    (source / "sft_probe_package" / "__init__.py").write_text("VALUE = 42\n")
    (source / "pyproject.toml").write_text(PYPROJECT)
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SFT_NO_INSTALL", raising=False)
    return OnDemand("sft_probe_package", ("--no-build-isolation", "--no-deps", "--no-index", "--target", str(site),
                                          str(source)), "a probe for the tests", "a few seconds")


def test_a_missing_package_is_installed_once_saying_so_then_imports(probe, capfd):
    assert ensure(probe) is None
    said = capfd.readouterr().err
    assert said.splitlines()[0].startswith("sft: installing --no-build-isolation") and "a probe for the tests, the " \
        "first time it is needed (a few seconds); SFT_NO_INSTALL=1 turns this off" in said
    import sft_probe_package

    assert sft_probe_package.VALUE == 42
    assert ensure(probe) is None and "installing" not in capfd.readouterr().err  # present: nothing more
    sys.modules.pop("sft_probe_package")


def test_with_sft_no_install_nothing_is_installed_and_the_reason_is_given(probe, monkeypatch, capfd):
    monkeypatch.setenv("SFT_NO_INSTALL", "1")
    assert ensure(probe) == "SFT_NO_INSTALL=1 is set" and "installing" not in capfd.readouterr().err


def test_a_failed_install_is_said(probe, tmp_path):
    broken = OnDemand(probe.module, probe.requirement[:-1] + (str(tmp_path / "nowhere"),), "a probe", "no time")
    assert ensure(broken).startswith("pip install failed (exit 1")

