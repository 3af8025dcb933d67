"""The structured config: one dataclass schema per config group, each checking its own values.

Hydra rejects an unknown key or a wrongly typed value at composition, naming it. `check` then walks the
composed config and lets every node's schema validate its values (`Schema.check`: ranges, files, rules
that span nodes) before anything heavy is built, raising `ConfigError`, which the entrypoint turns
into a one-line message and exit code 2. A node built from a class with no schema here (your own
controller, loss or clip policy) is checked against that class's signature instead.

Each default is stated once, here: the YAML options of `conf/` carry only what differs, and the
classes that a schema builds (`_target_`) extend it, so `ZClip()` has ZClip's defaults and checks.

This module imports neither torch nor transformers so that `--cfg job` and `--help` answer at once.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from sft import sample_data
from sft.config.trainer_fields import TrainingArgumentsFields

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")  # the repo's conf/ (editable install)


class ConfigError(ValueError):
    """A config value that cannot work; `str()` names the field and the bad value."""

    def __init__(self, key: str, value: Any, reason: str):
        super().__init__(f"{key}={value!r}: {reason}" if value is not None else f"{key}: {reason}")
        self.key, self.value, self.reason = key, value, reason

    def within(self, path: str) -> ConfigError:
        """The same error with its key placed under the node at `path` (`clip` + `max_norm`)."""
        return ConfigError(f"{path}.{self.key}" if self.key else path, self.value, self.reason)


def learned_state(obj) -> dict:
    """What a stateful part (clip policy, controller) carries into a checkpoint: its public attributes
    that are not the knobs of its schema (the dataclass fields). On resume the knobs come from the run's
    config, so that a changed setting is applied, never overwritten by the checkpoint's."""
    knobs = _knobs(obj)
    return {k: v for k, v in vars(obj).items() if not k.startswith("_") and k not in knobs}


def restore_learned_state(obj, state: dict) -> None:
    """Set what `learned_state` saved; knob values in `state` (checkpoints of older versions) are ignored."""
    knobs = _knobs(obj)
    vars(obj).update({k: v for k, v in state.items() if k not in knobs})


def _knobs(obj) -> set[str]:
    """The knobs of a stateful part: its schema's fields (none for a class without a schema)."""
    return {f.name for f in fields(obj)} if is_dataclass(obj) else set()


class Schema:
    """Base of every schema: `check` validates the node's values; `require` names the failing field."""

    def check(self, cfg: DictConfig | None = None) -> None:
        """Raise `ConfigError` for the first bad value. `cfg` is the whole config, for rules that span
        nodes; None where the class is built directly in Python (those rules are then skipped)."""

    def require(self, key: str, ok: bool, reason: str) -> None:
        if not ok:
            raise ConfigError(key, getattr(self, key) if key else None, reason)


# --- model, tokenizer, data, collator -----------------------------------------------------------------


@dataclass
class ModelConfig(Schema):
    _target_: str = "sft.model.loading.load_model"
    name_or_path: str = "tiny"
    dtype: str = "float32"
    attn_implementation: Optional[str] = "sdpa"
    trust_remote_code: bool = False
    quantization: Optional[str] = None  # nf4: 4-bit base for QLoRA (bitsandbytes, CUDA only)
    # A transformers config: this architecture, random weights; empty: load name_or_path's weights. Not null by
    # default: OmegaConf cannot merge a dict from the command line into a null node (an AttributeError).
    random_init: Dict[str, Any] = field(default_factory=dict)
    # Fields of the checkpoint's config to change, e.g. +model.config_overrides.output_router_logits=true
    config_overrides: Dict[str, Any] = field(default_factory=dict)

    def check(self, cfg=None):
        self.require("dtype", self.dtype in ("float32", "bfloat16", "float16"), "must be float32, bfloat16 or float16")
        self.require("quantization", self.quantization in (None, "nf4"), "must be null or nf4")
        if self.quantization is not None and cfg is not None:
            self.require("quantization", cfg.lora is not None, "a quantized base trains only with LoRA (lora=qlora)")
            self.require("quantization", _cuda_available(),
                         "4-bit QLoRA needs a CUDA GPU (bitsandbytes); this machine has none: use lora=default")
            self.require("quantization", _installed("bitsandbytes"), "needs bitsandbytes: pip install bitsandbytes")


@dataclass
class TokenizerConfig(Schema):
    _target_: str = "sft.model.loading.load_tokenizer"
    name_or_path: str = "${model.name_or_path}"
    chat_template: Optional[str] = None
    trust_remote_code: bool = "${model.trust_remote_code}"  # type: ignore[assignment]
    # Keyword arguments the chat template is rendered with, in training and generation (in the data hash):
    # +tokenizer.chat_template_kwargs.enable_thinking=false, ...thinking=true (DeepSeek-V3.1), ...reasoning_effort=low
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # The tokens an answer ends at (each one token of the vocabulary); empty: the model's own, the eos ids of its
    # generation_config.json and the tokenizer's eos_token. 'tokenizer.stop_tokens=["<|im_end|>"]'
    stop_tokens: List[str] = field(default_factory=list)


@dataclass
class ColumnsConfig(Schema):
    """The file's column for a field of its format (`sft.data.formats.FIELDS`) where the names differ: null is the
    field's own name (`score`: `difficulty_score`). `data.columns.messages=convs data.columns.score=difficulty`.
    `system` and `tools` are columns of every format; `prompt`, `query` and `response` also name Alpaca's
    instruction, input and output (LLaMA-Factory's dataset_info.json names)."""

    messages: Optional[str] = None
    conversations: Optional[str] = None
    instruction: Optional[str] = None
    input: Optional[str] = None
    output: Optional[str] = None
    system: Optional[str] = None
    history: Optional[str] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None
    score: Optional[str] = None
    tools: Optional[str] = None
    query: Optional[str] = None
    response: Optional[str] = None


TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # it becomes part of metric names: eval_ce_task_<name>


