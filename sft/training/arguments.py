"""The `trainer` group: every field of `transformers.TrainingArguments` (`TrainerConfig`, its fields generated from
the installed transformers into `sft/training/trainer_fields.py` with their help) and the arguments the recipe
builds from it (`training_arguments`). `python -m sft.config` writes the fields anew for another transformers."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional

from sft.config.schema import Choice, ConfigError, Schema, config_schema, cuda_available, knob, missing
from sft.training.trainer_fields import GENERATED_FROM, TrainingArgumentsFields

log = logging.getLogger("sft")

# The peak learning rates of trainer.learning_rate=null for a real model (the embedded tiny one has its own,
# sft.model.loading.TINY_LEARNING_RATE): TRL's SFTTrainer default for a full fine-tune, and the rate of PEFT's and
# TRL's LoRA recipes. Measured on SmolLM2-135M-Instruct and Gemma-3-270M (docs/models.md): both train without
# diverging, full and LoRA, where SmolLM2's full fine-tune at 2e-3 (the tiny model's) blows up at its third step.
FULL_FINE_TUNE_LEARNING_RATE = 2e-5
LORA_LEARNING_RATE = 2e-4

# report_to entries and the module each needs ("module pip-name" where they differ)
TRACKER_PACKAGES = {"mlflow": "mlflow mlflow-skinny", "wandb": "wandb", "tensorboard": "tensorboard",
                    "comet_ml": "comet_ml comet-ml", "clearml": "clearml", "neptune": "neptune", "dvclive": "dvclive",
                    "trackio": "trackio", "swanlab": "swanlab", "codecarbon": "codecarbon", "azure_ml": "azureml",
                    "dagshub": "dagshub", "flyte": "flytekit", "kubeflow": None}
REPORT_TO_WORDS = ("all", "none")  # transformers' own: every installed tracker, or none


class Precision(Choice):
    """`trainer.precision` with bf16 (`sft.training.step.master_weights`)."""

    mixed = "mixed"
    pure = "pure"


@config_schema("trainer", "trainer")
@dataclass
class TrainerConfig(TrainingArgumentsFields, Schema):
    """Every field of `transformers.TrainingArguments`, passed to it as they are; below, those whose default is this
    project's, with their checks. The fields the recipe sets itself are refused (`owned_fields`), naming the knob
    that replaces each; the recipe's own knobs here (`sft_fields`) become TrainingArguments through it."""

    # TrainingArguments fields that the recipe sets itself, and the sft knob for each
    owned_fields: ClassVar[Dict[str, str]] = {
        "max_grad_norm": "set by the clip policy: clip=static clip.max_norm=0.5 (or clip=autoclip, zclip, none)",
        "remove_unused_columns": "always false: the loss needs its weights column, and the collator passes the "
                                 "model only what its forward takes",
        "label_names": "always [labels]",
        "eval_on_start": "set by the recipe: an evaluation at step 0 whenever data.eval_file is set and the run "
                         "does not resume",
        "include_num_input_tokens_seen": "always non_padding (the throughput figures count real tokens)",
        "deepspeed": "the deepspeed group: deepspeed=zero2, zero3, zero3_offload, or file deepspeed.path=ds.json "
                     "(and deepspeed.<key>=...)",
        "gradient_checkpointing": "use trainer.activation_checkpointing=true (its kwargs set by the recipe)",
        "activation_checkpointing_kwargs": "set by the recipe (use_reentrant=false) for trainer.activation_checkpointing, "
                                           "and offload=true for trainer.activation_offloading",
        "gradient_checkpointing_kwargs": "set by the recipe (use_reentrant=false) for trainer.activation_checkpointing",
        "resume_from_checkpoint": "use resume=auto (the newest complete checkpoint) or resume=<checkpoint dir>",
        "fsdp": "the fsdp group: fsdp=full_shard or full_shard_offload (and fsdp.<key>=...)",
        "fsdp_config": "the fsdp group: fsdp=full_shard or full_shard_offload (and fsdp.<key>=...)",
        "parallelism_config": "an accelerate ParallelismConfig object, which a config cannot hold: sp=ulysses "
                              "sp.size=2 splits sequences over ranks; fsdp=full_shard (or deepspeed=zero3) shards "
                              "the weights over all processes",
    }

    output_dir: Optional[str] = knob(None, "where checkpoints go; null: the Hydra run dir")
    per_device_train_batch_size: int = knob(16, "rows (or packed rows) per micro-batch on each device")
    per_device_eval_batch_size: int = knob(32, "rows per evaluation batch on each device")
    gradient_accumulation_steps: int = knob(1, "micro-batches per optimizer step (the loss is exact over them)")
    learning_rate: Optional[float] = knob(None, "the peak learning rate; null: a real model's, 2e-5 for a full "
                                          "fine-tune and 2e-4 with LoRA (the embedded tiny model's: 2e-3)")
    weight_decay: float = knob(0.0, "AdamW's weight decay")
    adam_beta1: float = knob(0.9, "AdamW's beta1")
    adam_beta2: float = knob(0.98, "AdamW's beta2")
    adam_epsilon: float = knob(1e-8, "AdamW's epsilon")
    optim: Optional[str] = knob(None, "transformers' optimizer name, or muon (sft.training.step.muon: Muon on the "
                                "layers' matrices, AdamW on the rest); null: adamw_torch_fused on a GPU (AdamW's update "
                                "of every parameter in one kernel launch), adamw_torch on a CPU")
    num_train_epochs: float = knob(6.0, "epochs, where max_steps is -1")
    max_steps: int = knob(-1, "optimizer steps (-1: by epochs)")
    lr_scheduler_type: str = knob("cosine", "transformers' scheduler name")
    warmup_steps: float = knob(0.05, "warmup steps (a fraction of the training below 1)")
    logging_steps: float = knob(10, "steps between training logs")
    logging_first_step: bool = knob(True, "log the first step too")
    eval_strategy: str = knob("steps", "steps | epoch | no (no: no evaluation at all)")
    eval_steps: Optional[float] = knob(200, "steps between evaluations")
    save_strategy: str = knob("steps", "steps | epoch | no")
    save_steps: float = knob(200, "steps between checkpoints")
    save_total_limit: Optional[int] = knob(3, "complete checkpoints kept (the newest; null: all)")
    load_best_model_at_end: bool = knob(False, "load the checkpoint of the best metric_for_best_model at the end")
    metric_for_best_model: Optional[str] = knob(None, "with load_best_model_at_end")
    greater_is_better: Optional[bool] = knob(None, "with metric_for_best_model")
    seed: int = knob(42, "seeds data order, dropout and adapter initialisation")
    data_seed: Optional[int] = knob(None, "seeds the data order alone (null: seed)")
    full_determinism: bool = knob(False, "transformers' deterministic algorithms (slower)")
    bf16: bool = knob(False, "bf16 mixed precision (autocast; fp32 master weights and optimizer state): on a GPU, or "
                            "a CPU with bf16 instructions (AVX512-BF16, AMX, Arm BF16)")
    fp16: bool = knob(False, "fp16 mixed precision with a loss scaler (GPU)")
    activation_checkpointing: Optional[bool] = knob(None, "recompute each layer's activations in the backward: less "
                                                    "memory, about a third more compute; null: on only where the step "
                                                    "would not fit without it (sft.run.memory_plan)")
    dataloader_pin_memory: bool = knob(True, "pinned host memory (on GPU only)")
    torch_compile: bool = knob(False, "torch.compile the model")
    train_sampling_strategy: str = knob("random", "transformers' sampling of training rows")
    dataloader_num_workers: Optional[int] = knob(None, "data loader worker processes; null: 2 on a GPU (the "
                                                 "collator's work, batching and finding the trained tokens, beside the "
                                                 "step instead of before it), none on a CPU (its cores train)")
    report_to: List[str] = knob(help="trackers: tensorboard, wandb, mlflow, ... ([] for none)",
                                factory=lambda: ["tensorboard"])
    run_name: Optional[str] = knob(None, "the trackers' run name")
    logging_nan_inf_filter: bool = knob(False, "True would hide a NaN loss from the log, not from the update")
    disable_tqdm: Optional[bool] = knob(None, "no progress bar (null: none where stderr is no terminal, each log then a "
                                        "line of numbers in train.log)")
    log_level: str = knob("passive", "transformers' log level")
    ddp_timeout: int = knob(1800, "seconds a collective may wait")
    ddp_backend: Optional[str] = knob(None, "null: nccl on GPU, gloo on CPU")
    use_cpu: bool = knob(False, "train on the CPU even where there is a GPU")
    # sft's own knobs, not TrainingArguments fields: each becomes TrainingArguments through the recipe
    sft_fields: ClassVar[Dict[str, str]] = {"activation_offloading": "activation_checkpointing_kwargs' offload",
                                            "precision": "the linear layers' dtype and the optimizer's fp32 copies",
                                            "oom_retry": "WeightedLossTrainer's micro-batch pieces",
                                            "fit_micro_batch": "per_device_train_batch_size and "
                                                               "gradient_accumulation_steps (sft.run.memory_plan)",
                                            "memory_limit_gib": "the limit the memory plan fits the step in",
                                            "micro_batch_tokens": "WeightedLossTrainer's pieces of a packed "
                                                                  "micro-batch",
                                            "compile_layers": "torch.compile of each decoder layer (sft.run.build)"}
    precision: Precision = knob(Precision.mixed, "with bf16: mixed (fp32 weights, each linear layer's cast to "
                                "bf16 in every forward) or pure (the linear layers' weights held in bf16, the "
                                "optimizer stepping fp32 copies of them: the same step without the casts or the fp32 "
                                "copy of a frozen base; sft.training.step.master_weights; one process)")
    oom_retry: bool = knob(True, "on a CUDA out-of-memory error in a micro-batch, train the step again with every "
                           "micro-batch in twice as many pieces (a packed one: pieces of half the tokens), and go on "
                           "so (the step's rows, loss and update unchanged; logged, kept on resume; "
                           "sft.training.step.micro_batches; one process)")
    fit_micro_batch: bool = knob(True, "before the first step, split the step's rows (per_device_train_batch_size x "
                                 "gradient_accumulation_steps) into the largest micro-batches the memory estimate "
                                 "fits in the limit; packed, in one process: the step's rows in one micro-batch, "
                                 "trained in pieces of as many tokens as fit (the step's rows, loss and update "
                                 "unchanged; on a GPU, or with memory_limit_gib; sft.run.memory_plan); false: the "
                                 "split as set")
    micro_batch_tokens: Optional[int] = knob(None, "with data.packing: train each packed micro-batch in pieces of "
                                             "consecutive samples of at most this many tokens (a longer sample "
                                             "alone; the step's rows, loss and update unchanged; one process); "
                                             "null: as many as the memory plan fits (fit_micro_batch), or whole")
    memory_limit_gib: Optional[float] = knob(None, "the memory a step may fill, in GiB; null: 90% of the GPU's (on a "
                                             "CPU: none, nothing fitted)")
    compile_layers: bool = knob(False, "torch.compile each decoder layer in place (regional compilation: one cold "
                                "start for all layers, their kernels fused); for the families checked exact "
                                "(sft.model.compile.COMPILE_CHECKED), one process or DDP")
    activation_offloading: bool = knob(False, "hold the activation checkpoints in pinned host memory from the forward "
                                       "to the backward (transformers' offload): frees layers x tokens x hidden of "
                                       "GPU memory, a slower step; with activation_checkpointing")

    def check(self, cfg=None):
        import math

        self.require("learning_rate", self.learning_rate is None or (math.isfinite(self.learning_rate)
                                                                     and self.learning_rate > 0),
                     "must be a finite number > 0 (or null: a real model's default)")
        for key in ("save_steps", "eval_steps", "logging_steps"):
            value = getattr(self, key)
            self.require(key, value is None or (math.isfinite(value) and value > 0),
                         "must be > 0 (below 1: a fraction of the training's steps)")
        self.require("weight_decay", self.weight_decay >= 0, "must be >= 0")
        for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            self.require(key, getattr(self, key) >= 1, "must be >= 1")
        self.require("max_steps", self.max_steps == -1 or self.max_steps > 0, "must be > 0, or -1 to use epochs")
        self.require("num_train_epochs", math.isfinite(self.num_train_epochs) and self.num_train_epochs > 0,
                     "must be a finite number > 0")
        for key in ("adam_beta1", "adam_beta2"):  # torch's AdamW refuses others only when it is built
            self.require(key, 0 <= getattr(self, key) < 1, "must be in [0, 1)")
        self.require("adam_epsilon", self.adam_epsilon >= 0, "must be >= 0")
        for key in ("seed", "data_seed"):
            value = getattr(self, key)
            self.require(key, value is None or 0 <= value < 2**32, "must be in [0, 2**32 - 1] (numpy's seeds)")
        self.require("dataloader_num_workers", self.dataloader_num_workers is None or self.dataloader_num_workers >= 0,
                     "must be >= 0 (0: no worker processes; null: 2 on a GPU)")
        if self.lr_scheduler_kwargs:
            self.check_scheduler_kwargs()
        if self.optim_args:
            value = r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[Tt]rue|[Ff]alse|[Nn]one"  # what optimizers cast them to
            self.require("optim_args", all(re.fullmatch(rf"\s*\w+\s*=\s*({value})\s*", part)
                                           for part in self.optim_args.split(",")),
                         "must be key=value pairs separated by commas, each value a number, true or false "
                         "(momentum=0.9,nesterov=true)")
        self.require("save_total_limit", self.save_total_limit is None or self.save_total_limit >= 1,
                     "must be >= 1 (or null to keep every checkpoint)")
        self.require("fp16", not (self.fp16 and self.bf16), "fp16 and bf16 cannot both be on")
        if self.use_liger_kernel:
            from sft.model.liger import LOSS_KERNELS

            self.require("use_liger_kernel", cuda_available() and not self.use_cpu,
                         "Liger's kernels are Triton's, which run on a CUDA GPU: set it to false on a CPU")
            asked = self.liger_kernel_config or {}
            self.require("liger_kernel_config", not any(asked.get(k) for k in LOSS_KERNELS),
                         "sft computes the loss from the decoder's output itself: Liger's cross entropy stays off "
                         "(loss.impl=liger is its fused linear cross entropy, per token)")
        self.require("micro_batch_tokens", self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
                     "must be >= 1 (or null)")
        if self.micro_batch_tokens is not None and cfg is not None:
            self.require("micro_batch_tokens", bool(cfg.data.get("packing")), "cuts packed micro-batches only: set "
                         "data.packing=true too (or null)")
        self.require("memory_limit_gib", self.memory_limit_gib is None or (math.isfinite(self.memory_limit_gib)
                                                                           and self.memory_limit_gib > 0),
                     "must be a number of GiB > 0 (or null: 90% of the GPU's memory)")
        if self.bf16 and (self.use_cpu or not cuda_available()):
            from sft.training.processes.precision import NO_BF16_CPU, cpu_bf16_instructions

            self.require("bf16", cpu_bf16_instructions() is not None, NO_BF16_CPU)
        self.check_precision(cfg)
        if self.optim == MUON:
            self.check_muon(cfg)
        if self.activation_offloading:
            self.require("activation_offloading", self.activation_checkpointing,
                         "offloads the activation checkpoints: set trainer.activation_checkpointing=true too")
            self.require("activation_offloading", cfg is None or cfg.fsdp is None,
                         "FSDP2 checkpoints activations its own way, which transformers' offload does not reach: "
                         "use deepspeed=zero3 (or fsdp=full_shard without it)")
            self.require("activation_offloading", cuda_available() and not self.use_cpu,
                         "moves activations from the GPU to host memory (pinned, which needs a GPU); on a CPU they "
                         "are in host memory already: set it to false")
        for tracker in [self.report_to] if isinstance(self.report_to, str) else (self.report_to or []):
            self.require("report_to", tracker in TRACKER_PACKAGES or tracker in REPORT_TO_WORDS,
                         f"{tracker!r} is not a tracker transformers knows (one of "
                         f"{', '.join(sorted(TRACKER_PACKAGES))}; all; none)")
            absent = missing(TRACKER_PACKAGES[tracker]) if TRACKER_PACKAGES.get(tracker) else None
            self.require("report_to", absent is None, f"{tracker} is not installed: pip install {(absent or '?')[-1]}")


    def check_precision(self, cfg) -> None:
        if self.precision != Precision.pure:
            return
        self.require("precision", self.bf16, "holds the linear layers' weights in bf16 under bf16 autocast: set "
                     "trainer.bf16=true too")
        if cfg is None:
            return
        self.require("precision", not cfg.deepspeed, "DeepSpeed's bf16 keeps fp32 master weights of its own "
                     "(trainer.bf16=true is that already): set trainer.precision=mixed")
        self.require("precision", cfg.fsdp is None, "FSDP2 reduce-scatters the parameters' own gradients, which pure "
                     "hands to the optimizer's fp32 copies: one process only; set trainer.precision=mixed")

    def check_muon(self, cfg) -> None:
        from sft.training.step.muon import muon_missing

        self.require("optim", muon_missing() is None, str(muon_missing()))
        self.require("optim", self.precision != Precision.pure, "Muon steps the parameters themselves, not pure's "
                     "fp32 copies: set trainer.precision=mixed")
        if cfg is not None:
            self.require("optim", not cfg.deepspeed, "DeepSpeed builds and shards its own optimizer, and Muon needs "
                         "each matrix whole: use fsdp=none deepspeed=none (DDP) with muon")
            self.require("optim", cfg.fsdp is None, "FSDP2 shards each matrix over the ranks, and Muon orthogonalises "
                         "whole matrices: use DDP (fsdp=none) with muon")

    def check_scheduler_kwargs(self) -> None:
        """`lr_scheduler_kwargs` must be parameters of the schedule `lr_scheduler_type` builds (transformers' function
        for it), which would otherwise fail when the schedule is made, after the model and data."""
        import inspect

        from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
        from transformers.trainer_utils import SchedulerType

        try:
            function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(str(self.lr_scheduler_type))]
        except (ValueError, KeyError):
            return  # an unknown type: TrainingArguments names it
        params = inspect.signature(function).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        own = [name for name in params if name not in ("optimizer", "num_warmup_steps", "num_training_steps")]
        for key in self.lr_scheduler_kwargs:
            self.require("lr_scheduler_kwargs", key in own, f"{key} is not a parameter of the {self.lr_scheduler_type} "
                         f"schedule ({function.__name__} takes: {', '.join(own) or 'none'})")


