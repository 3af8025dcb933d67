"""The structured config: one dataclass schema per config group, registered in Hydra's ConfigStore.

Hydra rejects an unknown key or a wrongly typed value at composition, naming it. `check` then
validates values (ranges, files) before anything heavy is built, raising `ConfigError`, which the
entrypoint turns into a one-line message and exit code 2.

This module imports neither torch nor transformers so that `--cfg job` and `--help` answer at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from sft import sample_data


class ConfigError(ValueError):
    """A config value that cannot work; `str()` names the field and the bad value."""

    def __init__(self, key: str, value: Any, reason: str):
        super().__init__(f"{key}={value!r}: {reason}" if value is not None else f"{key}: {reason}")
        self.key, self.value, self.reason = key, value, reason


# --- group schemas ------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    _target_: str = "sft.model.load_model"
    name_or_path: str = "tiny"
    dtype: str = "float32"
    attn_implementation: Optional[str] = "sdpa"
    trust_remote_code: bool = False
    quantization: Optional[str] = None  # nf4: 4-bit base for QLoRA (bitsandbytes, CUDA only)
    random_init: Optional[Dict[str, Any]] = None  # a transformers config: this architecture, random weights


@dataclass
class TokenizerConfig:
    _target_: str = "sft.model.load_tokenizer"
    name_or_path: str = "${model.name_or_path}"
    chat_template: Optional[str] = None
    trust_remote_code: bool = "${model.trust_remote_code}"  # type: ignore[assignment]


@dataclass
class DataConfig:
    _target_: str = "sft.data.load_sft_datasets"
    train_file: str = MISSING
    eval_file: Optional[str] = None
    max_length: int = 2048
    default_score: Optional[float] = None
    num_proc: Optional[int] = None  # tokenising processes; null: all cores (<= 8) from 20k rows on, else 1
    on_error: str = "raise"  # raise | skip (train on the valid rows, write rejected.jsonl in the run dir)
    overlong: str = "truncate"  # truncate (prompt cut from the left first) | drop | error
    packing: bool = False  # each micro-batch as one row without padding (position_ids restart per sample)


@dataclass
class CollatorConfig:
    _target_: str = "sft.data.WeightedDataCollator"
    pad_to_multiple_of: Optional[int] = None  # padded batches only; 8 or 64 on GPU
    packing: bool = "${data.packing}"  # type: ignore[assignment]


@dataclass
class CrossEntropyLossConfig:
    _target_: str = "sft.losses.CrossEntropyLoss"
    impl: str = "auto"  # auto | naive | chunked | liger | cce (see sft/losses.py)
    chunk_tokens: int = 1024  # chunked: assistant tokens per chunk of logits


@dataclass
class HardSampleLossConfig:
    _target_: str = "sft.losses.HardSampleLoss"
    alpha: float = 1.0
    min_weight: float = 0.0
    max_weight: float = 100.0
    normalize: str = "weight"
    impl: str = "auto"
    chunk_tokens: int = 1024


@dataclass
class LoraConfig:
    """Fields of `peft.LoraConfig`, which `instantiate` builds directly."""

    _target_: str = "peft.LoraConfig"
    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    bias: str = "none"
    use_dora: bool = False
    task_type: str = "CAUSAL_LM"


@dataclass
class NoClipConfig:
    _target_: str = "sft.clipping.GradClipPolicy"


@dataclass
class StaticClipConfig:
    _target_: str = "sft.clipping.StaticClip"
    max_norm: float = 1.0


@dataclass
class AutoClipConfig:
    _target_: str = "sft.clipping.AutoClip"
    percentile: float = 10.0
    warmup_steps: int = 10
    max_norm: float = 1.0  # the threshold during warmup
    history_size: int = 0  # 0: the whole history


@dataclass
class ZClipConfig:
    _target_: str = "sft.clipping.ZClip"
    alpha: float = 0.97
    z_threshold: float = 2.5
    warmup_steps: int = 10
    max_norm: float = 1.0  # the threshold during warmup


@dataclass
class EarlyStoppingConfig:
    _target_: str = "sft.callbacks.EarlyStopping"
    metric: str = "eval_loss"
    patience: int = 3
    min_delta: float = 0.0
    mode: str = "min"


@dataclass
class LRPlateauConfig:
    _target_: str = "sft.callbacks.ReduceLROnPlateau"
    metric: str = "eval_loss"
    factor: float = 0.5
    patience: int = 2
    min_delta: float = 0.0
    min_lr: float = 0.0
    mode: str = "min"


@dataclass
class CurriculumConfig:
    _target_: str = "sft.callbacks.Curriculum"
    temperature: float = 4.0
    min_temperature: float = 0.25
    max_temperature: float = 16.0
    factor: float = 0.7
    metric: str = "eval_loss_hardest_bucket"
    min_delta: float = 0.0
    chunk_size: int = 256


@dataclass
class GuardConfig:
    _target_: str = "sft.callbacks.TrainingGuard"
    max_consecutive: int = 3
    spike_factor: float = 0.0  # 0: no spike detection; e.g. 3.0 flags a step loss above 3x its EMA
    spike_ema: float = 0.9
    spike_warmup: int = 10
    skip_spikes: bool = False


@dataclass
class WatchdogConfig:
    _target_: str = "sft.callbacks.HangWatchdog"
    timeout_s: float = 1200.0  # below trainer.ddp_timeout, so that the stacks are dumped first


@dataclass
class ExactMatchConfig:
    """Greedy-decoding exact match on the hardest eval bucket, after training (`eval_exact_match_hardest`)."""

    max_rows: int = 100
    max_new_tokens: int = 32


@dataclass
class ThroughputConfig:
    _target_: str = "sft.callbacks.ThroughputMeter"
    peak_tflops: Optional[float] = None  # per device, for the MFU estimate; null: from the GPU's name (table)


@dataclass
class SweepConfig:
    continue_on_error: bool = True  # in a multirun, a failing job is recorded and the sweep goes on


@dataclass
class AdaptiveEvalConfig:
    _target_: str = "sft.callbacks.AdaptiveEvalInterval"
    metric: str = "eval_loss"
    min_steps: int = 25
    max_steps: int = 800
    fast: float = 0.05
    slow: float = 0.005


@dataclass
class TrainerConfig:
    """Fields named exactly as in `transformers.TrainingArguments`; passed to it as they are."""

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


@dataclass
class BenchConfig:
    """`python -m sft.bench` (training ignores it): which cases, how long, the loss-only case's shape."""

    cases: List[str] = field(default_factory=lambda: [
        "hf", "ce", "hard_sample", "packing", "loss_naive", "loss_chunked", "preprocess", "startup"])
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
    case_timeout_s: int = 1800