@dataclass
class MixtureSourceConfig(Schema):
    """One source of a multi-task mixture (`data.mixture`): its files, how it is read, how much of it is drawn,
    its task and the task's loss weight. A null field is the `data` node's (format, columns, splits, hub)."""

    train_file: str = MISSING  # a source as data.train_file takes it (file, glob, save_to_disk folder, hub:<id>)
    eval_file: Optional[str] = None  # its eval rows: eval_loss_task_<task>, eval_ce_task_<task>
    task: Optional[str] = None  # the name in the eval metrics; null: the source is in no task metric
    # How much of it the mixture draws, one of the two (every source of a mixture the same one):
    # ratio: its share of the mixture's rows (normalised over the sources; the mixture has as many rows as
    # its sources together); epochs: times its rows (2: each row twice; 0.5: half of them, drawn at random)
    ratio: Optional[float] = None
    epochs: Optional[float] = None
    loss_weight: float = 1.0  # multiplies the sample weight of the source's rows (training and evaluation)
    format: Optional[str] = None  # null: data.format
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)  # over data.columns
    train_split: Optional[str] = None
    eval_split: Optional[str] = None
    hub_name: Optional[str] = None
    hub_revision: Optional[str] = None

    def check(self, cfg=None):
        from sft.data.formats import FORMATS

        self.require("ratio", self.ratio is None or self.epochs is None, "give ratio or epochs, not both")
        self.require("ratio", self.ratio is None or (math.isfinite(self.ratio) and self.ratio > 0),
                     "must be a finite number > 0")
        self.require("epochs", self.epochs is None or (math.isfinite(self.epochs) and self.epochs > 0),
                     "must be a finite number > 0")
        self.require("loss_weight", math.isfinite(self.loss_weight) and self.loss_weight >= 0,
                     "must be a finite number >= 0")
        self.require("task", self.task is None or bool(TASK_NAME.match(self.task)),
                     "must be letters, digits, _ . - (it names metrics: eval_ce_task_<task>)")
        self.require("format", self.format is None or self.format in FORMATS, f"must be one of {', '.join(FORMATS)}")
        self.require("eval_file", self.eval_file is None or self.task is not None,
                     "needs a task name (its eval rows are reported as eval_loss_task_<task>)")
        for key in ("train_file", "eval_file"):
            _check_source(self, key)


def _check_source(node: Schema, key: str) -> None:
    """`node.<key>` names a source that exists (`sft.data.sources.Source`: a file, glob, folder or hub id)."""
    from sft.data.sources import Source, SourceError

    path = getattr(node, key)
    if path is None:
        return
    try:
        source = Source(path)
    except SourceError as e:
        raise ConfigError(key, path, str(e).split(": ", 1)[-1]) from None
    node.require(key, source.kind in ("hub", "disk") or all(os.path.isfile(f) for f in source.files), "no such file")


@dataclass
class DataConfig(Schema):
    _target_: str = "sft.data.load.load_sft_datasets"
    train_file: Optional[str] = MISSING  # null with a mixture
    eval_file: Optional[str] = None
    max_length: int = 2048
    default_score: Optional[float] = None
    num_proc: Optional[int] = None  # tokenising processes; null: all cores (<= 8) from 20k rows on, else 1
    on_error: str = "raise"  # raise | skip (train on the valid rows, write rejected.jsonl in the run dir)
    overlong: str = "truncate"  # truncate (prompt cut from the left first) | drop | error
    packing: bool = False  # each micro-batch as one row without padding (position_ids restart per sample)
    # A turn the chat template renders differently once later turns follow (Qwen3 drops earlier reasoning):
    # split (trained from the chat up to it, a sequence of its own) | skip (left untrained) | refuse (row refused)
    rewritten_turns: str = "split"
    # A generation prompt that prefills what an answer does not begin with (<think>\n of DeepSeek-R1 distills and
    # QwQ, an empty thinking block): refuse (the row, naming it) | after (train the answer after the prefill, as the
    # model answers: a sequence of its own per turn) | drop (train the answer as the template renders it)
    prefill: str = "refuse"
    # The files' row format (sft.data.formats): auto (from the first row's columns) | messages | sharegpt | alpaca |
    # prompt_completion; columns maps a format's field to the file's: data.columns.score=difficulty
    format: str = "auto"
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    train_on: str = "all"  # all assistant turns | last (the last assistant turn of each chat only)
    # Sources (sft.data.sources): train_file/eval_file may also be .json/.parquet/.csv/.arrow files, globs, a
    # save_to_disk folder or hub:<dataset id>; the splits of hub datasets and DatasetDict folders
    train_split: str = "train"
    eval_split: str = "test"
    hub_name: Optional[str] = None  # the hub dataset's config name
    hub_revision: Optional[str] = None  # a commit, tag or branch: pin it for a reproducible run
    # Multi-task fine-tuning: several sources in place of train_file/eval_file (sft.data.mixture), each with its
    # own format, columns, share (ratio or epochs), task name and loss weight; the draw is seeded by mixture_seed
    mixture: List[MixtureSourceConfig] = field(default_factory=list)
    mixture_seed: int = 0

    def check(self, cfg=None):
        from sft.data.formats import FORMATS

        self.require("format", self.format in FORMATS, f"must be one of {', '.join(FORMATS)}")
        self.require("train_on", self.train_on in ("all", "last"), "must be all or last")
        self.require("max_length", self.max_length >= 8, "must be >= 8")
        self.require("on_error", self.on_error in ("raise", "skip"), "must be raise or skip")
        self.require("overlong", self.overlong in ("truncate", "drop", "error"), "must be truncate, drop or error")
        self.require("rewritten_turns", self.rewritten_turns in ("split", "skip", "refuse"),
                     "must be split, skip or refuse")
        self.require("prefill", self.prefill in ("refuse", "after", "drop"), "must be refuse, after or drop")
        self.require("default_score", self.default_score is None or self.default_score >= 0, "must be >= 0")
        if self.mixture:
            self._check_mixture(cfg)
            return
        self.require("train_file", self.train_file is not None, "missing: a source to train on (or data.mixture)")
        for key in ("train_file", "eval_file"):
            _check_source(self, key)

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
    _target_: str = "sft.data.collator.WeightedDataCollator"
    pad_to_multiple_of: Optional[int] = None  # padded batches only; 8 or 64 on GPU
    packing: bool = "${data.packing}"  # type: ignore[assignment]

    def check(self, cfg=None):
        self.require("pad_to_multiple_of", self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1,
                     "must be >= 1")


# --- losses (built as sft.losses.*, which extend these) -----------------------------------------------

NORMALIZE_MODES = ("weight", "token", "sample")
LOSS_IMPLS = ("auto", "naive", "chunked", "liger", "cce")  # see sft.loss.kernels.choose_impl


