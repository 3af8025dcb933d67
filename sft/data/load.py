"""The data stage: validated, tokenised train and eval splits with the loss's static weights
(`load_sft_datasets`), from one source each or a mixture of several."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from sft import ranks
from sft.data.rows.formats import RowFormat
from sft.data.rows.reading import DataError, report_rejected, scan_source
from sft.data.rows.sources import SourceError
from sft.data.spec import DataSpec
from sft.data.splits.mixture import Part, draw_counts, drawn_sequences, log_mixture, parts_of
from sft.data.splits.preprocess import (SplitSummary, data_hash, log_template_profile, preprocessing_identity,
                                        reasoning_hint, tokenized_split)
from sft.data.tokens.columns import column, row_keys
from sft.data.tokens.weights import require_scores, scores_used_by, with_static_weights

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


@dataclass
class SFTData:
    train: datasets.Dataset
    eval: datasets.Dataset | None
    identity: dict  # what decides the data, part by part: sources' contents, settings, tokenizer (load_sft_datasets)
    spec: DataSpec  # what it was loaded from
    summary: dict[str, SplitSummary] = field(default_factory=dict)  # by split: train, eval
    parts: list[Part] = field(default_factory=list)  # the sources, by the rows' `source` number (sft.data.splits.mixture)

    @property
    def data_hash(self) -> str:
        return data_hash(self.identity)

    @property
    def tasks(self) -> dict[int, str]:
        """The task of each source that has one, by source number (a mixture's; none without one)."""
        return {i: p.task for i, p in enumerate(self.parts) if p.task is not None}

    @property
    def packing(self) -> bool:
        """How the collator forms batches (`data.packing`)."""
        return self.spec.packing

    def source_name(self, split: str, number: int = 0) -> str:
        """The train or eval source of a row's `source` number, as errors and reports name it."""
        return str(getattr(self.parts[number], split)) if self.parts else "?"

    def counts(self) -> str:
        """Rows and the sequences they became, per split (a multi-turn row a template rewrites trains as several):
        `train 300 rows -> 957 sequences, eval 97 rows -> 97 sequences`."""
        if not hasattr(self.train, "__len__"):  # a stream (data.streaming): counted as it trains
            return "train streamed" + (f", eval {self.summary['eval'].rows} rows -> {len(self.eval)} sequences"
                                       if self.eval is not None else "")
        splits = (("train", self.train), ("eval", self.eval if self.eval is not None else []))
        return ", ".join(f"{name} {self.summary[name].rows if name in self.summary else len(rows)} rows -> "
                         f"{len(rows)} sequences" for name, rows in splits)

    def eval_rows(self) -> list[dict]:
        """The eval rows that the run evaluates on (those kept: valid, labelled, with a score where the run needs
        one), as validation reads them (`sft.data.rows.reading.scan_source`): of the eval file, or of every eval source of
        a mixture, in its order."""
        kept = set(row_keys(self.eval)) if self.eval is not None else set()
        rows = []
        for number, part in enumerate(self.parts):
            if part.eval is not None:
                found, _ = scan_source(part.eval, self.spec.default_score, score_required=False,
                                       row_format=RowFormat(part.format, part.columns))
                rows += [r for r in found if (number, r["source_line"]) in kept]
        return rows


def load_sft_datasets(spec: DataSpec, tokenizer, loss=None, scores_needed_by: list[str] | None = None,
                      rejected_file: str | None = None) -> SFTData:
    """Validated, tokenised train and eval splits of the data `spec` describes (the `data` node, `DataSpec`), with
    the loss's static weights: each sequence's `sample_weight` (`loss.sample_weights`), per-token `token_weights`
    where the loss has them, and an `aux_<name>` value per row for each auxiliary term (`loss.aux`). `loss=None`
    weighs every row 1.

        load_sft_datasets(DataSpec(train_file="train.jsonl", max_length=1024), tokenizer, HardSampleLoss())
            ->  SFTData(train=<Dataset: input_ids, labels, sample_weight, ...>, eval=None, ...)

    `spec.on_error`: `raise` stops at the first bad rows with `DataError`; `skip` trains on the valid rows and
    reports the others (`report_rejected`, into `rejected_file`). `scores_needed_by`: what in the run uses
    `difficulty_score` (by default the loss, where it reads it: `loss.reads_difficulty_score`); a row without a
    score is refused only then. A mixture (`spec.mixture`) draws several sources into one training split
    (`sft.data.splits.mixture`), each row numbered by its source in a `source` column.
    """
    if scores_needed_by is None:
        scores_needed_by = scores_used_by(loss)
    log_template_profile(tokenizer, spec.labelling())
    token_weights = loss.token_weights if loss is not None and loss.has_token_weights else None
    train_on = str(spec.train_on)
    shared = {**preprocessing_identity(tokenizer, spec.max_length, spec.default_score),
              "overlong": str(spec.overlong), "rewritten_turns": str(spec.rewritten_turns),
              "prefill": str(spec.prefill)}
    if token_weights is not None:
        shared["token_weights"] = loss.token_weight_identity()
    from sft.data.splits.streaming import identity as stream_identity, stream, stream_files

    try:
        parts = parts_of(spec)
        if spec.mixture:
            sources = [p.identity(spec.streaming) for p in parts]  # each source's files hashed once
            identity = {**shared, "train_on": train_on, "mixture": sources, "mixture_seed": spec.mixture_seed}
        else:
            (part,) = parts
            identity = {"train_file": stream_identity(stream_files(part.train)) if spec.streaming
                        else part.train.fingerprint(),
                        "eval_file": None if part.eval is None else part.eval.fingerprint(), **shared}
            if (part.format, part.columns, train_on) != ("auto", {}, "all"):  # (else as before: earlier caches stand)
                identity.update(format=part.format, columns=dict(sorted(part.columns.items())), train_on=train_on)
    except SourceError as e:
        raise DataError([str(e)], header="the data cannot be read") from None

    splits, rejected, summaries = {"train": [], "eval": []}, [], {}
    for number, part in enumerate(parts):
        # the tokenised rows of a source are cached by what decides them, whatever mixture they are part of
        key = data_hash(identity) if not spec.mixture else data_hash(
            {**shared, "train_on": train_on, **{k: v for k, v in sources[number].items()
                                                if k in ("train_file", "eval_file", "format", "columns")}})
        for name in ("train", "eval"):
            source = getattr(part, name)
            if source is None or (name == "train" and spec.streaming):  # a stream is read as it trains
                continue
            ds, bad, summary = tokenized_split(source, spec, tokenizer, key, RowFormat(part.format, part.columns),
                                               token_weights, scores_needed_by)
            ds, unscored = require_scores(ds, source, scores_needed_by, str(spec.on_error))
            rejected += bad + unscored
            summary.rejected += len(unscored)
            if token_weights is not None and name == "train" and not summary.reweighted_tokens:
                log.warning("loss: its token weights leave every one of the %d trained tokens of %s at 1 (for "
                            "loss.phrases: no phrase occurs in an assistant turn)", summary.trained_tokens, source)
            if summary.untrained_reasoning:
                log.warning("data: %s: %d trained assistant turn(s) have reasoning that the chat template does not "
                            "render: their reasoning is not trained (%s)", source, summary.untrained_reasoning,
                            reasoning_hint(tokenizer))
            summaries[name] = summary if name not in summaries else summaries[name] + summary
            ds = with_static_weights(ds, loss, str(source), part.loss_weight)
            splits[name].append(ds if not spec.mixture else _numbered(ds, number))
    report_rejected(rejected, rejected_file)
    evaluation = (splits["eval"] or [None])[0] if not spec.mixture else _concatenated(splits["eval"])
    if spec.streaming:
        import os

        world = int(os.environ.get("WORLD_SIZE", "1"))
        train = stream(parts, spec, tokenizer, loss, scores_needed_by, ranks.rank(), world)
    else:
        train = splits["train"][0] if not spec.mixture else _mixed(parts, splits["train"], spec.mixture_seed)
    return SFTData(train=train, eval=evaluation, identity=identity, spec=spec, summary=summaries, parts=parts)


def _numbered(ds: datasets.Dataset, number: int) -> datasets.Dataset:
    """The split with its source's number in a `source` column."""
    fingerprint = hashlib.sha256(f"{ds._fingerprint}-source-{number}".encode()).hexdigest()[:16]
    return ds.add_column("source", [number] * len(ds), new_fingerprint=fingerprint)


def _mixed(parts: list[Part], splits: list[datasets.Dataset], seed: int) -> datasets.Dataset:
    """The training split of a mixture: each source's rows drawn as its ratio or epochs say (`sft.data.splits.mixture`)."""
    lines = [np.asarray(column(ds, "source_line")) for ds in splits]
    sizes = [len(np.unique(x)) for x in lines]
    counts = draw_counts(sizes, [p.ratio for p in parts], [p.epochs for p in parts])
    for i, (part, count) in enumerate(zip(parts, counts)):
        if count == 0:
            raise DataError([f"data.mixture[{i}] ({part.name}): its share draws no row of its {sizes[i]} (raise its "
                             "ratio or epochs)"], header="the mixture cannot be drawn")
    log_mixture(parts, sizes, counts)
    drawn = [ds.select(drawn_sequences(x, count, np.random.default_rng([seed, i])))
             for i, (ds, x, count) in enumerate(zip(splits, lines, counts))]
    return _concatenated(drawn)


def _concatenated(splits: list[datasets.Dataset]) -> datasets.Dataset | None:
    """Splits of several sources as one; `token_weights` of 1 where a source has none and another has them; the
    columns all have (a source cached by an older version may lack one), of the first's types."""
    from datasets import concatenate_datasets

    if not splits:
        return None
    if any("token_weights" in ds.column_names for ds in splits):
        splits = [ds if "token_weights" in ds.column_names else ds.map(
            lambda b: {"token_weights": [np.ones(len(ids), dtype=np.float32) for ids in b["input_ids"]]},
            batched=True, keep_in_memory=True) for ds in splits]
    common = [c for c in splits[0].column_names if all(c in ds.column_names for ds in splits)]
    splits = [ds.select_columns(common) for ds in splits]
    splits = [ds if ds.features == splits[0].features else ds.cast(splits[0].features) for ds in splits]
    return concatenate_datasets(splits) if len(splits) > 1 else splits[0]
