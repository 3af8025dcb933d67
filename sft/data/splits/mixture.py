"""Multi-task mixtures (`data.mixture`): the training split drawn from several sources, each with its own
format and columns, share, task name and loss weight.

A source's share is a `ratio` (its share of the mixture's rows, normalised over the sources; the mixture has
as many rows as its sources together) or `epochs` (times its own rows). Rows are drawn whole (every sequence
of a row, `sft.data.chat.turns.chat_views`): `count // rows` copies of every row, then a seeded draw without repeats of
the remaining `count % rows`. The draw is made once, for the whole run (Trainer then shuffles it each epoch).

    sources of 1,000 and 200 rows, ratio 1 and 1  ->  600 rows each: 600 of the first's (drawn at random),
                                                      the second's 200 rows 3 times
    the same with epochs 1 and 2                  ->  the first's 1,000 rows, the second's 200 rows twice

Each source's rows carry its index in the `source` column; evaluation reports `eval_loss_task_<task>` and
`eval_ce_task_<task>` over the eval rows of a source with a task (`sft.training.trainer`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from sft.data.rows.sources import Source
from sft.data.spec import ColumnsConfig, DataSpec, MixtureSourceConfig

log = logging.getLogger(__name__)


@dataclass
class Part:
    """One source of a run's data (a mixture's entry, or the whole data of a run without one): its train and
    eval sources, how they are read, and what the mixture makes of it."""

    train: Source | None
    eval: Source | None = None
    format: str = "auto"
    columns: dict = field(default_factory=dict)
    task: str | None = None
    loss_weight: float = 1.0
    ratio: float | None = None
    epochs: float | None = None

    @property
    def name(self) -> str:
        """How logs name it: the task, else the train source."""
        return self.task or str(self.train)

    def identity(self, streamed: bool = False) -> dict:
        """What decides this part's rows in the mixture (in the data hash: a resume refuses a changed one);
        `streamed` train files by path, size and time (`sft.data.splits.streaming.identity`), not read."""
        from sft.data.splits.streaming import identity, stream_files

        out = {"train_file": identity(stream_files(self.train)) if streamed else self.train.fingerprint(),
               "eval_file": None if self.eval is None else self.eval.fingerprint(),
               "format": self.format, "columns": dict(sorted(self.columns.items())), "task": self.task,
               "loss_weight": self.loss_weight, "ratio": self.ratio, "epochs": self.epochs}
        for source, split in ((self.train, "train"), (self.eval, "eval")):
            if source is not None and source.kind in ("hub", "disk"):
                out[f"{split}_split"] = [source.split, source.hub_name, source.hub_revision]
        return out


def parts_of(spec: DataSpec) -> list[Part]:
    """A run's sources as parts: `train_file`/`eval_file` as one, or else the `data.mixture` entries, where a
    null field is the data node's (format, splits, hub) and the entry's named columns go over `data.columns`."""
    columns = named_columns(spec.columns)
    hub = (spec.hub_name, spec.hub_revision)
    if not spec.mixture:
        return [Part(Source(spec.train_file, spec.train_split, *hub),
                     None if spec.eval_file is None else Source(spec.eval_file, spec.eval_split, *hub),
                     str(spec.format), columns)]
    parts = []
    for entry in spec.mixture:
        entry = entry if isinstance(entry, MixtureSourceConfig) else MixtureSourceConfig(**entry)
        own_hub = (entry.hub_name or spec.hub_name, entry.hub_revision or spec.hub_revision)
        parts.append(Part(
            train=Source(entry.train_file, entry.train_split or spec.train_split, *own_hub),
            eval=None if entry.eval_file is None else Source(entry.eval_file, entry.eval_split or spec.eval_split,
                                                             *own_hub),
            format=str(entry.format or spec.format), columns={**columns, **named_columns(entry.columns)},
            task=entry.task, loss_weight=float(entry.loss_weight), ratio=entry.ratio, epochs=entry.epochs))
    return parts


def named_columns(columns) -> dict[str, str]:
    """The fields a `ColumnsConfig` (or a dict of one's fields) maps to a column of another name."""
    items = vars(columns).items() if isinstance(columns, ColumnsConfig) else dict(columns or {}).items()
    return {k: v for k, v in items if v is not None}


def draw_counts(sizes: list[int], ratios: list[float | None], epochs: list[float | None]) -> list[int]:
    """How many rows each source gives the mixture: by ratio (shares of the sources' total rows), else by
    epochs (null: 1).

        sizes [1000, 200], ratios [1, 1]             ->  [600, 600]
        sizes [1000, 200], epochs [None, 2.5]        ->  [1000, 500]
    """
    if any(r is not None for r in ratios):
        total, shares = sum(sizes), sum(ratios)
        return [int(round(total * r / shares)) for r in ratios]
    return [int(round(n * (1.0 if e is None else e))) for n, e in zip(sizes, epochs)]


def draw(n_rows: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` row numbers (0-based) out of `n_rows`: every row `count // n_rows` times, then `count % n_rows`
    rows drawn without repeats, in row order.

        draw(4, 10, rng)  ->  [0 1 2 3 0 1 2 3 1 3]  (the last two drawn)
    """
    copies, rest = divmod(count, n_rows)
    return np.concatenate([np.tile(np.arange(n_rows), copies),
                           np.sort(rng.choice(n_rows, size=rest, replace=False))]).astype(np.int64)


def drawn_sequences(lines: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """The sequence indices of `count` rows drawn from a tokenised split whose sequences belong to the rows
    `lines` (a row's sequences, its `chat_views`, are drawn together).

        lines [1, 1, 2, 5], count 3  ->  rows 1, 2, 5 once each: [0, 1, 2, 3] (in some order of rows)
    """
    order = np.argsort(lines, kind="stable")  # the sequences grouped by row, rows ascending
    _, starts, sizes = np.unique(lines[order], return_index=True, return_counts=True)
    picked = draw(len(starts), count, rng)
    lengths = sizes[picked]
    offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return order[np.repeat(starts[picked], lengths) + offsets]


def log_mixture(parts: list[Part], sizes: list[int], counts: list[int]) -> None:
    """One line per source: its rows, how often they are drawn, its share of the mixture."""
    total = max(sum(counts), 1)
    for part, n, count in zip(parts, sizes, counts):
        log.info("data.mixture: %s: %d rows x%.3g -> %d (%.1f%% of the mixture)%s", part.name, n, count / max(n, 1),
                 count, 100 * count / total, "" if part.loss_weight == 1 else f", loss weight {part.loss_weight:g}")
