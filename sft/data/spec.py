"""The data stage's config: `DataSpec`, the `data` node, passed whole to `sft.data.load.load_sft_datasets`; the
files' columns (`ColumnsConfig`), a mixture's sources (`MixtureSourceConfig`), the labelling knobs
(`Labelling`, what `sft.data.tokens.labels.tokenize_batch` and `sft.data.chat.turns.chat_views` take) and the collator's
(`CollatorConfig`). Imports nothing heavy: the config is composed and checked before anything is built.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from sft.config.schema import Choice, ConfigError, Schema, config_schema, knob
from sft.data.rows.formats import FORMATS

Format = Choice("Format", [(f, f) for f in FORMATS])


OnError = Choice("OnError", [("raise", "raise"), ("skip", "skip")])  # (`raise` is a keyword: no class body)


class Overlong(Choice):
    truncate = "truncate"
    drop = "drop"
    error = "error"


class RewrittenTurns(Choice):
    split = "split"
    skip = "skip"
    refuse = "refuse"


class Prefill(Choice):
    refuse = "refuse"
    after = "after"
    drop = "drop"


class TrainOn(Choice):
    all = "all"
    last = "last"


TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # it becomes part of metric names: eval_ce_task_<name>


@dataclass(frozen=True)
class Labelling:
    """How a chat's texts become labelled tokens (see `DataSpec` for each knob)."""

    max_length: int = 2048
    overlong: str = "truncate"
    rewritten_turns: str = "split"
    prefill: str = "refuse"


@dataclass
class ColumnsConfig(Schema):
    """The file's column for a field of its format (`sft.data.rows.formats.FIELDS`) where the names differ: null is the
    field's own name (`score`: `difficulty_score`). `data.columns.messages=convs data.columns.score=difficulty`.
    `system` and `tools` are columns of every format; `prompt`, `query` and `response` also name Alpaca's
    instruction, input and output (LLaMA-Factory's dataset_info.json names)."""

    messages: Optional[str] = knob(None, "the messages format's column of {role, content} turns")
    conversations: Optional[str] = knob(None, "ShareGPT's column of {from, value} turns")
    instruction: Optional[str] = knob(None, "Alpaca's instruction (the user turn)")
    input: Optional[str] = knob(None, "Alpaca's input, joined to the instruction by a blank line")
    output: Optional[str] = knob(None, "Alpaca's output (the answer)")
    system: Optional[str] = knob(None, "the system prompt, a column of every format")
    history: Optional[str] = knob(None, "Alpaca's earlier [instruction, answer] pairs")
    prompt: Optional[str] = knob(None, "prompt_completion's prompt (Alpaca's instruction, by LLaMA-Factory's name)")
    completion: Optional[str] = knob(None, "prompt_completion's completion")
    score: Optional[str] = knob(None, "the difficulty score (null: difficulty_score)")
    tools: Optional[str] = knob(None, "the tool definitions, a column of every format")
    query: Optional[str] = knob(None, "Alpaca's input, by LLaMA-Factory's name")
    response: Optional[str] = knob(None, "Alpaca's output, by LLaMA-Factory's name")


