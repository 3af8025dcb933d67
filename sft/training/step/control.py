"""The fate of an optimizer step, decided in one place: judged, skipped or clipped, and reported.

`WeightedLossTrainer` delegates to a `StepControl` at three moments of each optimizer step, and tells it what it
needs of the step in a `StepContext` (it never reaches the trainer itself):

1. `begin` (from `get_batch_samples`, before the step's first forward): under DeepSpeed, whose engine
   clips inside its own step, the clip policy's threshold is set on the engine now, from history alone;
2. `add_micro_batch` (from `compute_loss`): the micro-batch's loss and per-row losses are kept, when a
   controller judges steps, for the verdict and, if the step is bad, its report;
3. `finish` (once the backward passes are done and right before `optimizer.step()`: from `_clip_grad_norm`, or
   from `_get_grad_norm` where the policy's first threshold is 0 and Trainer calls no clipping): the global
   pre-clip gradient norm is computed; one all-reduce tells every rank the step's loss and whether any rank's
   controller asked to stop (`Controller.requests_stop`: preemption's signal), so the judges and preemption
   share a collective; every controller with a `judge_step` gives its verdict; a skipped step drops its
   gradients (parameters, optimizer state and schedule stay as they are); otherwise the clip policy's threshold
   is applied; the policy observes the norm. A bad step's rows go to `<folder>/step-N.json` in the run dir and
   to the log (`StepReport`).

The private fields of accelerate and DeepSpeed this touches are written by `sft.training.compat`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.utils import gather_object

from sft.data.tokens.batch import packed_bounds
from sft.data.tokens.columns import row_scores
from sft.files import own_dir, own_path, write_text
from sft.training.compat import mark_update_skipped, set_deepspeed_clip
from sft.training.controllers.base import Controller, StepVerdict, implements
from sft.training.step.clipping import GradClipPolicy

log = logging.getLogger("sft")


@dataclass
class StepContext:
    """What step control is told of the step it finishes: its number, and the training objects it acts on."""

    step: int  # the optimizer step's number (1 for the first)
    accelerator: Any  # accelerate's Accelerator: the gradient norm (fp16 unscaled), the all-reduce, the scaler
    optimizer: Any  # the AcceleratedOptimizer
    engine: Any = None  # DeepSpeed's engine, under DeepSpeed (it clips inside its own step)
    master_weights: Any = None  # the optimizer's fp32 copies (trainer.precision=pure): they hold the gradients

    @property
    def ranks(self) -> int:
        return self.accelerator.num_processes

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, reduction="sum") if self.ranks > 1 else t


@dataclass
class StepReport:
    """Where and how a bad step's rows are reported: the run's output dir, the tokenizer's `decode`, the training
    rows (for their scores) and the train sources by the rows' source number (several in a mixture)."""

    output_dir: str
    decode: Callable
    train_dataset: Any
    train_files: list[str]
    main_process: bool = True

    def __post_init__(self):
        self.train_files = list(self.train_files or ["?"])
        self._scores: dict[tuple[int, int], float] = {}

    def score(self, source: int, line: int) -> float | None:
        if not hasattr(self.train_dataset, "with_format"):  # a stream (sft.data.splits.streaming): no table of scores
            return None
        if not self._scores:
            self._scores = row_scores(self.train_dataset)
        return self._scores.get((source, line))