@dataclass(kw_only=True)
class LossConfig(Schema):
    """What every weighted token loss has (`sft.loss.base.WeightedTokenLoss`): the difficulty weight of each
    sample, how the step's sum is normalised, how the cross entropy is computed, auxiliary terms."""

    _target_: str = MISSING
    # Difficulty weight w = clamp(difficulty_score ** alpha, min_weight, max_weight); alpha=0: every sample 1
    alpha: float = 0.0
    min_weight: float = 0.0
    max_weight: float = 100.0
    normalize: str = "weight"  # weight: sum(w*ce)/sum(w) | token: sum(w*ce)/#tokens | sample: mean of per-sample means
    impl: str = "auto"  # auto | naive | chunked | liger | cce (see sft/losses.py)
    chunk_tokens: int = 1024  # chunked: assistant tokens per chunk of logits
    # name -> an auxiliary term (`_target_` + its knobs, e.g. coef), `sft.loss.auxiliary.AuxTerm`; logged as aux/<name>
    aux: Dict[str, Any] = field(default_factory=dict)

    def check(self, cfg=None):
        self.require("impl", self.impl in LOSS_IMPLS, f"must be one of {', '.join(LOSS_IMPLS)}")
        self.require("chunk_tokens", self.chunk_tokens >= 1, "must be >= 1")
        self.require("normalize", self.normalize in NORMALIZE_MODES, f"must be one of {', '.join(NORMALIZE_MODES)}")
        self.require("alpha", math.isfinite(self.alpha), "must be a finite number")
        self.require("min_weight", self.min_weight >= 0, "must be >= 0")
        self.require("max_weight", 0 < self.max_weight < math.inf, "must be finite and > 0")
        self.require("min_weight", self.min_weight <= self.max_weight,
                     f"must be <= loss.max_weight ({self.max_weight})")


@dataclass(kw_only=True)
class CrossEntropyLossConfig(LossConfig):
    _target_: str = "sft.loss.builtin.CrossEntropyLoss"


@dataclass(kw_only=True)
class HardSampleLossConfig(LossConfig):
    _target_: str = "sft.loss.builtin.HardSampleLoss"
    alpha: float = 1.0


@dataclass(kw_only=True)
class KeywordLossConfig(LossConfig):
    _target_: str = "sft.loss.builtin.KeywordLoss"
    phrases: List[str] = field(default_factory=list)  # assistant tokens overlapping one get weight x factor
    phrases_file: Optional[str] = None  # more phrases, one a line (blank lines and lines starting with # skipped)
    factor: float = 3.0
    case_fold: bool = True  # match phrases whatever their case
    whole_words: bool = True  # a phrase matches only where it is not part of a longer word
    regex: bool = False  # phrases are Python regular expressions

    def check(self, cfg=None):
        super().check(cfg)
        if self.regex:
            for phrase in self.phrases:
                try:
                    re.compile(phrase)
                except re.error as e:
                    raise ConfigError("phrases", phrase, f"not a regular expression ({e})") from None
        self.require("factor", math.isfinite(self.factor) and self.factor >= 0, "must be a finite number >= 0")
        self.require("phrases_file", self.phrases_file is None or os.path.isfile(self.phrases_file), "no such file")
        self.require("phrases", bool(self.phrases) or self.phrases_file is not None,
                     "no phrase: give loss.phrases=[...] or loss.phrases_file")
        self.require("phrases", all(isinstance(p, str) and p.strip() for p in self.phrases),
                     "every phrase must be a non-empty string")


@dataclass(kw_only=True)
class FocalLossConfig(LossConfig):
    _target_: str = "sft.loss.builtin.FocalLoss"
    gamma: float = 2.0

    def check(self, cfg=None):
        super().check(cfg)
        self.require("gamma", math.isfinite(self.gamma) and self.gamma >= 0, "must be a finite number >= 0")


@dataclass(kw_only=True)
class DFTLossConfig(LossConfig):
    _target_: str = "sft.loss.builtin.DFTLoss"


@dataclass(kw_only=True)
class LengthLossConfig(LossConfig):
    _target_: str = "sft.loss.builtin.LengthLoss"
    length_ref: float = 256.0  # assistant tokens at which the length factor is 1
    length_beta: float = 0.5  # 0: off; 1: every sample's tokens weigh as much in total as a length_ref-long one's

    def check(self, cfg=None):
        super().check(cfg)
        self.require("length_ref", math.isfinite(self.length_ref) and self.length_ref > 0, "must be > 0")
        self.require("length_beta", math.isfinite(self.length_beta) and self.length_beta >= 0,
                     "must be a finite number >= 0 (0 turns the length factor off)")


# --- LoRA ---------------------------------------------------------------------------------------------


@dataclass
class LoraConfig(Schema):
    """Fields of `peft.LoraConfig`, which `instantiate` builds directly."""

    _target_: str = "peft.LoraConfig"
    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    # "all-linear" (PEFT: every linear layer of the model but its output layer, whatever the architecture
    # names them: q_proj ... on Llama/Qwen, qkv_proj and gate_up_proj on Phi-3), or a list of module names
    target_modules: Any = "all-linear"
    bias: str = "none"
    use_dora: bool = False
    task_type: str = "CAUSAL_LM"

    def check(self, cfg=None):
        self.require("r", self.r >= 1, "must be >= 1")
        self.require("lora_alpha", self.lora_alpha > 0, "must be > 0")
        self.require("lora_dropout", 0 <= self.lora_dropout < 1, "must be in [0, 1)")
        self.require("target_modules", self.target_modules == "all-linear" or (
            not isinstance(self.target_modules, str) and len(self.target_modules) > 0),
            "must be all-linear or a non-empty list of module names")


@dataclass
class FsdpConfig(Schema):
    """FSDP2 (torch's `fully_shard`) through accelerate's plugin: parameters, gradients and optimizer states
    sharded over the processes, one unit per decoder layer plus one for the rest (embeddings, norm, output
    layer). The second engine beside DeepSpeed (`deepspeed=...`); one of the two per run."""

    # true: a layer's full weights are freed after its forward and gathered again for its backward (ZeRO-3's
    # memory); false: kept from forward to backward (less communication, ZeRO-2-like memory)
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # parameters, gradients and optimizer states in CPU memory between uses
    # the module classes sharded as one unit each; null: the model's own `_no_split_modules` (its decoder layer)
    layers: Optional[List[str]] = None

    def check(self, cfg=None):
        self.require("layers", self.layers is None or len(self.layers) > 0, "must be null or a non-empty list")
        self.require("cpu_offload", not self.cpu_offload or _cuda_available(),
                     "moves GPU memory to the CPU, and needs a CUDA GPU (torch pins the offloaded memory); this "
                     "machine has none: use fsdp=full_shard")
        if cfg is None:
            return
        self.require("", cfg.deepspeed is None, "FSDP and DeepSpeed are two engines for the same job: choose one "
                     "(fsdp=none, or deepspeed=none)")
        self.require("", cfg.model.quantization is None, "sft does not shard a 4-bit base model with FSDP (QLoRA "
                     "trains on one GPU: lora=qlora without fsdp)")