@dataclass
class MixtureSourceConfig(Schema):
    """One source of a multi-task mixture (`data.mixture`): its files, how it is read, how much of it is drawn,
    its task and the task's loss weight. A null field is the `data` node's (format, columns, splits, hub)."""

    train_file: str = knob(MISSING, "a source as data.train_file takes it (file, glob, save_to_disk folder, hub:<id>)")
    eval_file: Optional[str] = knob(None, "its eval rows: eval_loss_task_<task>, eval_ce_task_<task>")
    task: Optional[str] = knob(None, "the name in the eval metrics; null: the source is in no task metric")
    ratio: Optional[float] = knob(None, "its share of the mixture's rows (normalised over the sources; the mixture "
                                  "has as many rows as its sources together); every source a ratio, or epochs")
    epochs: Optional[float] = knob(None, "times its rows are drawn (2: each twice; 0.5: half of them, at random)")
    loss_weight: float = knob(1.0, "multiplies the sample weight of the source's rows (training and evaluation)")
    format: Optional[Format] = knob(None, "its row format; null: data.format")
    columns: ColumnsConfig = knob(help="its columns, over data.columns", factory=ColumnsConfig)
    train_split: Optional[str] = knob(None, "null: data.train_split")
    eval_split: Optional[str] = knob(None, "null: data.eval_split")
    hub_name: Optional[str] = knob(None, "null: data.hub_name")
    hub_revision: Optional[str] = knob(None, "null: data.hub_revision")

    def check(self, cfg=None):
        self.require("ratio", self.ratio is None or self.epochs is None, "give ratio or epochs, not both")
        self.require("ratio", self.ratio is None or (math.isfinite(self.ratio) and self.ratio > 0),
                     "must be a finite number > 0")
        self.require("epochs", self.epochs is None or (math.isfinite(self.epochs) and self.epochs > 0),
                     "must be a finite number > 0")
        self.require("loss_weight", math.isfinite(self.loss_weight) and self.loss_weight >= 0,
                     "must be a finite number >= 0")
        self.require("task", self.task is None or bool(TASK_NAME.match(self.task)),
                     "must be letters, digits, _ . - (it names metrics: eval_ce_task_<task>)")
        self.require("eval_file", self.eval_file is None or self.task is not None,
                     "needs a task name (its eval rows are reported as eval_loss_task_<task>)")
        for key in ("train_file", "eval_file"):
            _check_source(self, key)


def _check_source(node: Schema, key: str) -> None:
    """`node.<key>` names a source that exists (`sft.data.rows.sources.Source`: a file, glob, folder or hub id)."""
    from sft.data.rows.sources import Source, SourceError

    path = getattr(node, key)
    if path is None:
        return
    try:
        source = Source(path)
    except SourceError as e:
        raise ConfigError(key, path, str(e).split(": ", 1)[-1]) from None
    node.require(key, source.kind in ("hub", "disk") or all(os.path.isfile(f) for f in source.files), "no such file")


