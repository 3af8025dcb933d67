"""Built artefacts' cache (`sft.cache`): a directory appears complete or not at all."""

import pytest

from sft.cache import building, cache_dir


def test_a_build_appears_whole_and_a_failed_one_leaves_nothing(tmp_path):
    target = tmp_path / "models" / "tiny"
    with building(target) as tmp:
        (tmp / "config.json").write_text("{}")
        assert not target.exists()  # nothing is visible while it is built
    assert (target / "config.json").read_text() == "{}"
    other = tmp_path / "models" / "broken"
    with pytest.raises(RuntimeError), building(other) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("the build failed")
    assert not other.exists() and sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]


def test_a_build_another_process_finished_first_is_kept(tmp_path):
    target = tmp_path / "tiny"
    with building(target) as tmp:
        (tmp / "mine").write_text("1")
        target.mkdir()  # another process renamed its complete build into place first
        (target / "theirs").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # and this build's dir is gone


def test_the_cache_is_sft_cache_or_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("SFT_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SFT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "sft"
