"""Sources read through `datasets` (Parquet, CSV, JSON, Arrow, globs, save_to_disk folders, the hub) give the
same tokenised rows as the JSONL file of the same chats; bad rows and unreadable sources are one line."""

import json

import pytest
from conftest import ROWS, chat, run_train, write_jsonl

from sft.data.load import load_sft_datasets
from sft.data.rows.reading import DataError
from sft.data.spec import DataSpec


def tokenised(tokenizer, train_file, **data):
    split = load_sft_datasets(DataSpec(train_file=str(train_file), max_length=128, **data), tokenizer).train
    return [(r["input_ids"], r["labels"], r["difficulty_score"], r["source_line"]) for r in split]


@pytest.fixture
def reference(tmp_path, tokenizer):
    return tokenised(tokenizer, write_jsonl(tmp_path / "rows.jsonl", ROWS))


def table(rows=ROWS):
    from datasets import Dataset

    return Dataset.from_list(rows)


@pytest.mark.parametrize("kind", ["parquet", "json", "arrow", "glob", "disk", "disk_dict", "csv"])
def test_every_kind_of_source_gives_the_rows_of_the_jsonl_file(tmp_path, tokenizer, reference, kind):
    data = {}
    if kind == "parquet":
        table().to_parquet(spec := tmp_path / "rows.parquet")
    elif kind == "json":  # one JSON array of rows
        (spec := tmp_path / "rows.json").write_text(json.dumps(ROWS))
    elif kind == "arrow":
        from datasets import load_from_disk

        table().save_to_disk(str(tmp_path / "saved"))
        spec = next((tmp_path / "saved").glob("*.arrow"))
        assert len(load_from_disk(str(tmp_path / "saved"))) == len(ROWS)
    elif kind == "glob":  # two parts, read in sorted order: rows numbered over both
        table(ROWS[:3]).to_parquet(tmp_path / "part-0.parquet")
        table(ROWS[3:]).to_parquet(tmp_path / "part-1.parquet")
        spec = tmp_path / "part-*.parquet"
    elif kind == "disk":
        table().save_to_disk(str(spec := tmp_path / "saved"))
    elif kind == "disk_dict":
        from datasets import DatasetDict

        DatasetDict({"sft": table(), "other": table(ROWS[:1])}).save_to_disk(str(spec := tmp_path / "saved"))
        data["train_split"] = "sft"
    else:  # csv: flat columns, here prompt-completion strings
        import csv

        with open(spec := tmp_path / "rows.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["prompt", "completion", "difficulty_score"])
            writer.writeheader()
            for r in ROWS:
                writer.writerow({"prompt": r["messages"][0]["content"], "completion": r["messages"][1]["content"],
                                 "difficulty_score": r["difficulty_score"]})
    assert tokenised(tokenizer, spec, **data) == reference


def test_a_bad_row_of_a_table_names_the_source_its_row_and_field(tmp_path, tokenizer):
    rows = [chat("1?", "1"), {"messages": [{"role": "user", "content": "2?"}, {"role": "robot", "content": "2"}],
                              "difficulty_score": 1.0}]
    table(rows).to_parquet(spec := tmp_path / "rows.parquet")
    with pytest.raises(DataError) as e:
        tokenised(tokenizer, spec)
    assert f"{spec}:2: messages[1].role: unknown role 'robot'" in str(e.value)
    # with data.on_error=skip the row is left out and reported with its JSON
    data = load_sft_datasets(DataSpec(train_file=str(spec), max_length=128, on_error="skip"), tokenizer,
                             rejected_file=str(tmp_path / "rejected.jsonl"))
    assert len(data.train) == 1
    rejected = json.loads((tmp_path / "rejected.jsonl").read_text())
    assert rejected["line"] == 2 and json.loads(rejected["row"])["messages"][1]["role"] == "robot"


def test_the_data_hash_follows_the_tables_bytes(tmp_path, tokenizer):
    table().to_parquet(spec := tmp_path / "rows.parquet")
    first = load_sft_datasets(DataSpec(train_file=str(spec), max_length=128), tokenizer).data_hash
    table(ROWS[:-1]).to_parquet(spec)
    assert load_sft_datasets(DataSpec(train_file=str(spec), max_length=128), tokenizer).data_hash != first


@pytest.mark.parametrize("spec, message", [
    ("{tmp}/none-*.parquet", "data.train_file='{tmp}/none-*.parquet': no file matches"),
    ("{tmp}/notes.txt", "data.train_file='{tmp}/notes.txt': .txt: not a kind sft reads (.json, .jsonl, .parquet"),
    ("{tmp}/missing.parquet", "data.train_file='{tmp}/missing.parquet': no such file"),
])
def test_cli_a_source_that_cannot_be_read_is_one_line(tmp_path, spec, message):
    (tmp_path / "notes.txt").write_text("hello")
    proc = run_train("data=jsonl", f"data.train_file={spec.format(tmp=tmp_path)}", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message.format(tmp=tmp_path) in proc.stderr


@pytest.mark.slow
def test_cli_an_unreachable_hub_dataset_is_one_line_naming_it_and_hf_hub_offline(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import REPO

    # A fresh interpreter: the hub's libraries read HF_HUB_OFFLINE when imported (run_train's children inherit
    # imports made without it, and would wait on the network first)
    proc = subprocess.run([sys.executable, "-m", "sft.train", "data=jsonl", "data.train_file=hub:nobody/no-such-chats",
                           "trainer.max_steps=1", f"hydra.run.dir={tmp_path}/run"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = next(line for line in proc.stderr.splitlines() if "hub:nobody/no-such-chats" in line)
    assert "the hub dataset cannot be loaded" in line and "HF_HUB_OFFLINE is set" in line
