"""`data.streaming=true`: train on local JSONL or Parquet shards larger than memory or the disk cache, read as a
`datasets.IterableDataset` and rendered, tokenised and weighed as the rows come, never all at once.

    data.train_file="data/part-*.jsonl"  ->  files in sorted order  ->  rows, validated as map-style reading validates
    them (a bad row named by its file and line: refused, or skipped and counted with data.on_error=skip)  ->  a batched
    map: sequences labelled by the chat template, the loss's static weights  ->  this rank's share (by file where
    the files divide over the ranks, else every world-size-th sequence)  ->  `Stream`

A mixture (`data.mixture`, each source with a `ratio`) interleaves its sources' streams with those probabilities
(`datasets.interleave_datasets`, seeded by `data.mixture_seed`). Rows go in file order: shuffle the shards
beforehand (a shuffle buffer would be lost on resume, and the resume would not be exact).

Where the stream is: `Stream` gives every sequence with the stream's position after it (`datasets`' own
`state_dict`), the collator passes the last one of each micro-batch on, and the trainer keeps the last trained one
(`WeightedLossTrainer.stream_position`); checkpoints hold every rank's, and a resume continues each rank's stream at
the exact next sequence, reading past the earlier rows without tokenising them. The eval split is read whole, as
without streaming.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch

from sft.data.rows.reading import DataError, Rejected, accept, iter_jsonl, without_nulls
from sft.data.rows.sources import Source, SourceError

log = logging.getLogger(__name__)

STREAMED = (".jsonl", ".parquet")


def stream_files(source: Source) -> list[str]:
    """The files of a source a stream reads: local JSONL or Parquet, one kind."""
    if source.kind in ("hub", "disk") or Path(source.files[0]).suffix not in STREAMED:
        raise SourceError(f"{source}: data.streaming reads local .jsonl or .parquet files (or a glob of them)")
    return source.files


def identity(files: list[str]) -> list[list]:
    """What identifies streamed files without reading them: path, size and modification time."""
    return [[f, (info := os.stat(f)).st_size, info.st_mtime_ns] for f in files]


def iter_parquet(path: str, rejected: list, default_score, score_required: bool, row_format, train_on: str):
    """A Parquet file's valid rows, a record batch at a time (rows numbered from 1), the rejected ones appended to
    `rejected`."""
    import json

    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            number += 1

            def reject(field: str, reason: str, number=number, row=row) -> None:
                rejected.append(Rejected(path, number, field, reason, json.dumps(row, ensure_ascii=False,
                                                                                 default=str)))

            accepted = accept(without_nulls(row), number, reject, default_score, score_required, row_format,
                               train_on)
            if accepted is not None:
                yield accepted


def raw_rows(files: list[str], default_score, row_format, train_on: str, on_error: str):
    """`IterableDataset.from_generator`'s generator: the valid rows of `files` (its shards), with their file; a
    rejected row stops the stream (`on_error=raise`: `DataError` naming file, line and field) or is logged and
    counted (`skip`)."""
    import json

    for path in files:
        rejected: list[Rejected] = []
        reader = iter_jsonl if path.endswith(".jsonl") else iter_parquet
        for row in reader(path, rejected, default_score, False, row_format, train_on):
            report(rejected, on_error)
            yield {**row, "messages": json.dumps(row["messages"]), "source_file": path}
        report(rejected, on_error)


def report(rejected: list[Rejected], on_error: str) -> None:
    """Bad rows met in the stream: a `DataError`, or (`skip`) one warning each; `rejected` is emptied."""
    if not rejected:
        return
    if on_error == "raise":
        raise DataError(list(rejected))
    for r in rejected:
        log.warning("data: skipped %s (data.on_error=skip)", r)
    rejected.clear()


def sequences(batch: dict, tokenizer, labelling, token_weights, loss, scale: float, on_error: str,
              scores_needed_by: list[str]):
    """The batched map of a stream: a batch of rows as labelled, weighed sequences (an Arrow table), as
    `tokenized_split` and `with_static_weights` make them (as columns of Python values: a stream's map takes no Arrow
    table); the rows the template refuses, over-long rows with
    `data.overlong=error` and rows without a needed score refused or skipped as there, by file and line."""
    import pyarrow as pa
    from datasets import Dataset

    from sft.data.splits.preprocess import CHECK_ONLY
    from sft.data.tokens.labels import tokenize_batch
    from sft.data.tokens.weights import missing_score_reason, with_static_weights

    files, lines = batch["source_file"], batch["source_line"]
    # each sequence's row, by its index in the batch: two files of a batch may share a line number
    indexed = {**{k: v for k, v in batch.items() if k != "source_file"}, "source_line": list(range(len(lines)))}
    table = tokenize_batch(indexed, tokenizer, labelling, token_weights, turn_weighted=True)
    rows = table.column("source_line").to_pylist()
    refused = table.column("refused").to_pylist()
    overlong = table.column("overlong").to_pylist()
    scores = table.column("difficulty_score").to_pylist()
    rejected, keep = [], []
    for i, k in enumerate(rows):
        problem = None
        if refused[i]:
            problem = tuple(refused[i].split("\t", 1))
        elif labelling.overlong == "error" and overlong[i]:
            problem = ("row", f"longer than data.max_length={labelling.max_length} tokens (data.overlong=truncate "
                              "or drop to accept it)")
        elif scores_needed_by and scores[i] != scores[i]:  # NaN: no score
            problem = ("difficulty_score", missing_score_reason(scores_needed_by))
        if problem is None:
            keep.append(i)
        elif not any(r.file == files[k] and r.line == lines[k] for r in rejected):
            rejected.append(Rejected(files[k], lines[k], problem[0], problem[1], ""))
    report(rejected, on_error)
    table = table.take(pa.array(keep, pa.int64()))
    rows = [rows[i] for i in keep]
    table = table.set_column(table.schema.get_field_index("source_line"), "source_line",
                             pa.array([lines[k] for k in rows], pa.int64()))
    if len(table):
        weighed = with_static_weights(Dataset(table), loss, files[rows[0]], scale)
        table = weighed.data.table
    return table.drop_columns([c for c in (*CHECK_ONLY, "truncated", "extra") if c in table.column_names]).to_pydict()


class Stream(torch.utils.data.IterableDataset):
    """One rank's stream of training sequences, each with `stream_state`: the stream's position after it.

    `load_state_dict(position)` continues at the sequence after that one (a resume); `datasets` reads past the rows
    before it without tokenising them (only the batch it was inside is tokenised again)."""

    def __init__(self, dataset):
        super().__init__()
        self.dataset = dataset

    def __iter__(self):
        for sequence in self.dataset:
            yield {**sequence, "stream_state": copy.deepcopy(self.dataset.state_dict())}

    def load_state_dict(self, position: dict) -> None:
        self.dataset.load_state_dict(position)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


def stream(parts, spec, tokenizer, loss, scores_needed_by: list[str], rank: int, world: int) -> Stream:
    """This rank's `Stream` of the train sources of `parts` (`sft.data.splits.mixture.Part`: one, or a mixture's)."""
    from datasets import IterableDataset, interleave_datasets
    from datasets.distributed import split_dataset_by_node

    from sft.data.rows.formats import RowFormat

    token_weights = loss.token_weights if loss is not None and loss.has_token_weights else None
    streams = []
    for number, part in enumerate(parts):
        files = stream_files(part.train)
        rows = IterableDataset.from_generator(raw_rows, gen_kwargs={
            "files": files, "default_score": spec.default_score, "row_format": RowFormat(part.format, part.columns),
            "train_on": str(spec.train_on), "on_error": str(spec.on_error)})
        mapped = rows.map(sequences, batched=True, batch_size=64, remove_columns=["messages", "tools", "source_file"],
                          fn_kwargs={"tokenizer": tokenizer, "labelling": spec.labelling(),
                                     "token_weights": token_weights, "loss": loss, "scale": part.loss_weight,
                                     "on_error": str(spec.on_error), "scores_needed_by": scores_needed_by})
        if spec.mixture:
            mapped = mapped.map(lambda b, n=number: {"source": [n] * len(b["source_line"])}, batched=True)
        streams.append(mapped)
    if len(streams) == 1:
        combined = streams[0]
    else:
        total = sum(p.ratio for p in parts)
        combined = interleave_datasets(streams, probabilities=[p.ratio / total for p in parts],
                                       seed=spec.mixture_seed, stopping_strategy="all_exhausted")
    # datasets splits by file where the files divide over the ranks, else gives each rank every world-th sequence
    how = "by file" if combined.n_shards % world == 0 else "every sequence to one rank in turn"
    if world > 1:
        combined = split_dataset_by_node(combined, rank=rank, world_size=world)
    log.info("data: streaming %s (%s over %d rank(s))", ", ".join(str(p.train) for p in parts), how, world)
    return Stream(combined)