class StepControl:
    """Owns what happens to each optimizer step after its backward passes (see the module docstring)."""

    def __init__(self, clip_policy: GradClipPolicy, controllers: dict[str, Controller], report: StepReport):
        self.clip_policy, self.report = clip_policy, report
        self.judges = [c for c in controllers.values() if implements(c, "judge_step")]
        self.stoppers = [c for c in controllers.values() if implements(c, "requests_stop")]
        self._deepspeed_threshold = math.inf
        self._step_loss: torch.Tensor | None = None
        # (source lines, source numbers, per-row loss, (input_ids, attention_mask, position_ids))
        self._step_rows: list = []

    def begin(self, device, engine=None) -> None:
        """A new optimizer step starts; under DeepSpeed (`engine`) its clip threshold is set on the engine now."""
        if engine is not None:
            self._deepspeed_threshold = set_deepspeed_clip(engine, self.clip_policy.threshold(None))
        self._step_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._step_rows = []

    def add_micro_batch(self, loss: torch.Tensor, source_lines, source_ids, per_row_loss: torch.Tensor,
                        batch: list) -> None:
        """Keep a micro-batch's share of the step loss and its rows (`source_ids`: None but in a mixture), for
        the verdicts and the report (only when some controller judges steps)."""
        if self.judges:
            self._step_loss += loss.detach().to(self._step_loss.dtype)
            sources = [0] * len(source_lines) if source_ids is None else source_ids.tolist()
            self._step_rows.append((source_lines, sources, per_row_loss.detach(), batch))

    def finish(self, model, ctx: StepContext) -> float:
        """Judge the finished step, then skip or clip it; return the pre-clip norm Trainer logs. The norm, the step's
        loss and the ranks' stop requests reach the host in one read (a GPU waits for the step once, not for each)."""
        if ctx.engine is not None:  # the engine has already clipped and stepped inside backward
            total_norm = ctx.accelerator.clip_grad_norm_(model.parameters(), math.inf)
            threshold = None
        else:
            params = [p for p in step_gradients(model, ctx.master_weights) if p.grad is not None]
            total_norm = ctx.accelerator.clip_grad_norm_(params, math.inf)  # unscales fp16; clips nothing
        norm, loss = self._read_step(ctx, total_norm)
        if ctx.engine is not None:
            threshold = self._deepspeed_threshold
        else:
            threshold = self.clip_policy.threshold(norm) if math.isfinite(norm) else math.inf
        verdicts = self._judge(ctx, norm, loss)
        if any(v.skip for v in verdicts):
            if ctx.engine is None and ctx.accelerator.scaler is None:  # fp16: the scaler skips it itself
                for p in params:  # optimizers leave parameters without a gradient alone (pure: the fp32 copies)
                    p.grad = None
                mark_update_skipped(ctx.optimizer, True)
            return norm
        if ctx.engine is None:
            if norm > threshold:
                torch.nn.utils.clip_grads_with_norm_(params, threshold, total_norm)
            if ctx.accelerator.scaler is None:
                mark_update_skipped(ctx.optimizer, False)
        self.clip_policy.observe(norm, threshold)
        return norm

    def _read_step(self, ctx: StepContext, total_norm) -> tuple[float, float | None]:
        """The step's pre-clip norm and its mean loss over the ranks (for the judges; None without any), read together;
        whether any rank's controller asked to stop, told to those that ask (`Controller.stop_agreed`): one all-reduce
        for the loss and the requests (none on one process), then one host read for everything."""
        local_stop = any(c.requests_stop() for c in self.stoppers)
        norm = torch.as_tensor(total_norm, dtype=torch.float64).to(self._step_loss.device)
        if ctx.ranks > 1 and (self.judges or self.stoppers):
            sums = ctx.sum_over_ranks(torch.stack([self._step_loss, self._step_loss.new_tensor(float(local_stop))]))
            read = torch.cat([norm[None], sums]).tolist()
            norm_value, loss, stop = read[0], read[1] / ctx.ranks, read[2] > 0
        else:
            norm_value, loss = torch.stack([norm, self._step_loss]).tolist()
            stop = local_stop
        if stop:
            for controller in self.stoppers:
                controller.stop_agreed(ctx.step)
        return norm_value, loss if self.judges else None

    def _judge(self, ctx: StepContext, norm: float, loss: float | None) -> list[StepVerdict]:
        """Every judging controller's verdict on the finished step; a bad step is reported."""
        if not self.judges:
            return []
        verdicts = [v for v in (c.judge_step(ctx.step, loss, norm) for c in self.judges) if v is not None]
        for verdict in verdicts:
            self._report(ctx, verdict, loss, norm)
        return verdicts

    def _report(self, ctx: StepContext, verdict: StepVerdict, loss: float, norm: float) -> None:
        """Write `<folder>/step-N.json` naming the step's rows; warn with the worst ones."""
        report, step = self.report, ctx.step
        files = report.train_files
        rows = []
        for lines, sources, per_row, batch in self._step_rows:
            for line, source, row_loss, seq in zip(lines.tolist(), sources, per_row.float().tolist(),
                                                   split_samples(*batch)):
                rows.append({"source_line": line, "loss": row_loss if math.isfinite(row_loss) else str(row_loss),
                             "difficulty_score": report.score(source, line), "text": report.decode(seq),
                             **({"source": files[source]} if len(files) > 1 else {})})
        if ctx.ranks > 1:
            rows = gather_object(rows)
        culprits = [r for r in rows if isinstance(r["loss"], str)] or sorted(rows, key=lambda r: -r["loss"])
        skipped = verdict.skip and ctx.engine is None
        if report.main_process:
            folder = own_dir(Path(report.output_dir) / verdict.folder)
            written = {"step": step, "verdict": verdict.kind, "loss": str(loss), "grad_norm": str(norm),
                       "update_skipped": skipped, "rows": culprits,
                       **({"train_file": files[0]} if len(files) == 1 else {})}
            write_text(own_path(folder / f"step-{step}.json"), json.dumps(written, indent=1, ensure_ascii=False) + "\n")
            named = ", ".join(f"{r.get('source', files[0])}:{r['source_line']} (loss {r['loss']})"
                              for r in culprits[:5])
            log.warning("step %d: %s (loss %s, grad norm %s): update %s; rows: %s; details in %s", step,
                        verdict.summary, loss, norm, "skipped" if skipped else "applied", named,
                        folder / f"step-{step}.json")


def step_gradients(model, master_weights=None) -> list[torch.Tensor]:
    """The tensors that hold a step's gradients: the model's parameters, or under `trainer.precision=pure` the fp32
    copies of those held in bf16 (`sft.training.step.master_weights`)."""
    trained = list(model.parameters())
    return master_weights.holding_gradients(trained) if master_weights is not None else trained


def split_samples(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None) -> list[torch.Tensor]:
    """Each sample's tokens (on CPU): a padded batch's rows without padding, or a packed row's sequences."""
    if position_ids is None:
        mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        return [row[keep] for row, keep in zip(input_ids.detach().cpu(), mask.cpu())]
    samples = []
    for row, positions in zip(input_ids.detach().cpu(), position_ids.cpu()):
        bounds = packed_bounds(positions).tolist()
        samples += [row[a:b] for a, b in zip(bounds, bounds[1:])]
    return samples