def trainer_fields_source() -> str:
    """The source of `sft/training/trainer_fields.py`: a schema of every `TrainingArguments` field of the installed
    transformers that the recipe does not own, with its type as OmegaConf can hold it (a union of other types, a
    dict or a list: `Any`), its default and its help. `python -m sft.config` writes it; a test compares it."""
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
             'recipe owns (`TrainerConfig.owned_fields`), with transformers\' own help: generated by `python -m',
             'sft.config`, do not edit; a test fails when the installed transformers adds, removes or changes a',
             'field."""',
             "", "from __future__ import annotations", "", "from dataclasses import dataclass, field",
             "from typing import Any, Optional", "", f"GENERATED_FROM = {transformers.__version__!r}  # transformers",
             "", "", "@dataclass", "class TrainingArgumentsFields:"]
    for f in dataclasses.fields(TrainingArguments):
        if not f.init or f.name in TrainerConfig.owned_fields:
            continue
        if f.default is not dataclasses.MISSING:
            default = f"default={f.default.value if isinstance(f.default, enum.Enum) else f.default!r}"
        else:
            default = f"default_factory=lambda: {f.default_factory()!r}"
        help_text = " ".join(str(f.metadata.get("help", "")).split())
        lines.append(f"    {f.name}: {annotation(f.type)} = field({default}, metadata={{'help': {help_text!r}}})")
    return "\n".join(lines) + "\n"


