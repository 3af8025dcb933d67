"""The fate of an optimizer step, decided in one place: judged, skipped or clipped, and reported.

`WeightedLossTrainer` delegates to a `StepControl` at three moments of each optimizer step:

1. `begin` (from `get_batch_samples`, before the step's first forward): under DeepSpeed, whose engine
   clips inside its own step, the clip policy's threshold is set on the engine now, from history alone;
2. `add_micro_batch` (from `compute_loss`): the micro-batch's loss and per-row losses are kept, when a
   controller judges steps, for the verdict and, if the step is bad, its report;
3. `finish` (from `_clip_grad_norm`, once the backward passes are done and right before
   `optimizer.step()`): the global pre-clip gradient norm is computed; one all-reduce tells every rank
   the step's loss and whether any rank asked to stop (`stop_requests`: a signal, `sft.training.preemption`), so
   the judges and preemption share a collective; every controller with a `judge_step` gives its
   verdict; a skipped step drops its gradients (parameters, optimizer state and schedule stay as they
   are); otherwise the clip policy's threshold is applied; the policy observes the norm. A bad step's
   rows go to `<folder>/step-N.json` in the run dir and to the log.

Other libraries' private fields are touched here and nowhere else, each in one function with a test
that fails if the library changes it (`tests/test_step_control.py`): accelerate's
`AcceleratedOptimizer._is_overflow` (`mark_update_skipped`) and DeepSpeed's
`engine._config.gradient_clipping` / ZeRO's `optimizer.clip_grad` (`set_deepspeed_clip`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable

import torch
from accelerate.utils import gather_object

from sft.data.batch import packed_bounds
from sft.training.clipping import GradClipPolicy
from sft.training.controllers import Controller, StepVerdict
from sft.training.controllers.base import implements
from sft.data.split import row_scores

log = logging.getLogger("sft")


def mark_update_skipped(optimizer, skipped: bool) -> None:
    """Tell accelerate whether this step's update was skipped, as its fp16 loss scaler would.

    `AcceleratedOptimizer.step_was_skipped` reads `_is_overflow`; a skipped step then does not advance
    the learning-rate scheduler (`Trainer` checks `accelerator.optimizer_step_was_skipped`). Without a
    loss scaler accelerate never resets the flag itself, so every step sets it.
    """
    optimizer._is_overflow = skipped


def set_deepspeed_clip(engine, threshold: float) -> float:
    """Set the threshold a DeepSpeed engine clips to in its next step; return it (inf: no clipping).

    The engine clips to its config's `gradient_clipping` (read through `engine.gradient_clipping()`),
    ZeRO optimizers to their own `clip_grad`; DeepSpeed takes 0 for no clipping.
    """
    threshold = threshold if math.isfinite(threshold) else 0.0
    engine._config.gradient_clipping = threshold
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = threshold
    return threshold if threshold > 0 else math.inf


class StepControl:
    """Owns what happens to each optimizer step after its backward passes (see the module docstring)."""

    def __init__(self, trainer, clip_policy: GradClipPolicy, controllers: dict[str, Controller],
                 train_files: list[str] | None = None):
        # the train sources by the rows' source number (several in a mixture), to name a step's rows
        self.trainer, self.clip_policy, self.train_files = trainer, clip_policy, list(train_files or ["?"])
        self.judges = [c for c in controllers.values() if implements(c, "judge_step")]
        self._deepspeed_threshold = math.inf
        self._step_loss: torch.Tensor | None = None
        # (source lines, source numbers, per-row loss, (input_ids, attention_mask, position_ids))
        self._step_rows: list = []
        self._train_scores: dict[tuple[int, int], float] = {}
        # Whether this rank wants the run to stop after the current step (`sft.training.preemption` adds its signal flag);
        # `stop_requested` is then any rank's answer, as of the last `finish`.
        self.stop_requests: list[Callable[[], bool]] = []
        self.stop_requested = False

    def begin(self, device) -> None:
        """A new optimizer step starts; under DeepSpeed its clip threshold is set on the engine now."""
        t = self.trainer
        if t.is_deepspeed_enabled and t.args.max_grad_norm > 0:
            self._deepspeed_threshold = set_deepspeed_clip(t.model_wrapped, self.clip_policy.threshold(None))
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

    def finish(self, model) -> float:
        """Judge the finished step, then skip or clip it; return the pre-clip norm Trainer logs."""
        t = self.trainer
        if t.is_deepspeed_enabled:  # the engine has already clipped and stepped inside backward
            norm = float(t.accelerator.clip_grad_norm_(model.parameters(), t.args.max_grad_norm))
            threshold = self._deepspeed_threshold
        else:
            params = [p for p in model.parameters() if p.grad is not None]
            total_norm = t.accelerator.clip_grad_norm_(params, math.inf)  # unscales fp16; clips nothing
            norm = float(total_norm)
            threshold = self.clip_policy.threshold(norm) if math.isfinite(norm) else math.inf
        verdicts = self._judge(norm, self._reduce_step())
        if any(v.skip for v in verdicts):
            if not t.is_deepspeed_enabled and t.accelerator.scaler is None:  # fp16: the scaler skips it itself
                model.zero_grad(set_to_none=True)  # optimizers leave parameters without a gradient alone
                mark_update_skipped(t.optimizer, True)
            return norm
        if not t.is_deepspeed_enabled:
            if norm > threshold:
                torch.nn.utils.clip_grads_with_norm_(params, threshold, total_norm)
            if t.accelerator.scaler is None:
                mark_update_skipped(t.optimizer, False)
        self.clip_policy.observe(norm, threshold)
        return norm

    def _reduce_step(self) -> float | None:
        """The step's mean loss over the ranks (for the judges; None without any) and, in `stop_requested`,
        whether any rank asked to stop: one all-reduce for both, none on one process."""
        t = self.trainer
        local_stop = any(request() for request in self.stop_requests)
        if t.accelerator.num_processes == 1:
            self.stop_requested = local_stop
            return float(self._step_loss) if self.judges else None
        if not (self.judges or self.stop_requests):
            return None
        sums = t._sum_over_ranks(torch.stack([self._step_loss, self._step_loss.new_tensor(float(local_stop))]))
        self.stop_requested = bool(sums[1] > 0)
        return float(sums[0]) / t.accelerator.num_processes if self.judges else None

    def _judge(self, norm: float, loss: float | None) -> list[StepVerdict]:
        """Every judging controller's verdict on the finished step; a bad step is reported."""
        if not self.judges:
            return []
        t = self.trainer
        step = t.state.global_step + 1
        verdicts = [v for v in (c.judge_step(step, loss, norm) for c in self.judges) if v is not None]
        for verdict in verdicts:
            self._report(step, verdict, loss, norm)
        return verdicts

    def _report(self, step: int, verdict: StepVerdict, loss: float, norm: float) -> None:
        """Write `<folder>/step-N.json` naming the step's rows; warn with the worst ones."""
        t = self.trainer
        if not self._train_scores:
            self._train_scores = row_scores(t.train_dataset)
        rows = []
        for lines, sources, per_row, batch in self._step_rows:
            for line, source, row_loss, seq in zip(lines.tolist(), sources, per_row.float().tolist(),
                                                   split_samples(*batch)):
                rows.append({"source_line": line, "loss": row_loss if math.isfinite(row_loss) else str(row_loss),
                             "difficulty_score": self._train_scores.get((source, line)),
                             "text": t.processing_class.decode(seq),
                             **({"source": self.train_files[source]} if len(self.train_files) > 1 else {})})
        if t.accelerator.num_processes > 1:
            rows = gather_object(rows)
        culprits = [r for r in rows if isinstance(r["loss"], str)] or sorted(rows, key=lambda r: -r["loss"])
        skipped = verdict.skip and not t.is_deepspeed_enabled
        if t.is_world_process_zero():
            folder = Path(t.args.output_dir) / verdict.folder
            folder.mkdir(parents=True, exist_ok=True)
            report = {"step": step, "verdict": verdict.kind, "loss": str(loss), "grad_norm": str(norm),
                      "update_skipped": skipped, "rows": culprits,
                      **({"train_file": self.train_files[0]} if len(self.train_files) == 1 else {})}
            (folder / f"step-{step}.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
            named = ", ".join(f"{r.get('source', self.train_files[0])}:{r['source_line']} (loss {r['loss']})"
                              for r in culprits[:5])
            log.warning("step %d: %s (loss %s, grad norm %s): update %s; rows: %s; details in %s", step,
                        verdict.summary, loss, norm, "skipped" if skipped else "applied", named,
                        folder / f"step-{step}.json")


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