@dataclass
class TrainConfig:
    """The primary config: one field per group plus the few top-level switches."""

    model: Any = MISSING
    data: Any = MISSING
    loss: Any = MISSING
    lora: Any = None
    deepspeed: Any = None
    trainer: Any = MISSING  # typed by trainer_schema in the trainer group (nesting it here would copy it)
    clip: Any = MISSING
    early_stopping: Any = None
    lr_plateau: Any = None
    curriculum: Any = None
    adaptive_eval: Any = None
    guard: Any = None
    watchdog: Any = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    collator: CollatorConfig = field(default_factory=CollatorConfig)
    eval_buckets: List[float] = field(default_factory=lambda: [1.0, 2.0, 3.0])  # difficulty bucket edges
    exact_match: Any = None
    sweep: SweepConfig = field(default_factory=SweepConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    bench: Any = None  # python -m sft.bench only: bench_schema (conf/bench.yaml)
    resume: Optional[str] = None  # null, "auto" (newest complete checkpoint in the run dir) or a checkpoint path
    resume_force: bool = False  # resume even if the data changed since the checkpoint


def register() -> None:
    """Register the schemas and the `${sft_sample:FILE}` resolver (path of a bundled sample file)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="bench_schema", node=BenchConfig, package="bench")
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="loss", name="ce_schema", node=CrossEntropyLossConfig)
    cs.store(group="loss", name="hard_sample_schema", node=HardSampleLossConfig)
    cs.store(group="lora", name="lora_schema", node=LoraConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    for group, name, node in [
        ("clip", "none_schema", NoClipConfig), ("clip", "static_schema", StaticClipConfig),
        ("clip", "autoclip_schema", AutoClipConfig), ("clip", "zclip_schema", ZClipConfig),
        ("early_stopping", "early_stopping_schema", EarlyStoppingConfig),
        ("lr_plateau", "lr_plateau_schema", LRPlateauConfig),
        ("curriculum", "curriculum_schema", CurriculumConfig),
        ("adaptive_eval", "adaptive_eval_schema", AdaptiveEvalConfig),
        ("guard", "guard_schema", GuardConfig),
        ("exact_match", "exact_match_schema", ExactMatchConfig),
        ("watchdog", "watchdog_schema", WatchdogConfig),
    ]:
        cs.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("sft_sample"):
        OmegaConf.register_new_resolver("sft_sample", lambda name: str(sample_data.HERE / name))


# --- value checks -------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


NORMALIZE_MODES = ("weight", "token", "sample")
LOSS_IMPLS = ("auto", "naive", "chunked", "liger", "cce")  # see sft.losses


def check(cfg) -> None:
    """Validate values that types cannot express; raise `ConfigError` naming the first bad field."""

    def require(key: str, ok: bool, reason: str) -> None:
        if not ok:
            raise ConfigError(key, OmegaConf.select(cfg, key), reason)

    t = cfg.trainer
    require("trainer.learning_rate", t.learning_rate > 0, "must be > 0")
    require("trainer.weight_decay", t.weight_decay >= 0, "must be >= 0")
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        require(f"trainer.{key}", t[key] >= 1, "must be >= 1")
    require("trainer.max_steps", t.max_steps == -1 or t.max_steps > 0, "must be > 0, or -1 to use epochs")
    require("trainer.num_train_epochs", t.num_train_epochs > 0, "must be > 0")
    require("trainer.save_total_limit", t.save_total_limit is None or t.save_total_limit >= 1,
            "must be >= 1 (or null to keep every checkpoint)")
    require("trainer.fp16", not (t.fp16 and t.bf16), "fp16 and bf16 cannot both be on")

    require("data.max_length", cfg.data.max_length >= 8, "must be >= 8")
    require("data.on_error", cfg.data.on_error in ("raise", "skip"), "must be raise or skip")
    require("data.overlong", cfg.data.overlong in ("truncate", "drop", "error"), "must be truncate, drop or error")
    require("data.default_score", cfg.data.default_score is None or cfg.data.default_score >= 0, "must be >= 0")
    for key in ("data.train_file", "data.eval_file"):
        path = OmegaConf.select(cfg, key)
        require(key, path is None or os.path.isfile(path), "no such file")
    require("throughput.peak_tflops", cfg.throughput.peak_tflops is None or cfg.throughput.peak_tflops > 0,
            "must be > 0 (or null)")
    require("collator.pad_to_multiple_of",
            cfg.collator.pad_to_multiple_of is None or cfg.collator.pad_to_multiple_of >= 1, "must be >= 1")

    loss = cfg.loss
    require("loss.impl", loss.get("impl", "auto") in LOSS_IMPLS, f"must be one of {', '.join(LOSS_IMPLS)}")
    require("loss.chunk_tokens", loss.get("chunk_tokens", 1) >= 1, "must be >= 1")
    if "normalize" in loss:
        require("loss.normalize", loss.normalize in NORMALIZE_MODES, f"must be one of {', '.join(NORMALIZE_MODES)}")
    if "alpha" in loss:
        require("loss.alpha", math.isfinite(loss.alpha), "must be a finite number")
        require("loss.min_weight", loss.min_weight >= 0, "must be >= 0")
        require("loss.max_weight", 0 < loss.max_weight < math.inf, "must be finite and > 0")
        require("loss.min_weight", loss.min_weight <= loss.max_weight,
                f"must be <= loss.max_weight ({loss.max_weight})")

    clip = cfg.clip
    if "max_norm" in clip:
        require("clip.max_norm", clip.max_norm >= 0, "must be >= 0 (0 turns clipping off)")
    if "percentile" in clip:
        require("clip.percentile", 0 < clip.percentile <= 100, "must be in (0, 100]")
    if "alpha" in clip:
        require("clip.alpha", 0 < clip.alpha < 1, "must be in (0, 1)")
        require("clip.z_threshold", clip.z_threshold > 0, "must be > 0")
    if "warmup_steps" in clip:
        require("clip.warmup_steps", clip.warmup_steps >= 1, "must be >= 1 (the statistics need a first norm)")

    for name in ("early_stopping", "lr_plateau"):
        node = cfg[name]
        if node is not None:
            require(f"{name}.patience", node.patience >= 1, "must be >= 1")
            require(f"{name}.mode", node.mode in ("min", "max"), "must be min or max")
    if cfg.lr_plateau is not None:
        require("lr_plateau.factor", 0 < cfg.lr_plateau.factor < 1, "must be in (0, 1)")
    if cfg.curriculum is not None:
        c = cfg.curriculum
        require("curriculum.factor", 0 < c.factor < 1, "must be in (0, 1)")
        require("curriculum.min_temperature", 0 < c.min_temperature <= c.temperature <= c.max_temperature,
                "must satisfy 0 < min_temperature <= temperature <= max_temperature")
        require("curriculum.chunk_size", c.chunk_size >= 1, "must be >= 1")
    if cfg.adaptive_eval is not None:
        a = cfg.adaptive_eval
        require("adaptive_eval.min_steps", 1 <= a.min_steps <= a.max_steps, "must be >= 1 and <= max_steps")
        require("adaptive_eval.slow", 0 <= a.slow < a.fast, "must be >= 0 and < adaptive_eval.fast")
    if cfg.guard is not None:
        g = cfg.guard
        require("guard.max_consecutive", g.max_consecutive >= 1, "must be >= 1")
        require("guard.spike_factor", g.spike_factor == 0 or g.spike_factor > 1, "must be 0 (off) or > 1")
        require("guard.spike_ema", 0 < g.spike_ema < 1, "must be in (0, 1)")
    if cfg.watchdog is not None:
        require("watchdog.timeout_s", cfg.watchdog.timeout_s > 0, "must be > 0")
        require("watchdog.timeout_s", cfg.watchdog.timeout_s < cfg.trainer.ddp_timeout,
                f"must be below trainer.ddp_timeout ({cfg.trainer.ddp_timeout}), else the collective times "
                "out first and no stacks are dumped")
    for name in ("early_stopping", "lr_plateau", "curriculum", "adaptive_eval"):
        require(name, cfg[name] is None or cfg.data.eval_file is not None, "needs evaluation data (data.eval_file)")
    require("eval_buckets", list(cfg.eval_buckets) == sorted(cfg.eval_buckets), "bucket edges must be increasing")

    require("model.dtype", cfg.model.dtype in ("float32", "bfloat16", "float16"),
            "must be float32, bfloat16 or float16")
    require("model.quantization", cfg.model.quantization in (None, "nf4"), "must be null or nf4")
    if cfg.model.quantization is not None:
        require("model.quantization", cfg.lora is not None, "a quantized base trains only with LoRA (lora=qlora)")
        require("model.quantization", _cuda_available(),
                "4-bit QLoRA needs a CUDA GPU (bitsandbytes); this machine has none: use lora=default")
        require("model.quantization", _installed("bitsandbytes"), "needs bitsandbytes: pip install bitsandbytes")

    if cfg.lora is not None:
        require("lora.r", cfg.lora.r >= 1, "must be >= 1")
        require("lora.lora_alpha", cfg.lora.lora_alpha > 0, "must be > 0")
        require("lora.lora_dropout", 0 <= cfg.lora.lora_dropout < 1, "must be in [0, 1)")

    if cfg.deepspeed is not None:
        zero = cfg.deepspeed.get("zero_optimization") or {}
        stage = zero.get("stage", 0)
        require("deepspeed.zero_optimization.stage", stage in (0, 1, 2, 3), "must be 0, 1, 2 or 3")
        if stage == 3:
            require("deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save",
                    zero.get("stage3_gather_16bit_weights_on_model_save") is True,
                    "must be true with ZeRO-3, else the saved model or LoRA adapter is empty")
        require("deepspeed.zero_optimization.offload_param", stage == 3 or "offload_param" not in zero,
                "parameter offload needs ZeRO stage 3")
        require("deepspeed", cfg.model.quantization is None, "DeepSpeed ZeRO does not shard a 4-bit base model")

    require("resume", cfg.resume in (None, "auto") or Path(cfg.resume).is_dir(),
            "must be null, 'auto' or an existing checkpoint directory")
