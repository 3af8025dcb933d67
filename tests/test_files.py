"""A run's own files (`sft.files`): never written through a link planted where they go, written whole."""

import os

import pytest

from sft.files import in_package, own_dir, own_path, write_text


def test_a_planted_link_is_removed_and_its_target_untouched(tmp_path):
    target = tmp_path / "bashrc"
    target.write_text("mine")
    planted = tmp_path / "run" / "results.json"
    planted.parent.mkdir()
    planted.symlink_to(target)
    write_text(own_path(planted), "{}")
    assert planted.read_text() == "{}" and not planted.is_symlink() and target.read_text() == "mine"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run" / "model").symlink_to(tmp_path / "elsewhere")
    assert own_dir(tmp_path / "run" / "model").is_dir() and not (tmp_path / "run" / "model").is_symlink()


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_text(path, "old")

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_text(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_packages_file_is_found_without_importing_it():
    found, _ = in_package("sft/model/chat_templates/gemma3.jinja")
    assert found is not None and found.is_file()
    assert in_package("sft/no/such.file")[0] is None and in_package("not a package/x")[0] is None
