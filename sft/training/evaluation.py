"""`ExactEvaluation`: Trainer's evaluation, as sft needs it; a base of `WeightedLossTrainer` (whose `compute_loss`
records each eval row's sums into `_eval_rows`), given its part, `evaluation=EvaluationParts(...)`
(`sft.training.parts`: the difficulty buckets, generation samples, benchmarks, a mixture's tasks).

- `evaluation_loop` (public) replaces the mean of per-batch losses by the exact ratio over the eval set
  (each row counted once, also where a distributed sampler repeats rows to even out the ranks), and adds
  `eval_ce`, the unweighted token-mean cross entropy, comparable across loss configs;
- `prediction_step` (public) runs `compute_loss` for the per-row sums and returns no loss, which spares
  two collectives per eval batch that Trainer would make for a loss nothing reads (`num_items_in_batch`
  over the ranks, the batch loss gathered);
- with `eval_generation`, `evaluation_loop` also adds `eval_gen/<metric>` of greedy answers to fixed prompts
  (`sft.eval.samples`), their samples going to TensorBoard and W&B; with `eval_harness`, every k-th evaluation
  adds its benchmarks' scores (`sft.eval.harness`).

Evaluation also reports `eval_token_accuracy` (argmax on assistant tokens) and the unweighted loss per
difficulty bucket, `eval_loss_bucket_<k>` for the buckets cut by `eval_buckets`, and
`eval_loss_hardest_bucket`; with a mixture (`sft.data.splits.mixture`), `eval_loss_task_<task>` (the weighted loss) and
`eval_ce_task_<task>` over the eval rows of each task.
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object
from transformers import Trainer
from typing_extensions import override

from sft.data.tokens.columns import row_scores
from sft.eval.metrics import eval_metrics
from sft.training.parts import EvaluationParts


class ExactEvaluation(Trainer):
    def __init__(self, *args, evaluation: EvaluationParts | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        evaluation = evaluation or EvaluationParts()
        self.eval_buckets = list(evaluation.buckets)
        self.eval_generation = evaluation.generation  # sft.eval.samples.EvalGeneration: samples at evaluations
        self.eval_harness = evaluation.harness  # sft.eval.harness.EvalHarness: benchmarks at every k-th evaluation
        self.tasks = dict(evaluation.tasks)  # a mixture's task of each source number: eval_loss_task_<task>
        self.eval_scores = {}  # (source, line) -> difficulty score
        if self.eval_dataset is not None and "difficulty_score" in self.eval_dataset.column_names:
            self.eval_scores = row_scores(self.eval_dataset)
        # (source, line, view) -> numerator, denominator, ce, tokens, correct: each eval sequence counted once
        self._eval_rows: dict[tuple[int, int, int], list[float]] | None = None
        self.last_eval_rows: dict[tuple[int, int, int], list[float]] = {}

    @override
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
        self.last_eval_rows = rows  # the latest evaluation row by row (sft.experiments.results.write_eval_rows)
        output.metrics.update(eval_metrics(rows, metric_key_prefix, self.tasks, self.eval_scores, self.eval_buckets))
        if self.eval_generation is not None and metric_key_prefix == "eval" and self.eval_generation.due():
            output.metrics.update(self._generation_samples())
        if self.eval_harness is not None and metric_key_prefix == "eval" and self.eval_harness.due():
            output.metrics.update(self.benchmark(self.accelerator.unwrap_model(self.model)))
        return output

    def benchmark(self, model) -> dict[str, float]:
        """`eval_harness`'s metrics for `model`: rank 0 runs the harness, every rank gets them (the others wait)."""
        from accelerate.utils import broadcast_object_list

        metrics = [self.eval_harness.run(model, self.processing_class) if self.is_world_process_zero() else None]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(metrics, from_process=0)
        return metrics[0]

    def _generation_samples(self) -> dict[str, float]:
        """`eval_generation`'s greedy answers (every rank generates; synced under ZeRO-3/FSDP), their metrics, and the
        table to TensorBoard and W&B from rank 0."""
        from sft.eval.samples import log_samples

        model = self.accelerator.unwrap_model(self.model_wrapped if self.is_zero3 else self.model)
        metrics, table = self.eval_generation.generate(model, self.processing_class,
                                                       synced_gpus=self.shards_parameters)
        if self.is_world_process_zero():
            log_samples(self.callback_handler.callbacks, self.state.global_step, table)
        return metrics

    @override
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation's forward: `compute_loss` records the batch's per-row sums, from which
        `evaluation_loop` computes every metric. No loss is returned, so Trainer does not count
        `num_items_in_batch` over the ranks nor gather a per-batch loss: two collectives per eval batch
        whose results were never used. Predictions (`prediction_loss_only=False`) take Trainer's path."""
        if not prediction_loss_only or self._eval_rows is None or inputs.get("source_lines") is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            self.compute_loss(model, inputs)
        return None, None, None