@config_schema("data", "data")
@dataclass
class DataSpec(Schema):
    """The data: its sources, how their rows are read and labelled, and how much of each is drawn."""

    _target_: str = "sft.data.spec.DataSpec"
    train_file: Optional[str] = knob(MISSING, "the source to train on: a .jsonl/.json/.parquet/.csv/.arrow file, "
                                     "a glob, a save_to_disk folder or hub:<dataset id>; null with a mixture")
    eval_file: Optional[str] = knob(None, "the source to evaluate on (null: no evaluation)")
    max_length: int = knob(2048, "tokens a sequence may have (see overlong)")
    default_score: Optional[float] = knob(None, "the difficulty_score of rows without one (null: none; where the "
                                          "run uses scores such rows are refused)")
    num_proc: Optional[int] = knob(None, "tokenising processes; null: all cores (<= 8) from 20k rows on, else 1")
    on_error: OnError = knob(OnError["raise"], "raise: stop at bad rows, naming them | skip: train on the valid "
                             "rows, the others counted and written to rejected.jsonl in the run dir")
    overlong: Overlong = knob(Overlong.truncate, "a row over max_length: truncate (the prompt cut from the left "
                              "first) | drop | error")
    packing: bool = knob(False, "each micro-batch as one row without padding (position_ids restart per sample)")
    rewritten_turns: RewrittenTurns = knob(RewrittenTurns.split, "a turn the chat template renders otherwise once "
                                           "later turns follow (Qwen3 drops earlier reasoning): split (trained from "
                                           "the chat up to it, a sequence of its own) | skip (untrained) | refuse")
    prefill: Prefill = knob(Prefill.refuse, "a generation prompt that prefills what an answer does not begin with "
                            "(<think>\\n of DeepSeek-R1 distills, QwQ): refuse (the row, naming it) | after (train the "
                            "answer after the prefill, as the model answers) | drop (as the template renders it)")
    format: Format = knob(Format.auto, "the files' row format (sft.data.rows.formats): auto (from the first row's "
                          "columns) | messages | sharegpt | alpaca | prompt_completion")
    columns: ColumnsConfig = knob(help="the file's column for a format's field: data.columns.score=difficulty",
                                  factory=ColumnsConfig)
    train_on: TrainOn = knob(TrainOn.all, "all assistant turns | last (the last assistant turn of each chat only)")
    train_split: str = knob("train", "the split of a hub dataset or a DatasetDict folder to train on")
    eval_split: str = knob("test", "the split to evaluate on")
    hub_name: Optional[str] = knob(None, "the hub dataset's config name")
    hub_revision: Optional[str] = knob(None, "a commit, tag or branch of the hub dataset: pin it for a reproducible "
                                       "run")
    mixture: List[MixtureSourceConfig] = knob(help="several sources in place of train_file/eval_file "
                                              "(sft.data.splits.mixture), each with its own format, columns, share, task "
                                              "and loss weight", factory=list)
    mixture_seed: int = knob(0, "seeds the mixture's draw")
    streaming: bool = knob(False, "read the train rows as they are trained (local .jsonl/.parquet files of any size, "
                           "sft.data.splits.streaming): in file order, split over the ranks by file; needs trainer.max_steps")

    def labelling(self) -> Labelling:
        return Labelling(self.max_length, str(self.overlong), str(self.rewritten_turns), str(self.prefill))

    def check(self, cfg=None):
        self.require("max_length", self.max_length >= 8, "must be >= 8")
        self.require("num_proc", self.num_proc is None or self.num_proc >= 1, "must be >= 1 (or null: as many as "
                     "the rows need, up to the cores)")
        self.require("default_score", self.default_score is None or self.default_score >= 0, "must be >= 0")
        if self.streaming:
            self._check_streaming(cfg)
        if self.mixture:
            self._check_mixture(cfg)
            return
        self.require("train_file", self.train_file is not None, "missing: a source to train on (or data.mixture)")
        for key in ("train_file", "eval_file"):
            _check_source(self, key)

    def _check_streaming(self, cfg) -> None:
        """What a stream cannot do: know its size (mixture epochs, a run of epochs), or be sampled out of order."""
        self.require("streaming", all(e.get("epochs") is None for e in self.mixture),
                     "a stream has no size to count epochs of: give each mixture source a ratio")
        if cfg is None:
            return
        self.require("streaming", cfg.trainer.max_steps > 0, "a stream has no length: set trainer.max_steps (the "
                     "stream starts again from its first row when it ends)")
        self.require("streaming", cfg.sp is None, "sequence parallelism gives a group's ranks the same rows from a "
                     "map-style split: not with a stream")

    def _check_mixture(self, cfg) -> None:
        for key in ("train_file", "eval_file"):
            self.require(key, getattr(self, key) is None, "must be null with data.mixture (each source of the "
                         f"mixture names its own {key})")
        tasks = set()
        for i, entry in enumerate(self.mixture):
            try:
                if isinstance(entry, DictConfig) and OmegaConf.is_missing(entry, "train_file"):
                    raise ConfigError("train_file", None, "missing: every source of a mixture names its train_file")
                entry = entry if isinstance(entry, MixtureSourceConfig) else MixtureSourceConfig(**entry)
                entry.check(cfg)
                if entry.task is not None:
                    entry.require("task", entry.task not in tasks, "names another source's task too: task "
                                  "names are unique in a mixture")
                    tasks.add(entry.task)
            except ConfigError as e:
                raise e.within(f"mixture[{i}]") from None
        shares = {"ratio" if e.ratio is not None else "epochs" for e in self.mixture}
        if len(shares) > 1:
            raise ConfigError("mixture", None, "mixes ratio and epochs: give every source a ratio (shares of the "
                              "mixture), or every source its epochs (null ratio and epochs: epochs 1)")


@dataclass
class CollatorConfig(Schema):
    """The collator (`sft.data.tokens.collator.WeightedDataCollator`)."""

    _target_: str = "sft.data.tokens.collator.WeightedDataCollator"
    pad_to_multiple_of: Optional[int] = knob(None, "pad padded batches to a multiple of it (8 or 64 on a GPU)")
    packing: bool = knob("${data.packing}",  # type: ignore[arg-type]
                         "each micro-batch as one packed row (data.packing)")

    def check(self, cfg=None):
        self.require("pad_to_multiple_of", self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1,
                     "must be >= 1")
