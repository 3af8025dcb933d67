"""What a `WeightedLossTrainer` is built from beside Trainer's own arguments: a few named parts, each made from its
own config section by `sft.run.build`, each read by the trainer's class that owns it.

    WeightedLossTrainer(model=..., args=..., train_dataset=..., data_collator=..., processing_class=...,
                        loss=build_loss(cfg.loss),                                  the weighted loss (sft.loss)
                        step=StepParts.of(cfg.trainer, clip_policy, controllers),  a step's control (trainer.py)
                        evaluation=EvaluationParts(...),                           sft.training.evaluation
                        checkpoints=CheckpointConfig(...),                         sft.training.checkpoints.saving
                        shows=Display(console, throughput))                        what a run shows

Every part has defaults: `WeightedLossTrainer(model=..., args=..., loss=...)` is a run without clipping, controllers,
evaluation extras, background checkpoints or throughput lines beyond Trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sft.eval.harness import EvalHarness
    from sft.eval.samples import EvalGeneration
    from sft.training.controllers.base import Controller
    from sft.training.observability.throughput import ThroughputMeter
    from sft.training.step.clipping import GradClipPolicy


@dataclass
class StepParts:
    """A step's control: the clip policy and the controllers that judge, skip and clip each step
    (`sft.training.step.control`), the fp32 copies pure bf16 steps (`master_weights`: `trainer.precision=pure`), how a
    micro-batch is cut (an out-of-memory error retried in pieces, `oom_retry`; a packed micro-batch trained in pieces
    of at most `micro_batch_tokens`: `sft.training.step.micro_batches`), the ranks that split each sequence
    (`sequence_parallel`: `sp.size`), the training sources' names (the rows of a bad step are named by them) and
    whether Muon steps the matrices (`muon`: `trainer.optim=muon`, `sft.training.step.muon`)."""

    clip_policy: GradClipPolicy | None = None
    controllers: dict[str, Controller] = field(default_factory=dict)
    master_weights: bool = False
    oom_retry: bool = True
    micro_batch_tokens: int | None = None
    sequence_parallel: int = 1
    sources: list[str] = field(default_factory=list)
    muon: bool = False

    @classmethod
    def of(cls, trainer, clip_policy: GradClipPolicy, controllers: dict[str, Controller], **rest) -> StepParts:
        """From the `trainer` section (`precision`, `oom_retry`, `optim`), the clip policy (`clip`) and the controllers
        (`controllers`); `rest`: what the run decided (the memory plan's `micro_batch_tokens`, `sequence_parallel`,
        `sources`)."""
        return cls(clip_policy, controllers, master_weights=trainer.precision == "pure", oom_retry=trainer.oom_retry,
                   muon=trainer.optim == "muon", **rest)


@dataclass
class EvaluationParts:
    """What an evaluation reports beside its exact loss (`sft.training.evaluation`): the unweighted loss per difficulty
    bucket cut at `buckets` (`eval_buckets`), greedy samples (`generation`: `eval_generation`), benchmarks every k-th
    evaluation (`harness`: `eval_harness`), and a mixture's task of each source number (`tasks`: the loss per
    task)."""

    buckets: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.0])
    generation: EvalGeneration | None = None
    harness: EvalHarness | None = None
    tasks: dict[int, str] = field(default_factory=dict)


@dataclass
class Display:
    """What a run shows (`sft.training.observability`): the console's lines (`console`: short or json) and the
    throughput values of every log (`throughput`: tokens/s, MFU)."""

    console: str = "short"
    throughput: ThroughputMeter | None = None
