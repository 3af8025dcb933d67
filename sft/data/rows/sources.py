"""Where a split's rows come from (`data.train_file`, `data.eval_file`), read through `datasets`:

- a `.jsonl` file: read line by line by `sft.data.rows.reading.scan_jsonl` (bad JSON, bad UTF-8, each named by its line);
- a `.json`, `.parquet`, `.csv` or `.arrow` file, or a glob of them (`data/part-*.parquet`), each read by
  its `datasets` loader; rows are named by their number, counting from 1 over the files in sorted order;
- a folder written by `Dataset.save_to_disk` (a `DatasetDict`'s: its `data.train_split` / `eval_split`);
- `hub:<dataset id>`: `datasets.load_dataset` with `data.hub_name`, `data.hub_revision` and the split.
  Offline (`HF_HUB_OFFLINE=1`, or no network) that is one line naming the dataset, not a traceback.

    Source("data/train.parquet").kind == "files";  Source("hub:org/chats", split="train_sft").kind == "hub"
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class SourceError(ValueError):
    """A source that cannot be read: one line naming it."""


class Source:
    def __init__(self, spec: str, split: str | None = None, hub_name: str | None = None,
                 hub_revision: str | None = None):
        self.spec, self.split, self.hub_name, self.hub_revision = str(spec), split, hub_name, hub_revision
        if self.spec.startswith("hub:"):
            self.kind, self.files = "hub", []
        elif os.path.isdir(self.spec):
            self.kind, self.files = "disk", sorted(str(p) for p in Path(self.spec).rglob("*") if p.is_file())
        else:
            self.files = sorted(glob.glob(self.spec)) if glob.has_magic(self.spec) else [self.spec]
            if not self.files:
                raise SourceError(f"{self.spec}: no file matches")
            suffixes = sorted({Path(f).suffix for f in self.files})
            if len(suffixes) > 1:
                raise SourceError(f"{self.spec}: mixes {', '.join(suffixes)} files: one kind of file per source")
            if suffixes[0] not in LOADERS:
                raise SourceError(f"{self.spec}: {suffixes[0] or 'a file without extension'}: not a kind sft reads "
                                  f"({', '.join(LOADERS)}, a save_to_disk folder, or hub:<dataset id>)")
            self.kind = "jsonl" if self.files == [self.spec] and self.spec.endswith(".jsonl") else "files"

    def __str__(self) -> str:
        return self.spec

    def fingerprint(self) -> str:
        """What identifies the rows: the files' bytes, or the hub dataset's id, config, revision and split."""
        h = hashlib.sha256()
        if self.kind == "jsonl":  # the file's bytes alone, as before sources (older checkpoints' data hash)
            return hashlib.sha256(Path(self.spec).read_bytes()).hexdigest()[:16]
        if self.kind == "hub":  # with the loaded rows' own fingerprint: a new upload at no revision changes it
            h.update(json.dumps([self.spec, self.hub_name, self.hub_revision, self.split,
                                 self.table()._fingerprint]).encode())
            return h.hexdigest()[:16]
        for f in self.files:
            h.update(os.path.relpath(f, self.spec if self.kind == "disk" else os.path.dirname(f)).encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        if self.kind == "disk":
            h.update(str(self.split).encode())
        return h.hexdigest()[:16]

    def table(self):
        """The rows as a `datasets.Dataset` (every kind but `jsonl`), loaded once."""
        if getattr(self, "_table", None) is None:
            self._table = self._load()
        return self._table

    def raw(self, rows: set[int]) -> dict[int, str]:
        """The given rows (numbered from 1) as JSON text, as a rejected row is reported."""
        table = self.table()
        return {n: json.dumps(table[n - 1], ensure_ascii=False, default=str) for n in rows}

    def _load(self):
        import datasets

        try:
            if self.kind == "hub":
                return datasets.load_dataset(self.spec[len("hub:"):], self.hub_name, split=self.split or "train",
                                             revision=self.hub_revision)
            if self.kind == "disk":
                loaded = datasets.load_from_disk(self.spec)
                if isinstance(loaded, datasets.DatasetDict):
                    if self.split not in loaded:
                        raise SourceError(f"{self.spec}: no split {self.split!r} (it has {', '.join(loaded)}): set "
                                          "data.train_split / data.eval_split")
                    loaded = loaded[self.split]
                return loaded
            loader = LOADERS[Path(self.files[0]).suffix]
            return datasets.load_dataset(loader, data_files=self.files, split="train")
        except SourceError:
            raise
        except Exception as e:  # noqa: BLE001 - datasets' and the hub's errors, made one line naming the source
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if self.kind == "hub":
                offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
                hint = ("HF_HUB_OFFLINE is set: unset it, or download the dataset and point data.train_file at a "
                        "local copy" if offline else "check the id, data.hub_name, the split and your network")
                raise SourceError(f"{self.spec}: the hub dataset cannot be loaded ({type(e).__name__}: {first}); "
                                  f"{hint}") from None
            raise SourceError(f"{self.spec}: cannot be read as {self.kind} ({type(e).__name__}: {first})") from None