def training_arguments(trainer, run_dir: str, *, resuming: bool, max_grad_norm: float, learning_rate: float,
                       evaluates: bool, streaming: bool = False, deepspeed=None, fsdp=None, sharded: bool = False):
    """`TrainingArguments` from the `trainer` section, plus what the run decides of them: the clip policy's first
    threshold (`max_grad_norm`), the peak `learning_rate` (a null's resolved), whether it `evaluates`, a stream's
    resume (`streaming`), the engine's fields (the `deepspeed` and `fsdp` sections; `sharded` checkpoints)."""
    import torch
    from omegaconf import OmegaConf
    from transformers import TrainingArguments

    from sft.training.processes.distributed import process_fields
    from sft.training.processes.engines import announce_deepspeed_comm_build, fsdp_fields

    fields = OmegaConf.to_container(trainer, resolve=True)
    offload = fields.pop("activation_offloading")  # TrainerConfig.sft_fields
    fields.pop("precision")  # the linear layers' dtype (sft.run.build) and the trainer's master weights
    fields.pop("oom_retry")  # the trainer's
    # sft.run.memory_plan's: it changes the fields below
    fields.pop("fit_micro_batch"), fields.pop("memory_limit_gib"), fields.pop("micro_batch_tokens")
    fields.pop("compile_layers")  # sft.run.build's
    fields["learning_rate"] = learning_rate
    fields["output_dir"] = fields["output_dir"] or run_dir
    fields["save_total_limit"] = None  # sft.training.checkpoints.store rotates, counting complete checkpoints only
    on_gpu = torch.cuda.is_available()
    fields["dataloader_pin_memory"] &= on_gpu  # pinning without a GPU only warns
    if not evaluates:
        fields["eval_strategy"] = "no"
    fields.update(process_fields(deepspeed=bool(deepspeed), fsdp=fsdp is not None, on_gpu=on_gpu))
    if fields["bf16"] and not on_gpu:  # transformers takes bf16 on a CPU only with use_cpu (checked: it has bf16)
        fields["use_cpu"] = True
    resolve_nulls(fields, on_gpu)
    if fields["use_liger_kernel"]:  # the decoder layers' kernels only (sft.model.liger)
        from sft.model.liger import liger_config

        fields["liger_kernel_config"] = liger_config(fields["liger_kernel_config"])
    if streaming:  # the stream resumes at its saved position itself (sft.data.splits.streaming), not by skipping
        fields["ignore_data_skip"] = True
    if fsdp is not None:
        fields.update(fsdp_fields(fsdp, fields["activation_checkpointing"], sharded))
    if fields.get("disable_tqdm") is None:  # no bars where nobody watches them (sft.training.observability.step_log)
        from sft.training.observability.step_log import has_terminal

        fields["disable_tqdm"] = not has_terminal()
    check_installed_fields(fields)
    if fields.get("hub_token"):  # the Hub client reads HF_TOKEN; TrainingArguments is pickled into every checkpoint
        os.environ["HF_TOKEN"] = fields["hub_token"]
        fields["hub_token"] = None
    if deepspeed:  # accelerate starts deepspeed.comm with the arguments
        announce_deepspeed_comm_build()
    try:
        return TrainingArguments(
            **fields,
            max_grad_norm=max_grad_norm,  # the clip policy's; sft.training.step.control moves it as the policy says
            remove_unused_columns=False,  # weights must reach compute_loss; the collator drops the rest
            label_names=["labels"],
            include_num_input_tokens_seen="non_padding",
            eval_on_start=evaluates and not resuming,
            activation_checkpointing_kwargs=({"use_reentrant": False, **({"offload": True} if offload else {})}
                                             if fields["activation_checkpointing"] else None),
            deepspeed=OmegaConf.to_container(deepspeed, resolve=True) if deepspeed else None,
        )
    except ValueError as e:
        raise ConfigError(*field_of_error(str(e).splitlines()[0], fields)) from e


