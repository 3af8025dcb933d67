"""What a run is made of: `build(cfg, run_dir)` makes the training arguments (before the model, as DeepSpeed ZeRO-3
requires), tokenizer, loss, controllers, model (+ LoRA), the second model a loss reads, data, collator and trainer,
as a `Recipe`, reading as their table of contents: the whole config stops here, each part getting its own sections.
The bench's cases build through it too, so that what they time is what a run trains."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from sft.config.schema import ConfigError
from sft.training.arguments import evaluates, learning_rate, training_arguments
from sft.training.checkpoints.sharded import CheckpointConfig, sharded
from sft.training.processes.engines import check_fsdp_layers
from sft.training.processes.sequence_parallel import sequence_parallel_size

if TYPE_CHECKING:
    from sft.data.load import SFTData
    from sft.training.trainer import WeightedLossTrainer

log = logging.getLogger("sft")

# Names a controller of yours cannot take: what every run puts under them in each checkpoint's state.
RESERVED_NAMES = {"preemption": "the controller every run has (SIGTERM: save and stop; signal_grace_s)",
                  "clip": "the clip policy's state in every checkpoint",
                  "trainer": "Trainer's state in every checkpoint"}


@dataclass
class Recipe:
    """What `build` makes from a config: the trainer and the parts the rest of the run needs."""

    trainer: WeightedLossTrainer
    data: SFTData
    tokenizer: object
    clip_policy: object
    controllers: dict


def build(cfg: DictConfig, run_dir: str, checkpoint: str | None = None, preemption=None) -> Recipe:
    """The run's parts in the order they must be made, each from its own config sections: the training arguments
    (before the model: ZeRO-3), the loss, the controllers, the model (+ LoRA), the data, the collator and the memory
    plan, then the trainer from its parts (`sft.training.parts`)."""
    from hydra.utils import instantiate
    from transformers import set_seed

    from sft.loss.base import build_loss
    from sft.model.compile import compile_layers
    from sft.model.reference_scores import weigh_by_reference
    from sft.model.second_model import load_second_model
    from sft.model.teacher_cache import cached_teacher
    from sft.run.memory_plan import fit_step_in_memory
    from sft.training.parts import Display, EvaluationParts, StepParts
    from sft.training.step.preemption import Preemption
    from sft.training.trainer import WeightedLossTrainer

    clip_policy = instantiate(cfg.clip)
    # 0 for a policy that does not clip (at first): Trainer then calls no clipping, and the step still goes to
    # WeightedLossTrainer._get_grad_norm (sft.training.step.control)
    args = arguments(cfg, run_dir, resuming=checkpoint is not None, max_grad_norm=clip_policy.initial_threshold())
    set_seed(args.seed)
    tokenizer = instantiate(cfg.tokenizer)
    loss = build_loss(cfg.loss)
    controllers = controllers_of(cfg.controllers)
    sequence_parallel = sequence_parallel_size(cfg)
    # The model before the data: what it refuses (packed rows it cannot keep apart, sft.model.packing) is refused
    # before any data is read. Seeded again: building a cached artefact (the tiny model, on first use) draws random
    # numbers, which would give the adapters (or a random-init model) other initial weights on the next run.
    set_seed(args.seed)
    model = build_model(cfg, args.activation_checkpointing, sequence_parallel)
    check_model_levers(cfg, args, model)
    # the frozen teacher or reference the loss reads at each step (the config allows one only where the loss reads it)
    second_model = (load_second_model(cfg[loss.second_model], loss.second_model, tokenizer, bool(cfg.data.packing))
                    if loss.reads_second_model_each_step and loss.loads_second_model else None)
    spec = instantiate(cfg.data, _convert_="object")  # a DataSpec
    data = load_data(spec, tokenizer, loss, controllers, args, run_dir)
    held = second_model  # the memory plan counts a model held beside the trained one, not a cache of its logits
    if loss.reads_second_model_each_step and not loss.loads_second_model:  # the teacher's logits from its cache
        with args.main_process_first(desc="teacher cache"):
            data, second_model = cached_teacher(data, loss.teacher_cache, loss.top_k, cfg.get(loss.second_model),
                                                args.seed)
    if loss.scores_before_training:  # static token weights from the reference, scored by the main process first
        with args.main_process_first(desc="reference scores"):
            data, _ = weigh_by_reference(data, loss, lambda: model, cfg.model, cfg[loss.second_model], tokenizer,
                                         bool(cfg.data.packing), args.seed, args.device)
    controllers["preemption"] = preemption or Preemption(grace_s=cfg.signal_grace_s)
    collator = instantiate(cfg.collator, tokenizer=tokenizer, sequence_parallel=sequence_parallel)
    # the micro-batch's rows and the activation checkpointing, into args before the trainer takes them; a packed
    # micro-batch's pieces
    micro_batch_tokens = fit_step_in_memory(cfg.trainer, spec, args, model, loss, data.train,
                                            collator.pad_to_multiple_of, engine=sharding_engine(cfg),
                                            second_model=held)
    trainer = WeightedLossTrainer(
        model=model, args=args, train_dataset=data.train, eval_dataset=data.eval, data_collator=collator,
        processing_class=tokenizer,
        loss=loss,
        second_model=second_model,
        step=StepParts.of(cfg.trainer, clip_policy, controllers, micro_batch_tokens=micro_batch_tokens,
                          sequence_parallel=sequence_parallel, sources=[str(part.train) for part in data.parts]),
        evaluation=EvaluationParts(list(cfg.eval_buckets), eval_generation(cfg, data), harness(cfg.eval_harness),
                                   data.tasks),
        checkpoints=CheckpointConfig(**OmegaConf.to_container(cfg.checkpoint, resolve=True)),
        shows=Display(str(cfg.console), instantiate(cfg.throughput)),
    )
    if cfg.trainer.compile_layers:  # after the trainer's probes (the memory plan's, the lean loss's) ran eager
        log.info("trainer.compile_layers: %d decoder layers compiled in place (torch.compile; the first steps "
                 "compile them)", compile_layers(trainer.model))
    return Recipe(trainer, data, tokenizer, clip_policy, controllers)


def arguments(cfg: DictConfig, run_dir: str, resuming: bool, max_grad_norm: float):
    """The run's `TrainingArguments`: the `trainer` section, with what the other sections decide of it (the
    learning rate a null stands for, whether the run evaluates, a stream's resume, the engine's fields)."""
    return training_arguments(cfg.trainer, run_dir, resuming=resuming, max_grad_norm=max_grad_norm,
                              learning_rate=learning_rate(cfg), evaluates=evaluates(cfg),
                              streaming=bool(cfg.data.streaming), deepspeed=cfg.deepspeed, fsdp=cfg.fsdp,
                              sharded=sharded(cfg))


def controllers_of(node) -> dict:
    """The `controllers` section's controllers, none of them under a name every run's checkpoints reserve."""
    from sft.training.controllers import build_controllers

    controllers = build_controllers(node)
    for name in RESERVED_NAMES.keys() & controllers.keys():  # each is a key of the checkpoints' state
        raise ConfigError(f"controllers.{name}", None, f"is the name of {RESERVED_NAMES[name]}: name yours otherwise")
    return controllers


def check_model_levers(cfg: DictConfig, args, model) -> None:
    """What the built model refuses of the speed levers asked for (compiled layers, Liger's kernels, FSDP's layers),
    in one line each; and whether DDP must look for unused parameters."""
    from sft.model.compile import compile_refusal
    from sft.model.liger import liger_refusal
    from sft.model.loading import may_leave_parameters_unused

    if cfg.trainer.compile_layers and (refusal := compile_refusal(model, bool(cfg.deepspeed), cfg.fsdp is not None,
                                                                  cfg.trainer.torch_compile)):
        raise ConfigError("trainer.compile_layers", True, refusal)
    if args.use_liger_kernel and (refusal := liger_refusal(model.config.model_type, cfg.trainer.compile_layers)):
        raise ConfigError("trainer.use_liger_kernel", True, refusal)
    if args.ddp_find_unused_parameters is None:
        # Transformers' default looks for unused parameters after every backward of a model without activation
        # checkpointing: an extra pass over the graph, and a warning from every rank that found none
        args.ddp_find_unused_parameters = may_leave_parameters_unused(model.config)
    check_fsdp_layers(cfg.fsdp, model)


def load_data(spec, tokenizer, loss, controllers: dict, args, run_dir: str) -> SFTData:
    """The train and eval splits of the `data` section (a `DataSpec`), preprocessed by the main process first, with
    the difficulty scores the loss and the controllers read; rejected rows into the run dir's `rejected.jsonl`."""
    from sft.data.load import load_sft_datasets
    from sft.data.tokens.weights import scores_used_by

    refuse_samplers_of_a_stream(spec, controllers)
    with args.main_process_first(desc="preprocessing"):
        data = load_sft_datasets(spec, tokenizer, loss, scores_needed_by=scores_used_by(loss, controllers),
                                 rejected_file=os.path.join(run_dir, "rejected.jsonl") if args.process_index == 0
                                 else None)
    log.info("data %s: %s", data.data_hash, data.counts())
    return data