# --- gradient clipping policies (built as sft.training.clipping.*, which extend these) -------------------------


@dataclass(kw_only=True)
class NoClipConfig(Schema):
    _target_: str = "sft.training.clipping.GradClipPolicy"


@dataclass(kw_only=True)
class StaticClipConfig(NoClipConfig):
    _target_: str = "sft.training.clipping.StaticClip"
    max_norm: float = 1.0  # 0 turns clipping off

    def check(self, cfg=None):
        self.require("max_norm", self.max_norm >= 0, "must be >= 0 (0 turns clipping off)")


@dataclass(kw_only=True)
class WarmupClipConfig(StaticClipConfig):
    """An adaptive policy: `max_norm` for the first `warmup_steps` steps, while its statistics fill."""

    warmup_steps: int = 10

    def check(self, cfg=None):
        super().check(cfg)
        self.require("warmup_steps", self.warmup_steps >= 1, "must be >= 1 (the statistics need a first norm)")


@dataclass(kw_only=True)
class AutoClipConfig(WarmupClipConfig):
    _target_: str = "sft.training.clipping.AutoClip"
    percentile: float = 10.0
    history_size: int = 0  # 0: the whole history

    def check(self, cfg=None):
        super().check(cfg)
        self.require("percentile", 0 < self.percentile <= 100, "must be in (0, 100]")
        self.require("history_size", self.history_size >= 0, "must be >= 0 (0: the whole history)")


@dataclass(kw_only=True)
class ZClipConfig(WarmupClipConfig):
    _target_: str = "sft.training.clipping.ZClip"
    alpha: float = 0.97
    z_threshold: float = 2.5

    def check(self, cfg=None):
        super().check(cfg)
        self.require("alpha", 0 < self.alpha < 1, "must be in (0, 1)")
        self.require("z_threshold", self.z_threshold > 0, "must be > 0")


# --- controllers (the `controllers` node; built as sft.training.controllers.*, which extend these) -------------


@dataclass(kw_only=True)
class ControllerConfig(Schema):
    """A controller's knobs. `needs_eval_data`: it acts on evaluation metrics."""

    _target_: str = MISSING
    needs_eval_data: ClassVar[bool] = False

    def check(self, cfg=None):
        if self.needs_eval_data and cfg is not None:
            self.require("", cfg.data.eval_file is not None, "needs evaluation data (data.eval_file)")
            self.require("", cfg.trainer.eval_strategy != "no", "needs evaluations: trainer.eval_strategy=no "
                         "turns them off")


@dataclass(kw_only=True)
class MetricWatchConfig(ControllerConfig):
    """A controller that watches an eval metric for improvement."""

    needs_eval_data: ClassVar[bool] = True
    metric: str = "eval_loss"
    patience: int = 3
    min_delta: float = 0.0
    mode: str = "min"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("patience", self.patience >= 1, "must be >= 1")
        self.require("mode", self.mode in ("min", "max"), "must be min or max")


@dataclass(kw_only=True)
class EarlyStoppingConfig(MetricWatchConfig):
    _target_: str = "sft.training.controllers.EarlyStopping"


@dataclass(kw_only=True)
class LRPlateauConfig(MetricWatchConfig):
    _target_: str = "sft.training.controllers.ReduceLROnPlateau"
    patience: int = 2
    factor: float = 0.5
    min_lr: float = 0.0

    def check(self, cfg=None):
        super().check(cfg)
        self.require("factor", 0 < self.factor < 1, "must be in (0, 1)")


@dataclass(kw_only=True)
class CurriculumConfig(ControllerConfig):
    _target_: str = "sft.training.controllers.Curriculum"
    needs_eval_data: ClassVar[bool] = True
    temperature: float = 4.0
    min_temperature: float = 0.25
    max_temperature: float = 16.0
    factor: float = 0.7
    metric: str = "eval_loss_hardest_bucket"
    min_delta: float = 0.0
    chunk_size: int = 256

    def check(self, cfg=None):
        super().check(cfg)
        self.require("factor", 0 < self.factor < 1, "must be in (0, 1)")
        self.require("min_temperature", 0 < self.min_temperature <= self.temperature <= self.max_temperature,
                     "must satisfy 0 < min_temperature <= temperature <= max_temperature")
        self.require("chunk_size", self.chunk_size >= 1, "must be >= 1")


@dataclass(kw_only=True)
class AdaptiveEvalConfig(ControllerConfig):
    _target_: str = "sft.training.controllers.AdaptiveEvalInterval"
    needs_eval_data: ClassVar[bool] = True
    metric: str = "eval_loss"
    min_steps: int = 25
    max_steps: int = 800
    fast: float = 0.05
    slow: float = 0.005

    def check(self, cfg=None):
        super().check(cfg)
        self.require("min_steps", 1 <= self.min_steps <= self.max_steps, "must be >= 1 and <= max_steps")
        self.require("slow", 0 <= self.slow < self.fast, "must be >= 0 and < adaptive_eval.fast")


@dataclass(kw_only=True)
class GuardConfig(ControllerConfig):
    _target_: str = "sft.training.controllers.TrainingGuard"
    max_consecutive: int = 3
    spike_factor: float = 0.0  # 0: no spike detection; e.g. 3.0 flags a step loss above 3x its EMA
    spike_ema: float = 0.9
    spike_warmup: int = 10
    skip_spikes: bool = False

    def check(self, cfg=None):
        super().check(cfg)
        self.require("max_consecutive", self.max_consecutive >= 1, "must be >= 1")
        self.require("spike_factor", self.spike_factor == 0 or self.spike_factor > 1, "must be 0 (off) or > 1")
        self.require("spike_ema", 0 < self.spike_ema < 1, "must be in (0, 1)")