def resolve_nulls(fields: dict, on_gpu: bool) -> None:
    """What a null of the `trainer` group stands for where TrainingArguments takes none: the optimizer
    (`optimizer_name`), activation checkpointing (off, until the memory plan turns it on: sft.run.memory_plan) and the
    data loader's workers (2 on a GPU, none on a CPU)."""
    gpu = on_gpu and not fields["use_cpu"]
    fields["optim"] = optimizer_name(fields["optim"], gpu)
    fields["activation_checkpointing"] = bool(fields["activation_checkpointing"])
    if fields.get("dataloader_num_workers", 0) is None:
        fields["dataloader_num_workers"] = GPU_LOADER_WORKERS if gpu else 0


MUON = "muon"  # trainer.optim: sft.training.step.muon's optimizer, which TrainingArguments does not name
GPU_LOADER_WORKERS = 2  # a null `trainer.dataloader_num_workers` on a GPU


def optimizer_name(optim: str | None, on_gpu: bool) -> str:
    """`trainer.optim`, where null: AdamW fused into one kernel launch per step on a GPU (PyTorch's
    `fused=True`, the same update as the per-tensor one to rounding), the multi-tensor one on a CPU (fused there too
    since PyTorch 2.4, kept as the CPU runs' reference)."""
    if optim == MUON:  # the AdamW half's settings go to TrainingArguments; the trainer builds the optimizer
        return "adamw_torch"
    return optim or ("adamw_torch_fused" if on_gpu else "adamw_torch")


