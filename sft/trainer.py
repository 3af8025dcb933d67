"""`WeightedLossTrainer`: the stock `transformers.Trainer` with a weighted loss that stays exact.

Only what the loss needs is overridden:
- `get_batch_samples` sums the loss's denominator over the optimizer step's micro-batches and all ranks
  (Trainer's own `num_items_in_batch` counts tokens, not weight mass) and hands it to `compute_loss`;
- `compute_loss` pops `labels`/`loss_weights` (the model's forward never sees them) and divides the
  micro-batch's numerator by that global denominator, times the world size because DDP and DeepSpeed
  average gradients over ranks;
- `evaluation_loop` replaces the mean of per-batch losses by the exact ratio over the eval set (each
  row counted once, also where a distributed sampler repeats rows to even out the ranks), and adds
  `eval_ce`, the unweighted token-mean cross entropy, comparable across loss configs;
- `log` adds `ce` and `weight_mean` (mean loss weight per assistant token) next to `loss`.
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object
from transformers import Trainer

from sft.losses import WeightedTokenLoss


class WeightedLossTrainer(Trainer):
    # compute_loss normalises over the whole accumulated step itself: Trainer must not divide by GA.
    loss_is_scaled_for_ga = True

    def __init__(self, *args, loss: WeightedTokenLoss, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss = loss
        self._train_stats = torch.zeros(3, dtype=torch.float64, device=self.args.device)  # ce, weight, tokens
        self._eval_rows: dict[int, list[float]] | None = None  # source line -> numerator, denominator, ce, tokens

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, reduction="sum") if self.accelerator.num_processes > 1 else t

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Fetch the step's micro-batches and the loss denominator summed over them and all ranks."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        denominator = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batches:
            denominator += self.loss.normaliser(batch["labels"], batch["loss_weights"]).to(device)
        return batches, self._sum_over_ranks(denominator)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        loss_weights = inputs.pop("loss_weights")
        source_lines = inputs.pop("source_lines", None)
        outputs = model(**inputs, use_cache=False)
        terms = self.loss.terms(outputs.logits, labels, loss_weights)
        numerator = terms.numerator.sum()
        if model.training and num_items_in_batch is not None:
            denominator = num_items_in_batch.clamp_min(1e-12).to(numerator.dtype)
            loss = numerator / denominator * self.accelerator.num_processes
            stats = torch.stack([terms.ce_sum.sum(), terms.weight_sum.sum(), terms.tokens.sum()])
            self._train_stats += stats.to(self._train_stats)
        else:
            loss = numerator / terms.denominator.sum().clamp_min(1e-12)
            if self._eval_rows is not None and source_lines is not None:
                per_row = torch.stack([terms.numerator.detach(), terms.denominator, terms.ce_sum, terms.tokens], 1)
                self._eval_rows.update(zip(source_lines.tolist(), per_row.double().tolist()))
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._eval_rows = {}
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            rows = self._eval_rows
            if self.accelerator.num_processes > 1:
                rows = dict(item for part in gather_object([rows]) for item in part.items())
        finally:
            self._eval_rows = None
        numerator, denominator, ce_sum, tokens = (sum(col) for col in zip(*rows.values()))
        output.metrics[f"{metric_key_prefix}_loss"] = numerator / max(denominator, 1e-12)
        output.metrics[f"{metric_key_prefix}_ce"] = ce_sum / max(tokens, 1)
        return output

    def log(self, logs, start_time=None):
        if "loss" in logs:  # a training log: every rank gets here together
            ce_sum, weight_sum, tokens = self._sum_over_ranks(self._train_stats).tolist()
            self._train_stats.zero_()
            if tokens:
                logs["ce"] = ce_sum / tokens
                logs["weight_mean"] = weight_sum / tokens
        super().log(logs, start_time)