@dataclass(kw_only=True)
class WatchdogConfig(ControllerConfig):
    _target_: str = "sft.training.controllers.HangWatchdog"
    timeout_s: float = 1200.0  # below trainer.ddp_timeout, so that the stacks are dumped first

    def check(self, cfg=None):
        super().check(cfg)
        self.require("timeout_s", self.timeout_s > 0, "must be > 0")
        if cfg is not None:
            self.require("timeout_s", self.timeout_s < cfg.trainer.ddp_timeout,
                         f"must be below trainer.ddp_timeout ({cfg.trainer.ddp_timeout}), else the collective "
                         "times out first and no stacks are dumped")


# --- trainer, evaluation extras, throughput, sweeps, bench --------------------------------------------


@dataclass
class ExactMatchConfig(Schema):
    """Greedy-decoding exact match on the hardest eval bucket, after training (`eval_exact_match_hardest`)."""

    max_rows: int = 100
    max_new_tokens: int = 32


@dataclass
class EvalGenerationConfig(Schema):
    """Greedy answers to fixed eval prompts at evaluations, scored and logged (`sft.eval.samples`)."""

    _target_: str = "sft.eval.samples.EvalGeneration"
    prompts: int = 8  # chosen once from the eval file, spread over the difficulty buckets
    every: int = 1  # at every k-th evaluation (the first included)
    max_new_tokens: int = 64
    # name -> import path of a function (answer, reference) -> float; logged as eval_gen/<name> (the mean)
    metrics: Dict[str, str] = field(default_factory=lambda: {"exact_match": "sft.eval.samples.exact_match"})

    def check(self, cfg=None):
        for key in ("prompts", "every", "max_new_tokens"):
            self.require(key, getattr(self, key) >= 1, "must be >= 1")
        for name, path in self.metrics.items():
            try:
                scorer = _import_target(path)
            except ConfigError as e:
                raise ConfigError(f"metrics.{name}", path, e.reason) from None
            if not callable(scorer):
                raise ConfigError(f"metrics.{name}", path, "is not a function (answer, reference) -> float")
            if (needs := getattr(scorer, "requires", None)) and (missing := _missing(needs)):
                raise ConfigError(f"metrics.{name}", path, f"needs {missing[0]}: pip install {missing[1]}")
        if cfg is not None:
            self.require("prompts", cfg.data.eval_file is not None and cfg.trainer.eval_strategy != "no",
                         "generation samples are taken at evaluations: set data.eval_file and an eval_strategy")


@dataclass
class ThroughputConfig(Schema):
    _target_: str = "sft.training.throughput.ThroughputMeter"
    peak_tflops: Optional[float] = None  # per device, for the MFU estimate; null: from the GPU's name (table)

    def check(self, cfg=None):
        self.require("peak_tflops", self.peak_tflops is None or self.peak_tflops > 0, "must be > 0 (or null)")


@dataclass
class SweepConfig(Schema):
    continue_on_error: bool = True  # in a multirun, a failing job is recorded and the sweep goes on
    # The same -m command again with hydra.sweep.dir=<that sweep> and sweep.resume=true: finished jobs are
    # skipped, interrupted ones resume from their newest complete checkpoint, the report is rebuilt.
    resume: bool = False
    baseline: Optional[str] = None  # the report's reference setting, e.g. "loss.alpha=0"; null: the first


# report_to entries and the module each needs ("module pip-name" where they differ)
TRACKER_PACKAGES = {"mlflow": "mlflow mlflow-skinny", "wandb": "wandb", "tensorboard": "tensorboard",
                    "comet_ml": "comet_ml comet-ml", "clearml": "clearml", "neptune": "neptune", "dvclive": "dvclive",
                    "trackio": "trackio", "swanlab": "swanlab", "codecarbon": "codecarbon"}


@dataclass
class TrainerConfig(TrainingArgumentsFields, Schema):
    """Every field of `transformers.TrainingArguments` (`sft/trainer_fields.py`, generated from the installed
    version), passed to it as they are; below, those whose default is this project's, with their checks.
    The fields the recipe sets itself are refused (`owned_fields`), naming the knob that replaces each."""

    # TrainingArguments fields that the recipe sets itself, and the sft knob for each
    owned_fields: ClassVar[Dict[str, str]] = {
        "max_grad_norm": "set by the clip policy: clip=static clip.max_norm=0.5 (or clip=autoclip, zclip, none)",
        "remove_unused_columns": "always false: the loss needs its loss_weights column, and the collator passes the "
                                 "model only what its forward takes",
        "label_names": "always [labels]",
        "eval_on_start": "set by the recipe: an evaluation at step 0 whenever data.eval_file is set and the run "
                         "does not resume",
        "include_num_input_tokens_seen": "always non_padding (the throughput figures count real tokens)",
        "deepspeed": "the deepspeed group: deepspeed=zero2, zero3, zero3_offload, or file deepspeed.path=ds.json "
                     "(and deepspeed.<key>=...)",
        "gradient_checkpointing": "use trainer.activation_checkpointing=true (its kwargs set by the recipe)",
        "activation_checkpointing_kwargs": "set by the recipe (use_reentrant=false) for trainer.activation_checkpointing",
        "gradient_checkpointing_kwargs": "set by the recipe (use_reentrant=false) for trainer.activation_checkpointing",
        "resume_from_checkpoint": "use resume=auto (the newest complete checkpoint) or resume=<checkpoint dir>",
        "fsdp": "the fsdp group: fsdp=full_shard or full_shard_offload (and fsdp.<key>=...)",
        "fsdp_config": "the fsdp group: fsdp=full_shard or full_shard_offload (and fsdp.<key>=...)",
        "parallelism_config": "an accelerate ParallelismConfig object, which a config cannot hold: fsdp=full_shard "
                              "(or deepspeed=zero3) shards over all processes",
    }

    output_dir: Optional[str] = None  # None: the Hydra run dir
    per_device_train_batch_size: int = 16
    per_device_eval_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch"
    num_train_epochs: float = 6.0
    max_steps: int = -1
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 0.05
    logging_steps: float = 10
    logging_first_step: bool = True
    eval_strategy: str = "steps"
    eval_steps: Optional[float] = 200
    save_strategy: str = "steps"
    save_steps: float = 200
    save_total_limit: Optional[int] = 3
    load_best_model_at_end: bool = False
    metric_for_best_model: Optional[str] = None
    greater_is_better: Optional[bool] = None
    seed: int = 42
    data_seed: Optional[int] = None
    full_determinism: bool = False
    bf16: bool = False
    fp16: bool = False
    activation_checkpointing: bool = False
    dataloader_pin_memory: bool = True
    torch_compile: bool = False
    train_sampling_strategy: str = "random"
    dataloader_num_workers: int = 0
    report_to: List[str] = field(default_factory=lambda: ["tensorboard"])
    run_name: Optional[str] = None
    logging_nan_inf_filter: bool = False  # True would hide a NaN loss from the log, not from the update
    disable_tqdm: Optional[bool] = None
    log_level: str = "passive"
    ddp_timeout: int = 1800
    ddp_backend: Optional[str] = None
    use_cpu: bool = False

    def check(self, cfg=None):
        self.require("learning_rate", self.learning_rate > 0, "must be > 0")
        self.require("weight_decay", self.weight_decay >= 0, "must be >= 0")
        for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            self.require(key, getattr(self, key) >= 1, "must be >= 1")
        self.require("max_steps", self.max_steps == -1 or self.max_steps > 0, "must be > 0, or -1 to use epochs")
        self.require("num_train_epochs", self.num_train_epochs > 0, "must be > 0")
        self.require("save_total_limit", self.save_total_limit is None or self.save_total_limit >= 1,
                     "must be >= 1 (or null to keep every checkpoint)")
        self.require("fp16", not (self.fp16 and self.bf16), "fp16 and bf16 cannot both be on")
        for tracker in [self.report_to] if isinstance(self.report_to, str) else (self.report_to or []):
            missing = _missing(TRACKER_PACKAGES[tracker]) if tracker in TRACKER_PACKAGES else None
            self.require("report_to", missing is None, f"{tracker} is not installed: pip install {(missing or '?')[-1]}")


