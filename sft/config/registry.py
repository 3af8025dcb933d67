"""The composition root: the primary schema (`TrainConfig`, one field per config group), every stage's schemas
gathered into Hydra's config store, and `compose`. A stage's schemas live beside the classes they configure
(`sft.data.spec`, `sft.loss.builtin`, `sft.training.step.clipping`, `sft.training.controllers.*` ...) and register
themselves with `config_schema`; importing them here is what makes `sft/conf/`'s `<name>_schema` entries resolve.

Each default is stated once, in those schemas: the YAML options of `sft/conf/` carry only what differs, and the
classes built from a node are the schemas themselves (or extend them), so `ZClip()` has ZClip's defaults and
checks. Nothing here imports torch or transformers, so that `--cfg job` and `--help` answer at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

import sft.training.controllers
from sft import sample_data
from sft.config.schema import SCHEMAS, Choice, Schema, config_schema, knob
from sft.data.spec import CollatorConfig, DataSpec
from sft.eval.generation import ExactMatchConfig
from sft.eval.harness import EvalHarness
from sft.eval.samples import EvalGeneration
from sft.experiments.sweep import SweepConfig
from sft.loss import builtin
from sft.model.loading import ModelConfig, TokenizerConfig
from sft.model.lora import LoraConfig
from sft.model.second_model import ReferenceConfig, TeacherConfig
from sft.training.arguments import TrainerConfig
from sft.training.checkpoints.sharded import CheckpointConfig
from sft.training.observability.throughput import ThroughputMeter
from sft.training.processes.engines import FsdpConfig, check_deepspeed, load_deepspeed_file
from sft.training.processes.sequence_parallel import SequenceParallelConfig
from sft.training.step import clipping

# Imported for their schemas, which each class's `@config_schema` registers as it is defined: the data, evaluation,
# model, second model, LoRA, trainer, checkpoint, FSDP schemas, and the modules of the built-in losses, controllers
# and clip policies.
REGISTERING = (CollatorConfig, DataSpec, ExactMatchConfig, EvalHarness, EvalGeneration, ModelConfig, TokenizerConfig,
               TeacherConfig, ReferenceConfig, LoraConfig, TrainerConfig, CheckpointConfig, FsdpConfig,
               SequenceParallelConfig, builtin, sft.training.controllers, clipping)

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # sft/conf/: the config groups, shipped in the package

class Console(Choice):
    short = "short"
    json = "json"


class CheckpointChecksums(Choice):
    small = "small"
    all = "all"


@config_schema(None, "train")
@dataclass
class TrainConfig(Schema):
    """The primary config: one field per group plus the few top-level switches."""

    model: Any = knob(MISSING, "the model group: sft/conf/model/")
    data: Any = knob(MISSING, "the data group: sft/conf/data/")
    loss: Any = knob(MISSING, "the loss group: sft/conf/loss/")
    teacher: Any = knob(None, "the teacher group: a frozen model the loss learns from (loss=distill), "
                        "+teacher=<option> (sft/conf/teacher/; null: none)")
    reference: Any = knob(None, "the reference group: a frozen model the loss stays near (loss=asft), "
                          "+reference=<option> (sft/conf/reference/; null: none)")
    lora: Any = knob(None, "the lora group (null: full fine-tuning)")
    deepspeed: Any = knob(None, "the deepspeed group: DeepSpeed's JSON as a dict (null: off)")
    fsdp: Any = knob(None, "the fsdp group (null: off)")
    sp: Any = knob(None, "the sp group: sequence parallelism (null: off)")
    trainer: Any = knob(MISSING, "the trainer group: TrainingArguments' fields")  # typed by trainer_schema
    clip: Any = knob(MISSING, "the clip group: the gradient clipping policy")
    controllers: Dict[str, Any] = knob(help="name -> a controller node (`_target_` + its knobs): sft/conf/controllers/, "
                                       "+controllers=<name>, ~controllers.<name>", factory=dict)
    tokenizer: TokenizerConfig = knob(help="the tokenizer and chat template", factory=TokenizerConfig)
    collator: CollatorConfig = knob(help="the batch collator", factory=CollatorConfig)
    eval_buckets: List[float] = knob(help="difficulty bucket edges of the eval metrics",
                                     factory=lambda: [1.0, 2.0, 3.0])
    exact_match: Any = knob(None, "exact_match=default: greedy exact match on the hardest bucket after training")
    eval_generation: Any = knob(None, "eval_generation=default: generation samples at evaluations")
    eval_harness: Any = knob(None, "eval_harness=sample (or your tasks): lm-evaluation-harness after training")
    sweep: SweepConfig = knob(help="how a multirun goes", factory=SweepConfig)
    throughput: ThroughputMeter = knob(help="the throughput and MFU figures", factory=ThroughputMeter)
    bench: Any = knob(None, "python -m sft.bench only: sft/conf/bench.yaml (sft.bench.config)")
    resume: Optional[str] = knob(None, "null (a fresh run), auto (the newest complete checkpoint in the run dir) "
                                 "or a checkpoint directory")
    resume_force: bool = knob(False, "resume even if the data or a fixed setting changed, or verification fails")
    trust_checkpoint: bool = knob(False, "resume=<a DeepSpeed checkpoint this run dir did not write>: DeepSpeed "
                                  "unpickles its files, which runs any code in them; true if you trust its maker")
    console: Console = knob(Console.short, "what the console shows of each log: short (one line a person reads: step, "
                            "loss, lr, grad norm, tok/s; every number goes to metrics.jsonl in the run dir) or json "
                            "(each log as one JSON line of numbers, for jq)")
    overwrite: bool = knob(False, "a new run into a dir holding another run's outputs: delete them (else refused)")
    checkpoint: CheckpointConfig = knob(help="how checkpoints are written: sharded or gathered, in the background",
                                        factory=CheckpointConfig)
    checkpoint_checksums: CheckpointChecksums = knob(CheckpointChecksums.all, "CRC-32s in each checkpoint's "
                                                     "manifest, verified on resume: all (every file; ~3 GB/s from "
                                                     "the page cache, the disk's speed otherwise) | small (files up "
                                                     "to 64 MiB; sizes of all)")
    signal_grace_s: float = knob(600.0, "SIGTERM/SIGINT: at most this long to finish the step and save a "
                                 "checkpoint (sft.training.step.preemption)")

    def check(self, cfg=None):
        self.require("eval_buckets", all(math.isfinite(edge) for edge in self.eval_buckets),
                     "bucket edges must be finite numbers")
        self.require("eval_buckets", list(self.eval_buckets) == sorted(self.eval_buckets),
                     "bucket edges must be increasing")
        self.require("resume", self.resume in (None, "auto") or Path(self.resume).is_dir(),
                     "must be null, 'auto' or an existing checkpoint directory")
        self.require("signal_grace_s", self.signal_grace_s > 0, "must be > 0")
        if cfg is not None and cfg.deepspeed is not None:  # DeepSpeed's dict has no schema: its rules are here
            load_deepspeed_file(cfg)
            check_deepspeed(cfg)


def register() -> None:
    """Store every schema in Hydra's config store and register the `${sft_sample:FILE}` resolver (the path of a
    bundled sample file)."""
    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("sft_sample"):
        OmegaConf.register_new_resolver("sft_sample", lambda name: str(sample_data.HERE / name))


def compose(config_name: str = "train", overrides: list[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """A config of `sft/conf/` composed as `python -m sft.train overrides...` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    register()
    # Inside a running Hydra app (a run writing its page: its recipe composes the defaults) that app's Hydra is put
    # aside meanwhile and given back, with its HydraConfig
    running = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    job_config = HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=list(overrides),
                                 return_hydra_config=return_hydra_config)
    finally:
        if running is not None:
            GlobalHydra.instance().initialize(running)
        HydraConfig.instance().cfg = job_config