def sharding_engine(cfg: DictConfig) -> str | None:
    """The engine that shards the run's step over ranks, which the memory plan has no estimate for: DeepSpeed, FSDP2
    or sequence parallelism; None for one process or DDP."""
    if cfg.deepspeed:
        return "DeepSpeed"
    if cfg.fsdp is not None:
        return "FSDP2"
    return "sequence parallelism" if sequence_parallel_size(cfg) > 1 else None


def harness(node):
    """The `eval_harness` section's benchmarks (`sft.eval.harness.EvalHarness`), or None."""
    from hydra.utils import instantiate

    return instantiate(node, _convert_="all") if node is not None else None


def refuse_samplers_of_a_stream(spec, controllers: dict) -> None:
    """A controller that samples the rows (`Controller.train_sampler`: the curriculum) has nothing to sample in a
    stream, read in file order: refused, never silently ignored."""
    from sft.training.controllers.base import Controller

    for name, controller in controllers.items():
        if spec.streaming and type(controller).train_sampler is not Controller.train_sampler:
            raise ConfigError("data.streaming", True, f"controllers.{name} chooses the rows it trains on "
                              "(train_sampler), which a stream read in file order cannot give it")


def build_model(cfg: DictConfig, activation_checkpointing: bool, sequence_parallel: int | None = None):
    """The model (+ LoRA) of the `model` and `lora` groups, with the attention packed batches need, for
    `sequence_parallel` ranks splitting each sequence (None: the `sp` section's)."""
    from hydra.utils import instantiate

    from sft.model.lora import apply_lora
    from sft.model.packing import check_packing

    attn = cfg.model.attn_implementation
    if cfg.data.packing and attn == "sdpa":  # sdpa would attend across the whole packed row, under a mask
        attn = "sdpa_varlen"
        log.info("data.packing: attention sdpa_varlen (sdpa per sample of the packed row)")
    if str(cfg.model.dtype) != "float32" and cfg.lora is None and not cfg.deepspeed:
        log.warning("model.dtype=%s with a full fine-tune: the optimizer steps %s weights, and drops every update "
                    "below their resolution (8 bits of mantissa in bf16); trainer.bf16=true trainer.precision=pure "
                    "keeps fp32 copies of them in the optimizer", cfg.model.dtype, cfg.model.dtype)
    if sequence_parallel is None:
        sequence_parallel = sequence_parallel_size(cfg)
    model = instantiate(cfg.model, attn_implementation=attn, sequence_parallel=sequence_parallel)
    if cfg.data.packing:
        check_packing(model)
    if cfg.lora is not None:
        from peft import prepare_model_for_kbit_training

        if cfg.model.quantization:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=activation_checkpointing)
        model = apply_lora(model, cfg.lora)
    if cfg.trainer.precision == "pure":  # the trainer then gives the optimizer fp32 copies of those it trains
        from sft.training.step.master_weights import hold_linear_weights_in_bf16

        held = hold_linear_weights_in_bf16(model)
        log.info("trainer.precision=pure: %d parameters (the linear layers') held in bf16, the rest in fp32", held)
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # ZeRO-3 shards
    total, trainable = sum(n for n, _ in sizes), sum(n for n, grad in sizes if grad)
    log.info("model: %d parameters, %d trainable (%.2f%%)", total, trainable, 100 * trainable / total)
    return model


def eval_generation(cfg: DictConfig, data: SFTData):
    """`sft.eval.samples.EvalGeneration` with its prompts chosen, where `eval_generation` is set and the run
    evaluates; else None."""
    from hydra.utils import instantiate

    if cfg.eval_generation is None or not evaluates(cfg):
        return None
    samples = instantiate(cfg.eval_generation, _convert_="all")
    samples.choose(data.eval_rows(), list(cfg.eval_buckets))
    return samples