def owned_field_override(overrides: list[str]) -> ConfigError | None:
    """A command-line override of a `TrainingArguments` field that the recipe sets itself (`trainer.max_grad_norm=0.5`,
    with or without `+`), as the error naming the knob to use; Hydra would only say the key is not in the schema."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("trainer.") and key[len("trainer."):] in TrainerConfig.owned_fields:
            return ConfigError(key, None, TrainerConfig.owned_fields[key[len("trainer."):]])
    return None


# The engine groups, which are off (null) by default, and the options that turn each on
ENGINE_OPTIONS = {"fsdp": "fsdp=full_shard or fsdp=full_shard_offload",
                  "deepspeed": "deepspeed=zero2, zero3, zero3_offload or file"}


def key_of_engine_left_off(overrides: list[str]) -> ConfigError | None:
    """A command-line key of an engine group (`fsdp.cpu_offload=true`) where the config, composed without it,
    leaves that engine off (`fsdp: null`): the error naming the option that turns it on. Hydra would say only
    that the key is not in the struct."""
    keyed = [o for o in overrides if "=" in o and not o.startswith(("-", "~"))
             and o.lstrip("+").split("=", 1)[0].split(".")[0] in ENGINE_OPTIONS and "." in o.split("=", 1)[0]]
    if not keyed:
        return None
    rest = [o for o in overrides if o not in keyed and "=" in o and not o.startswith(("-", "hydra.", "hydra/"))]
    try:
        cfg = compose("train", rest)
    except Exception:  # noqa: BLE001 - an error of the other overrides: Hydra reports it as it runs
        return None
    for override in keyed:
        key = override.lstrip("+").split("=", 1)[0]
        engine = key.split(".")[0]
        if cfg.get(engine) is None:
            return ConfigError(key, None, f"{engine} is off ({engine}=none in this config): turn it on with "
                               f"{ENGINE_OPTIONS[engine]}, then set its keys")
    return None


def trainer_fields_source() -> str:
    """The source of `sft/trainer_fields.py`: a schema of every `TrainingArguments` field of the installed
    transformers that the recipe does not own, with its type as OmegaConf can hold it (a union of other types,
    a dict or a list: `Any`) and its default. `python -m sft.config` writes it; a test compares it."""
    import dataclasses
    import enum
    import types
    import typing

    import transformers
    from transformers import TrainingArguments

    simple = {int: "int", float: "float", bool: "bool", str: "str"}

    def annotation(tp) -> str:
        if tp in simple:
            return simple[tp]
        args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else ()
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in simple:
            return f"Optional[{simple[rest[0]]}]" if type(None) in args else simple[rest[0]]
        if str in rest and all(a is str or (isinstance(a, type) and issubclass(a, enum.Enum)) for a in rest):
            return "Optional[str]" if type(None) in args else "str"  # an enum of names, or the name
        return "Any"

    lines = [f'"""Every `transformers.TrainingArguments` field (transformers {transformers.__version__}) but those the',
             'recipe owns (`TrainerConfig.owned_fields`): generated by `python -m sft.config`, do not edit; a test',
             'fails when the installed transformers adds, removes or changes a field."""', "",
             "from __future__ import annotations", "", "from dataclasses import dataclass, field",
             "from typing import Any, Optional", "", "", "@dataclass", "class TrainingArgumentsFields:"]
    for f in dataclasses.fields(TrainingArguments):
        if not f.init or f.name in TrainerConfig.owned_fields:
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default.value if isinstance(f.default, enum.Enum) else f.default)
        else:
            default = f"field(default_factory=lambda: {f.default_factory()!r})"
        lines.append(f"    {f.name}: {annotation(f.type)} = {default}")
    return "\n".join(lines) + "\n"


@dataclass
class BenchConfig(Schema):
    """`python -m sft.bench` (training ignores it): which cases, how long, the loss-only case's shape."""

    cases: List[str] = field(default_factory=lambda: [
        "hf", "ce", "hard_sample", "packing", "trl", "trl_padding_free", "eval_hf", "eval_sft", "loss_naive",
        "loss_chunked", "preprocess", "tokenize", "scale", "startup"])
    # The training cases run at each micro-batch size (null: trainer.per_device_train_batch_size); ratios at the
    # first are named plainly (`ce_vs_hf`), at the others with the size (`ce_vs_hf_b16`).
    batch_sizes: Optional[List[int]] = None
    steps: int = 40  # optimizer steps per training case
    warmup_steps: int = 5  # not timed
    repeats: int = 3  # rounds over all cases, interleaved; medians are reported
    loss_vocab: int = 151936  # Qwen2.5's vocabulary
    loss_hidden: int = 896  # Qwen2.5-0.5B's hidden size
    loss_batch: int = 4
    loss_seq: int = 1024
    loss_dtype: str = "float32"
    loss_trainable_head: bool = False  # false: the projection frozen, as with LoRA
    preprocess_rows: int = 100000
    tokenize_rows: int = 4000  # multi-turn rows tokenised side by side by sft and its 0.1 baseline (`tokenize`)
    scale_rows: int = 1000000  # multi-turn rows (about 300 tokens) preprocessed cold, then loaded cached (`scale`)
    eval_repeats: int = 3  # evaluations timed per eval case (the best counts), after one untimed
    case_timeout_s: int = 1800


