"""The ids a run trains on are its tokenizer file's (`sft.model.tokenizer_ids`): transformers 5 loads a tokenizer as
the class of config.json's model type, so SmolLM2's tokenizer.json beside a qwen2 config becomes Qwen2Tokenizer,
which splits text otherwise. Checked against `tokenizers`' own reading of the file, which sft did not write."""

import json
import logging
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from sft.config.schema import ConfigError
from sft.model.loading import load_tokenizer, tiny_model_dir
from sft.model.tokenizer_ids import PROBE_CHATS, file_tokenizer, probe_texts



@pytest.fixture
def qwen2_beside_another_pre_tokenizer(tmp_path):
    """The fast loop's case: the tiny model's dir (a qwen2 config) whose tokenizer.json splits words at white space
    before its byte-level BPE, as another model's file would; Qwen2Tokenizer splits with Qwen2's own pattern."""
    folder = tmp_path / "other"
    folder.mkdir()
    for path in tiny_model_dir().iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_the_check_refuses_a_class_that_splits_otherwise_and_file_keeps_the_files_ids(
        qwen2_beside_another_pre_tokenizer):
    folder = qwen2_beside_another_pre_tokenizer
    with pytest.raises(ConfigError, match=r"^tokenizer.ids_from='checked': transformers loads .* as Qwen2Tokenizer"):
        load_tokenizer(str(folder))
    own = load_tokenizer(str(folder), ids_from="file")
    assert class_ids(own) == file_ids(folder, own)


# SmolLM2's real tokenizer beside a qwen2 config: its GGUF converted once a session (20 s), beside the fast loop


@pytest.fixture
def qwen2_beside_smollm2(tmp_path, smollm2_dir):
    """SmolLM2's own tokenizer files in a dir whose config.json says qwen2 (the tiny model's)."""
    folder = tmp_path / "paired"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, folder / name)
    shutil.copy(tiny_model_dir() / "config.json", folder / "config.json")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    return folder


def file_ids(folder, tokenizer):
    file = file_tokenizer(folder)
    return [file.encode(text, add_special_tokens=False).ids for text in probe_texts(tokenizer)]


def class_ids(tokenizer):
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in probe_texts(tokenizer)]


@pytest.mark.slow
def test_a_tokenizer_whose_class_splits_otherwise_than_its_file_is_refused_naming_both(qwen2_beside_smollm2):
    with pytest.raises(ConfigError) as refused:
        load_tokenizer(str(qwen2_beside_smollm2))
    message = str(refused.value)
    assert message.startswith(f"tokenizer.ids_from='checked': transformers loads {qwen2_beside_smollm2} as "
                              "Qwen2Tokenizer (the class of its config.json's model type), which tokenizes otherwise "
                              "than the dir's own tokenizer.json: on a rendered probe chat Qwen2Tokenizer gives ")
    assert message.endswith("tokenizer.ids_from=file trains on the file's ids (its author's), "
                            "tokenizer.ids_from=class on Qwen2Tokenizer's")


@pytest.mark.slow
def test_ids_from_file_trains_on_the_files_own_ids_and_class_on_the_classs_logged(qwen2_beside_smollm2, caplog):
    own = load_tokenizer(str(qwen2_beside_smollm2), ids_from="file")
    assert class_ids(own) == file_ids(qwen2_beside_smollm2, own)
    with caplog.at_level(logging.WARNING, logger="sft"):
        theirs = load_tokenizer(str(qwen2_beside_smollm2), ids_from="class")
    assert type(theirs).__name__ == "Qwen2Tokenizer" and class_ids(theirs) != file_ids(qwen2_beside_smollm2, theirs)
    assert "tokenizer.ids_from=class: training with Qwen2Tokenizer's ids, not its tokenizer.json's" in caplog.text


@pytest.mark.slow
def test_tokenizers_whose_class_agrees_with_their_file_load_as_before(smollm2_dir):
    for folder, name in ((smollm2_dir, "TokenizersBackend"), (tiny_model_dir(), "Qwen2Tokenizer")):
        tokenizer = load_tokenizer(str(folder))
        assert type(tokenizer).__name__ == name and class_ids(tokenizer) == file_ids(folder, tokenizer)
    assert len(probe_texts(tokenizer)) == len(PROBE_CHATS)


@pytest.mark.slow
def test_sft_inspect_refuses_the_pair_in_one_line(qwen2_beside_smollm2):
    proc = subprocess.run([sys.executable, "-m", "sft", "inspect", f"model.name_or_path={qwen2_beside_smollm2}",
                           "--rows", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: config: tokenizer.ids_from='checked': transformers "
                                                           f"loads {qwen2_beside_smollm2} as Qwen2Tokenizer")
    assert "Traceback" not in proc.stderr