def learning_rate(cfg, rate: float | None = None) -> float:
    """The peak learning rate `rate` (`trainer.learning_rate` where not given) stands for: itself, or where it is null
    the embedded tiny model's (`model.name_or_path=tiny`, random architectures built on its tokenizer included), else
    a real model's, 2e-4 with LoRA and 2e-5 for a full fine-tune. Decided by the model, not by which model file the
    config names: `model.name_or_path=<a real model's dir>` gets a real model's rate."""
    from sft.model.loading import TINY, TINY_LEARNING_RATE

    rate = cfg.trainer.learning_rate if rate is None else rate
    if rate is not None:
        return rate
    if cfg.model.name_or_path == TINY and not cfg.model.gguf_file:
        return TINY_LEARNING_RATE
    return LORA_LEARNING_RATE if cfg.lora is not None else FULL_FINE_TUNE_LEARNING_RATE


def resolve_learning_rate(cfg) -> None:
    """Set a null `trainer.learning_rate` to the rate it stands for (`learning_rate`), and say so: the run's checkpoints,
    results and a later resume then record and compare the rate it trained at."""
    if cfg.trainer.learning_rate is None:
        from sft.model.loading import TINY

        which = ("the embedded tiny model's rate" if cfg.model.name_or_path == TINY and not cfg.model.gguf_file else
                 f"a real model's rate {'with LoRA' if cfg.lora is not None else 'for a full fine-tune'}")
        cfg.trainer.learning_rate = learning_rate(cfg)
        log.info("trainer.learning_rate: %g (null: %s)", cfg.trainer.learning_rate, which)