@dataclass
class TrainConfig(Schema):
    """The primary config: one field per group plus the few top-level switches."""

    model: Any = MISSING
    data: Any = MISSING
    loss: Any = MISSING
    lora: Any = None
    deepspeed: Any = None
    fsdp: Any = None  # fsdp=full_shard: FsdpConfig (fsdp_schema)
    trainer: Any = MISSING  # typed by trainer_schema in the trainer group (nesting it here would copy it)
    clip: Any = MISSING
    # name -> a controller node (`_target_` + its knobs); `conf/controllers/`, `+controllers=<name>`
    controllers: Dict[str, Any] = field(default_factory=dict)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    collator: CollatorConfig = field(default_factory=CollatorConfig)
    eval_buckets: List[float] = field(default_factory=lambda: [1.0, 2.0, 3.0])  # difficulty bucket edges
    exact_match: Any = None
    eval_generation: Any = None  # eval_generation=default: generation samples at evaluations
    sweep: SweepConfig = field(default_factory=SweepConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    bench: Any = None  # python -m sft.bench only: bench_schema (conf/bench.yaml)
    resume: Optional[str] = None  # null, "auto" (newest complete checkpoint in the run dir) or a checkpoint path
    resume_force: bool = False  # resume even if the data or a fixed setting changed, or verification fails
    overwrite: bool = False  # a new run into a dir holding another run's outputs: delete them (else refused)
    # Checksums in each checkpoint's manifest: small (files up to 64 MiB; sizes of all) | all (minutes at 7B)
    checkpoint_checksums: str = "small"
    # SIGTERM/SIGINT: at most this long to finish the step and save a checkpoint (sft.training.preemption)
    signal_grace_s: float = 600.0

    def check(self, cfg=None):
        self.require("eval_buckets", list(self.eval_buckets) == sorted(self.eval_buckets),
                     "bucket edges must be increasing")
        self.require("resume", self.resume in (None, "auto") or Path(self.resume).is_dir(),
                     "must be null, 'auto' or an existing checkpoint directory")
        self.require("checkpoint_checksums", self.checkpoint_checksums in ("small", "all"), "must be small or all")
        self.require("signal_grace_s", self.signal_grace_s > 0, "must be > 0")


SCHEMAS = {  # (group, name) -> schema; a YAML option of the group names its schema in `defaults`
    (None, "train_schema"): TrainConfig,
    ("model", "model_schema"): ModelConfig,
    ("data", "data_schema"): DataConfig,
    ("loss", "ce_schema"): CrossEntropyLossConfig,
    ("loss", "hard_sample_schema"): HardSampleLossConfig,
    ("loss", "keywords_schema"): KeywordLossConfig,
    ("loss", "focal_schema"): FocalLossConfig,
    ("loss", "dft_schema"): DFTLossConfig,
    ("loss", "length_schema"): LengthLossConfig,
    ("lora", "lora_schema"): LoraConfig,
    ("fsdp", "fsdp_schema"): FsdpConfig,
    ("trainer", "trainer_schema"): TrainerConfig,
    ("clip", "none_schema"): NoClipConfig,
    ("clip", "static_schema"): StaticClipConfig,
    ("clip", "autoclip_schema"): AutoClipConfig,
    ("clip", "zclip_schema"): ZClipConfig,
    ("controllers", "early_stopping_schema"): EarlyStoppingConfig,
    ("controllers", "lr_plateau_schema"): LRPlateauConfig,
    ("controllers", "curriculum_schema"): CurriculumConfig,
    ("controllers", "adaptive_eval_schema"): AdaptiveEvalConfig,
    ("controllers", "guard_schema"): GuardConfig,
    ("controllers", "watchdog_schema"): WatchdogConfig,
    ("exact_match", "exact_match_schema"): ExactMatchConfig,
    ("eval_generation", "eval_generation_schema"): EvalGenerationConfig,
}


def register() -> None:
    """Register the schemas and the `${sft_sample:FILE}` resolver (path of a bundled sample file)."""
    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
    cs.store(name="bench_schema", node=BenchConfig, package="bench")
    if not OmegaConf.has_resolver("sft_sample"):
        OmegaConf.register_new_resolver("sft_sample", lambda name: str(sample_data.HERE / name))


def compose(config_name: str = "train", overrides: list[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """A config of `conf/` composed as `python -m sft.train overrides...` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides),
                             return_hydra_config=return_hydra_config)


def help_text(overrides: list[str]) -> str | None:
    """`python -m sft.train --help [overrides]`: the config groups with their options (YAML files only: the
    `*_schema` entries are the options' schemas, not choices), those of your `hydra.searchpath` included,
    and the composed config, in Hydra's layout.

    Hydra's own `--help` takes seconds: it lists every group through the config store, copying each stored
    schema once per group. None where this cannot answer: a `pkg://` search path, or overrides that do not
    compose (Hydra's `--help` then says why).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    except Exception:  # noqa: BLE001 - Hydra's own --help reports it
        return None
    roots = [CONF_DIR] + [str(p) for p in cfg.hydra.searchpath]
    if any(not root.startswith(("/", "file://")) for root in roots):
        return None
    options: dict[str, set] = {}
    for root in roots:
        root = Path(root.removeprefix("file://"))
        for yaml in [*root.rglob("*.yaml"), *root.rglob("*.yml")]:
            group = yaml.parent.relative_to(root).as_posix()
            if group != ".":  # the primary configs (train, bench) are not choices
                options.setdefault(group, set()).add(yaml.stem)
    with open_dict(cfg):
        del cfg["hydra"]
    groups = "\n".join(f"{group}: {', '.join(sorted(names))}" for group, names in sorted(options.items()))
    return ("python -m sft.train [group=option] [key=value ...]: fine-tune a chat model (README.md).\n\n"
            "== Configuration groups ==\nCompose your configuration from those groups (group=option)\n\n"
            f"{groups}\n\n\n== Config ==\nOverride anything in the config (foo.bar=value)\n\n"
            f"{OmegaConf.to_yaml(cfg)}")


# --- value checks -------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _missing(requirement: str) -> tuple[str, str] | None:
    """For a requirement "module" or "module pip-name": None if the module is installed, else (module, pip name)."""
    module, pip_name = requirement.split()[0], requirement.split()[-1]
    return None if _installed(module) else (module, pip_name)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def check(cfg: DictConfig) -> None:
    """Validate every node of a composed config; raise `ConfigError` naming the first bad field.

    A node typed by a schema is checked by that schema's `check`; an untyped node with a `_target_` (a
    class of yours) by the target's signature.
    """
    for path, node in _nodes(cfg):
        try:
            check_node(node, cfg)
        except ConfigError as e:
            raise e.within(path) if path else e
    if cfg.deepspeed is not None:
        load_deepspeed_file(cfg)
        _check_deepspeed(cfg)


def load_deepspeed_file(cfg: DictConfig) -> None:
    """`deepspeed=file deepspeed.path=ds.json`: replace the node by the file's JSON object, with the keys set
    beside `path` on top, so that everything after the check (and the resume comparison) sees one dict."""
    if "path" not in cfg.deepspeed.keys():  # (`in` on the node itself is False for a missing value)
        return
    if OmegaConf.is_missing(cfg.deepspeed, "path"):
        raise ConfigError("deepspeed.path", None, "missing: deepspeed=file takes deepspeed.path=<your DeepSpeed JSON>")
    path = Path(str(cfg.deepspeed.path)).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError("deepspeed.path", str(path), f"cannot be read ({e.strerror or e})") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("deepspeed.path", str(path),
                          f"not JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(loaded, dict):
        raise ConfigError("deepspeed.path", str(path), f"must hold a JSON object, not {type(loaded).__name__}")
    beside = {k: v for k, v in OmegaConf.to_container(cfg.deepspeed, resolve=True).items() if k != "path"}
    with open_dict(cfg):
        cfg.deepspeed = OmegaConf.merge(OmegaConf.create(loaded), OmegaConf.create(beside))


def _nodes(cfg: DictConfig, path: str = ""):
    """(path, node) of the config and every dict node below it, parents first."""
    yield path, cfg
    for key in cfg:
        child = None if OmegaConf.is_missing(cfg, key) else cfg[key]
        if isinstance(child, DictConfig):
            yield from _nodes(child, f"{path}.{key}" if path else str(key))


def check_node(node: DictConfig, cfg: DictConfig | None = None) -> None:
    """Check one node against the class it builds where that class has a schema (a built-in, or yours that
    extends one), else against the node's own schema, else (an untyped `_target_`) the target's signature.
    A key that the schema does not have is refused, naming it."""
    schema = OmegaConf.get_type(node)
    typed = is_dataclass(schema) and issubclass(schema, Schema)
    target = node.get("_target_") if "_target_" in node and not OmegaConf.is_missing(node, "_target_") else None
    if target is not None and (not typed or target != getattr(schema, "_target_", None)):
        built = _import_target(target)
        # A schema of its own: decorated as a dataclass itself (a subclass with its own __init__ is not).
        if not (isinstance(built, type) and issubclass(built, Schema) and "__dataclass_fields__" in vars(built)):
            return check_signature(node, built)
        schema = built
    elif not typed:
        return
    knobs = {f.name: f for f in fields(schema) if f.init}
    values = {}
    for key in node:
        key = str(key)
        if key.startswith("_") and key not in knobs:  # Hydra's own: _convert_, _recursive_, _partial_
            continue
        if key not in knobs:
            owned = getattr(schema, "owned_fields", {}).get(key)
            raise ConfigError(key, None, owned or f"not a knob of {target or schema.__name__} (it takes: "
                              f"{', '.join(k for k in knobs if not k.startswith('_'))})")
        if OmegaConf.is_missing(node, key):
            raise ConfigError(key, None, "missing: set it on the command line or in a config")
        values[key] = node[key]
    schema(**values).check(cfg)


def _import_target(target: str):
    """The object a `_target_` names (`package.module.Class`), or a one-line `ConfigError` saying why not."""
    import importlib

    parts = target.split(".")
    try:
        for i in range(len(parts) - 1, 0, -1):  # the longest importable module path, then attributes
            module = ".".join(parts[:i])
            try:
                obj = importlib.import_module(module)
                break
            except ModuleNotFoundError as e:
                if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                    raise  # a module that the target's own module imports is missing
        else:
            raise ModuleNotFoundError(f"No module named {parts[0]!r}")
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    except Exception as e:  # ImportError, AttributeError, or whatever the module raised when imported
        raise ConfigError("_target_", target, f"cannot be imported ({type(e).__name__}: {e})") from None


def check_signature(node: DictConfig, built=None) -> None:
    """The keys of a node without a schema must be parameters of its `_target_` (a class or function)."""
    target = node._target_
    params = inspect.signature(built if built is not None else _import_target(target)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in node:
        if key not in params and not str(key).startswith("_"):
            accepted = ", ".join(p for p in params if p != "self") or "none"
            raise ConfigError(str(key), None, f"not a parameter of {target} (it takes: {accepted})")


def _check_deepspeed(cfg: DictConfig) -> None:
    """The DeepSpeed dict mirrors DeepSpeed's own JSON: no schema, so its rules are checked here."""
    zero = cfg.deepspeed.get("zero_optimization") or {}
    stage = zero.get("stage", 0)

    def require(key: str, ok: bool, reason: str) -> None:
        if not ok:
            raise ConfigError(key, OmegaConf.select(cfg, key), reason)

    require("deepspeed.zero_optimization.stage", stage in (0, 1, 2, 3), "must be 0, 1, 2 or 3")
    if stage == 3:
        require("deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save",
                zero.get("stage3_gather_16bit_weights_on_model_save") is True,
                "must be true with ZeRO-3, else the saved model or LoRA adapter is empty")
    require("deepspeed.zero_optimization.offload_param", stage == 3 or "offload_param" not in zero,
            "parameter offload needs ZeRO stage 3")
    require("deepspeed", cfg.model.quantization is None, "DeepSpeed ZeRO does not shard a 4-bit base model")


if __name__ == "__main__":  # python -m sft.config: write sft/trainer_fields.py for the installed transformers
    Path(__file__).with_name("trainer_fields.py").write_text(trainer_fields_source())
    print(f"wrote {Path(__file__).with_name('trainer_fields.py')}")