def check_installed_fields(fields: dict) -> None:
    """The trainer schema is generated from one transformers (`trainer_fields.py`): another one installed may
    lack a field, which TrainingArguments would refuse with a TypeError. One config error naming the fields and
    the versions instead."""
    import dataclasses

    import transformers
    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    lacking = sorted(set(fields) - known)
    if lacking:
        raise ConfigError("trainer", None, f"the installed transformers {transformers.__version__} has no "
                          f"{', '.join(lacking)}: sft's trainer fields are transformers {GENERATED_FROM}'s "
                          f"(pip install 'transformers=={GENERATED_FROM}', the version pyproject.toml pins)")


def field_of_error(message: str, fields: dict) -> tuple[str, object, str]:
    """(knob, value, reason) of a `TrainingArguments` error: an enum's `bogus is not a valid SchedulerType` names
    the field that holds `bogus`; any other message names the group."""
    import re

    invalid = re.match(r"'?(.+?)'? is not a valid (\w+)", message)
    named = [k for k, v in fields.items() if invalid and isinstance(v, str) and v == invalid.group(1)]
    if named:
        choices = re.search(r"select one of (\[.*\])", message)
        return f"trainer.{named[0]}", invalid.group(1), (f"must be one of {choices.group(1)}" if choices
                                                         else f"not a valid {invalid.group(2)}")
    return "trainer", None, message


def evaluates(cfg) -> bool:
    """Whether the run evaluates at all: it has eval data and `trainer.eval_strategy` is not `no`."""
    return has_eval_data(cfg.data) and cfg.trainer.eval_strategy != "no"


def has_eval_data(data) -> bool:
    """Whether the `data` node names eval rows: `eval_file`, or a mixture source's."""
    return data.eval_file is not None or any(e.eval_file is not None for e in data.mixture)
