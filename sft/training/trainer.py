"""`WeightedLossTrainer`: the stock `transformers.Trainer` with a weighted loss that stays exact.

Every override, and why it is needed (each is marked `@override`; a test checks that transformers
still has each one, with the same parameters):
- `get_batch_samples` (public) gives no batch once `max_steps` are trained (Trainer, resumed from a run's last
  checkpoint, would train a step past them); it sums the loss's denominator over the optimizer step's micro-batches and
  all ranks (Trainer's own `num_items_in_batch` counts tokens, not weight mass) and hands it to
  `compute_loss`; it also opens the step in `sft.training.step.control` (DeepSpeed's clip threshold is set there);
- `compute_loss` (public) pops `labels`/`weights`/`source_lines`/`source_views`/`source_ids`/`aux_*` (the
  model's forward never sees them) and divides the micro-batch's numerator by that global denominator, times the world
  size because DDP and DeepSpeed average gradients over ranks. A mixture of experts' router aux loss (when
  its config enables it, `sft.loss.logits.router_aux_loss_coef`) is added with the model's coefficient, each
  micro-batch's weighted by its share of the step's tokens (so accumulation neither sums nor drops it).
  The loss's auxiliary terms (`loss.aux`, `sft.loss.auxiliary.AuxTerm`) are added as `coef * numerator / the
  step's denominator`, their denominators summed with the loss's in `get_batch_samples`.
  With a lean loss implementation (`loss.impl`, see `sft.losses`) the model runs without its output
  projection (`logits_to_keep` selects no position) and the loss takes the final hidden states, captured
  from the decoder, and the projection's weight (gathered under ZeRO-3). A loss that reads a second model (a
  teacher, a reference) gets its outputs on the same micro-batch, from its forward without gradients;
- `_clip_grad_norm` and `_get_grad_norm` (private: Trainer's only hooks between the backward passes and
  `optimizer.step()` that receive the model; Trainer calls the first where `max_grad_norm > 0`, the second always)
  hand the step to `sft.training.step.control.StepControl.finish` (controllers' verdicts, skip, clip policy) with a
  `StepContext`, the step's number and the objects it acts on;
- `create_optimizer` (public) gives the optimizer fp32 copies of a bf16 model's trained weights under
  `trainer.precision=pure` (`sft.training.step.master_weights`), whose gradients step control then judges and clips,
  and makes Muon with AdamW under `trainer.optim=muon` (`sft.training.step.muon`);
- `get_train_dataloader` (public) reads a stream (`sft.data.splits.streaming`) as this rank's share, not split again;
- `_get_train_sampler` (private: Trainer builds its sampler there) returns a controller's sampler (the
  curriculum's) when one provides it (`Controller.train_sampler`), under sequence parallelism given to the ranks of
  a group alike (`sft.training.processes.sequence_parallel`);
- `training_step` (public) trains a packed micro-batch in pieces of at most `micro_batch_tokens` tokens (the memory
  plan's or the user's), and any micro-batch in smaller pieces after a CUDA out-of-memory error, the step started
  again from its first micro-batch (`sft.training.step.micro_batches`: the step's rows and loss unchanged); and runs
  under sequence parallelism with DeepSpeed's Ulysses attention installed (forward and backward), where `compute_loss`
  gives the model this rank's slice of the positions and takes the numerator of the targets predicted there, the
  denominator and per-sample sums being the whole micro-batch's;
- `create_accelerator_and_postprocess` (public) lets accelerate's FSDP2 plugin take a CPU process group too
  (`sft.training.processes.distributed.fsdp_without_gpus`), and refuses to go on where FSDP was asked for and is not on;
- the evaluation overrides (`evaluation_loop`, `prediction_step`) are a base's, `sft.training.evaluation`'s
  `ExactEvaluation`, and the checkpoint and model saving overrides the other base's, `sft.training.checkpoints.saving`'s
  `CheckpointSaving`; each takes its own part (`sft.training.parts`: `evaluation`, `checkpoints`);
- `_track_num_input_tokens` (private: Trainer's count of the tokens seen, a gather and a host read after every
  micro-batch) counts nothing; `log` adds the step's own sums of input tokens to `state.num_input_tokens_seen`;
- `log` (public) adds `ce` and `weight_mean` (the mean weight of an assistant token) next to `loss`,
  `aux_loss` (the router's, token-weighted) for a mixture of experts that asks for it, `aux/<name>` for
  each auxiliary term (its numerators over its denominators since the last log, without the coef), the
  throughput values (`sft.training.observability.throughput`), the clip policy's and the controllers' `log_values`.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from accelerate.utils import gather_object
from typing_extensions import override

from sft.config.schema import ConfigError
from sft.data.splits.streaming import Stream
from sft.data.tokens.batch import input_tokens, pop_targets, targets_of
from sft.loss.auxiliary import AuxBatch
from sft.loss.base import WeightedTokenLoss
from sft.loss.kernels import choose_impl, lean_logits_error
from sft.loss.logits import LogitTransform, router_aux_loss_coef
from sft.model.attention import packed_rows_need_no_mask
from sft.model.second_model import FrozenModel, forward_keeping_hidden
from sft.model.teacher_cache import CachedTeacher
from sft.training.checkpoints.saving import CheckpointSaving
from sft.training.compat import import_deepspeed_only_when_used
from sft.training.evaluation import ExactEvaluation
from sft.training.observability.step_log import use_step_log
from sft.training.observability.throughput import ThroughputMeter
from sft.training.parts import Display, StepParts
from sft.training.processes.distributed import fsdp_without_gpus
from sft.training.processes.sequence_parallel import SequenceParallel
from sft.training.step.clipping import GradClipPolicy
from sft.training.step.control import StepContext, StepControl, StepReport, step_gradients
from sft.training.step.master_weights import MasterWeights
from sft.training.step.micro_batches import MicroBatchPieces, is_packed, refusal as pieces_refusal
from sft.training.step.muon import MuonWithAdamW

log = logging.getLogger("sft")


class WeightedLossTrainer(ExactEvaluation, CheckpointSaving):
    # compute_loss normalises over the whole accumulated step itself: Trainer must not divide by GA.
    loss_is_scaled_for_ga = True

    def __init__(self, *args, loss: WeightedTokenLoss, step: StepParts | None = None, shows: Display | None = None,
                 second_model=None, **kwargs):
        """Trainer's arguments, the weighted `loss`, a step's control (`step`), what the run shows (`shows`) and the
        frozen model the loss reads beside it (`second_model`: its teacher or reference, `sft.model.second_model`; or
        a teacher's cached logits, `sft.model.teacher_cache.CachedTeacher`); the evaluation's part (`evaluation`) and
        the checkpoints' (`checkpoints`) go to the classes that own them (`sft.training.parts`)."""
        step, shows = step or StepParts(), shows or Display()
        self.controllers = dict(step.controllers)
        self.pure_bf16 = step.master_weights  # trainer.precision=pure: create_optimizer gives it fp32 copies
        self.muon = step.muon  # trainer.optim=muon: create_optimizer makes sft.training.step.muon's
        self.master_weights: MasterWeights | None = None
        self.throughput = shows.throughput or ThroughputMeter()
        callbacks = list(self.controllers.values()) + [self.throughput] + kwargs.pop("callbacks", [])
        import_deepspeed_only_when_used()  # Trainer unwraps the model while it is set up: no DeepSpeed import for it
        super().__init__(*args, callbacks=callbacks, **kwargs)
        use_step_log(self, shows.console)  # short lines (or JSON ones), not transformers' dicts of strings
        self.loss = loss
        if (second_model is None) == loss.reads_second_model_each_step:
            each_step = loss.second_model if loss.reads_second_model_each_step else "no second model"
            raise ValueError(f"{type(loss).__name__} reads {each_step} at each step, and the trainer "
                             f"was given {'none' if second_model is None else 'one'}")
        # not an attribute Trainer knows: never wrapped, stepped or saved; a cached teacher's logits come with the batch
        self.second_model = (second_model if second_model is None or isinstance(second_model, CachedTeacher)
                             else FrozenModel(second_model, self.args.device))
        self.clip_policy = step.clip_policy or GradClipPolicy()
        decode = self.processing_class.decode if self.processing_class is not None else str
        self.step_control = StepControl(self.clip_policy, self.controllers, StepReport(
            self.args.output_dir, decode, self.train_dataset, step.sources, self.is_world_process_zero()))
        self.stream_position = None  # a stream's (sft.data.splits.streaming), after the last micro-batch trained
        self._train_stats = torch.zeros(len(self.TRAIN_STATS), dtype=torch.float64, device=self.args.device)
        self._decoder = self.model.get_decoder()
        self._lm_head = self.model.get_output_embeddings()
        self._zero3_head = self.is_zero3 and hasattr(self._lm_head.weight, "ds_id")
        self.loss_impl = choose_impl(loss.impl, vocab_size=self.model.config.vocab_size,
                                     on_gpu=self.args.device.type == "cuda",
                                     zero3_trainable_head=self._zero3_head and self._lm_head.weight.requires_grad,
                                     reads_logits=loss.reads_logits)
        self.logit_transform = LogitTransform.of(self.model.config)
        self.router_aux_coef = router_aux_loss_coef(self.model.config)
        self._step_tokens = None  # input tokens of the optimizer step over all ranks (weights the aux loss)
        self.aux_terms = dict(getattr(loss, "aux", None) or {})  # the loss's auxiliary terms, by name
        self.sp = SequenceParallel.start(step.sequence_parallel) if step.sequence_parallel > 1 else None
        if self.sp is not None and self.second_model is not None:
            raise ConfigError(loss.second_model, type(second_model).__name__, "not with sequence parallelism: sp=none")
        if self.sp is not None and self.router_aux_coef:
            raise ConfigError("sp.size", step.sequence_parallel, f"{type(self.model).__name__}'s router aux loss is "
                              "computed per forward from its tokens' router logits, which sequence parallelism "
                              "splits: not exact with sp (or set model.config_overrides.output_router_logits=false)")
        self._aux_denominators = None  # each term's denominator summed over the step and all ranks
        self._aux_stats = torch.zeros(2 * len(self.aux_terms), dtype=torch.float64, device=self.args.device)
        cannot_cut = pieces_refusal(self.accelerator.num_processes, self.is_deepspeed_enabled, self.sp is not None,
                                    bool(self.router_aux_coef))
        if step.micro_batch_tokens is not None and cannot_cut:
            raise ConfigError("trainer.micro_batch_tokens", step.micro_batch_tokens, f"trains a packed micro-batch "
                              f"in pieces, which this run cannot: {cannot_cut}; set it to null")
        self.micro_batches = MicroBatchPieces(cannot_cut or (None if step.oom_retry else "trainer.oom_retry=false"),
                                              step.micro_batch_tokens)
        self._step_start = ([], None)  # the step's micro-batches, and the statistics before its first one
        self._packed_rows_need_no_mask = packed_rows_need_no_mask(self.model)
        self._mask_not_needed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.args.device)
        if self.loss_impl != "naive":
            self._check_lean_loss_reproduces_the_logits()
        log.info("loss: %s cross entropy (loss.impl=%s)%s", self.loss_impl, loss.impl,
                 "" if self.logit_transform == LogitTransform() else f", logits {self.logit_transform}")

    def _check_lean_loss_reproduces_the_logits(self) -> None:
        """A lean loss projects the decoder's output itself: on a short probe, its logits (with the model's
        known transform) must be the model's own. Otherwise `auto` falls back to `naive`, and an explicit
        `loss.impl` is refused: never a silently different loss."""
        if self._zero3_head:  # sharded until DeepSpeed's engine runs: the transform table alone decides
            return
        model = self.model
        ids = torch.arange(1, 9, device=next(model.parameters()).device)[None]
        was_training = model.training
        model.eval()
        try:
            # pure bf16's model runs under autocast only (its linear weights bf16, the rest fp32), as in training
            with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=self.pure_bf16):
                outputs, hidden = self._forward_keeping_hidden(model, input_ids=ids)
                error = lean_logits_error(outputs.logits, hidden, self._lm_head.weight, self.logit_transform)
        finally:
            model.train(was_training)
        if error is None:
            return
        reason = (f"this {type(model).__name__}'s logits are not its decoder's output projected by its output "
                  f"layer ({self.logit_transform}): {error}")
        if self.loss.impl != "auto":
            raise ConfigError("loss.impl", self.loss.impl, f"{reason}; use loss.impl=naive (or auto)")
        log.warning("loss.impl=auto: %s; using naive", reason)
        self.loss_impl = "naive"

    @override
    def create_accelerator_and_postprocess(self):
        """Trainer's, with FSDP2 also on a CPU process group (`fsdp_without_gpus`); asked for and not on is an error,
        never a run with DDP in its place."""
        with fsdp_without_gpus(bool(self.args.fsdp)):
            super().create_accelerator_and_postprocess()
        if self.args.fsdp and not self.is_fsdp_enabled:
            raise RuntimeError(f"fsdp: asked for, but accelerate set up {self.accelerator.distributed_type}")

    @property
    def is_zero3(self) -> bool:
        """DeepSpeed ZeRO stage 3: parameters are sharded and gathered only around their use."""
        return self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3 or FSDP: each rank holds a shard of every weight, and each forward gathers them on all ranks
        together, so generation runs in step on every rank (`synced_gpus`)."""
        return self.is_zero3 or self.is_fsdp_enabled

    # Summed since the last log: ce, weights and count of assistant tokens, samples, input tokens (not
    # padding), positions, and the router aux loss times the input tokens it was computed on.
    TRAIN_STATS = ("ce", "weight", "tokens", "samples", "input_tokens", "positions", "aux")

    def state_dict(self) -> dict:
        """What a resume needs to log exactly as an uninterrupted run: statistics since the last log; from a stream,
        every rank's position in it (gathered: every rank calls this)."""
        state = {"train_stats": self._train_stats.tolist(), "aux_stats": self._aux_stats.tolist(),
                 **self.micro_batches.state_dict()}
        if isinstance(self.train_dataset, Stream):
            state["streams"] = (gather_object([self.stream_position]) if self.accelerator.num_processes > 1
                                else [self.stream_position])
        return state

    def load_state_dict(self, state: dict) -> None:
        for name in ("train_stats", "aux_stats"):
            saved = torch.tensor(state.get(name, []), dtype=torch.float64, device=self.args.device)
            getattr(self, f"_{name}")[: len(saved)] = saved
        self.micro_batches.load_state_dict(state)
        if isinstance(self.train_dataset, Stream) and state.get("streams"):
            position = state["streams"][self.args.process_index]  # (a resume keeps the number of ranks)
            if position is not None:
                self.train_dataset.load_state_dict(position)
                self.stream_position = position

    @override
    def get_train_dataloader(self):
        """Trainer's; a stream (`sft.data.splits.streaming.Stream`) is this rank's share already: it is put on the device,
        never split over the ranks again (accelerate would give each rank every world-size-th batch of it), and read
        in this process (a worker would hold a copy of the stream, whose position this process would not see)."""
        if not isinstance(self.train_dataset, Stream):
            return super().get_train_dataloader()
        from accelerate.data_loader import prepare_data_loader
        from torch.utils.data import DataLoader

        loader = DataLoader(self.train_dataset, batch_size=self._train_batch_size, collate_fn=self.data_collator,
                            pin_memory=self.args.dataloader_pin_memory)
        return prepare_data_loader(loader, self.args.device, num_processes=1, process_index=0, put_on_device=True,
                                   dispatch_batches=False)

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, reduction="sum") if self.accelerator.num_processes > 1 else t

    def _sum_over_batches(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, a sum over this rank's micro-batches, summed over every micro-batch of the step: over the ranks,
        where the ranks of a sequence-parallel group hold the same micro-batches."""
        total = self._sum_over_ranks(t)
        return total / self.sp.size if self.sp is not None else total

    @override
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Fetch the step's micro-batches and the loss denominator summed over them and all ranks; none once the run
        has trained its `max_steps` (a resume from its last checkpoint: Trainer would train one step more each time,
        its schedule climbing back up)."""
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return [], None
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
            if "stream_state" in batches[-1]:  # where this rank's stream is, after the micro-batch
                self.stream_position = batches[-1].pop("stream_state")
        # the loss's denominator, input tokens, each auxiliary term's denominator
        sums = torch.zeros(2 + len(self.aux_terms), dtype=torch.float64, device=device)
        for batch in batches:
            sums[0] += self.loss.normaliser(batch["labels"], batch["weights"], batch.get("position_ids"),
                                            targets_of(batch)).to(device)
            sums[1] += input_tokens(batch).to(device)
            for i, (name, term) in enumerate(self.aux_terms.items()):
                sums[2 + i] += term.denominator(AuxBatch.of(batch, name)).to(device)
        self.step_control.begin(device, self.model_wrapped if self.is_deepspeed_enabled else None)
        self._step_start = (batches, torch.cat([self._train_stats, self._aux_stats]))
        sums = self._sum_over_batches(sums)
        self._step_tokens, self._aux_denominators = sums[1], sums[2:]
        return batches, sums[0]

    @override
    def _clip_grad_norm(self, model):
        """Once per optimizer step, after the backward passes: `StepControl.finish` judges, skips or clips it.

        Trainer calls this right before `optimizer.step()` where `max_grad_norm > 0` (the clip policy's first
        threshold), and logs the pre-clip norm returned.
        """
        return self.step_control.finish(model, self._step_context())

    @override
    def _get_grad_norm(self, model, grad_norm=None):
        """The norm Trainer logs: `_clip_grad_norm`'s, or, where Trainer called no clipping (`max_grad_norm` 0: a
        policy that does not clip, or not at first), `StepControl.finish`'s, which finishes the step here."""
        if grad_norm is None:
            grad_norm = self.step_control.finish(model, self._step_context())
        return grad_norm

    def _step_context(self) -> StepContext:
        """What `StepControl` is told of the step it finishes."""
        return StepContext(step=self.state.global_step + 1, accelerator=self.accelerator, optimizer=self.optimizer,
                           engine=self.model_wrapped if self.is_deepspeed_enabled else None,
                           master_weights=self.master_weights)

    @override
    def create_optimizer(self, model=None):
        """Trainer's, stepping fp32 copies of the bf16 weights it trains under `trainer.precision=pure`; Muon on the
        layers' matrices and AdamW on the rest under `trainer.optim=muon` (`sft.training.step.muon`)."""
        if self.muon and self.optimizer is None:
            self.optimizer = MuonWithAdamW.of(self.model, self.args, self.get_decay_parameter_names(self.model))
        optimizer = super().create_optimizer(model)
        if self.pure_bf16 and self.master_weights is None:
            self.master_weights = MasterWeights.attach(optimizer, processes=self.accelerator.num_processes)
        return optimizer

    @override
    def _get_train_sampler(self, train_dataset=None):
        """The first controller's sampler (`Controller.train_sampler`: the curriculum's), else Trainer's."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        for controller in self.controllers.values():
            sampler = controller.train_sampler(dataset, seed)
            if sampler is not None:
                break
        else:
            sampler = super()._get_train_sampler(train_dataset)
        if self.sp is not None and sampler is not None:
            sampler = self.sp.sampler(sampler, self.args.per_device_train_batch_size, seed)
        return sampler

    @override
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's, on each piece of the micro-batch (packed: pieces of at most `micro_batch_tokens`; else one
        until an out-of-memory error). After one, the step is
        trained again from its first micro-batch in more pieces (`sft.training.step.micro_batches`): the error may
        have come inside a backward, some gradients accumulated and others not."""
        try:
            return sum(self._train_piece(model, piece, num_items_in_batch)
                       for piece in self.micro_batches.split(inputs))
        except torch.OutOfMemoryError as e:
            self.micro_batches.after_out_of_memory(e, inputs, self.state.global_step + 1)
        # out of the except clause: the error's frames, and the activations they hold, are freed
        batches, stats = self._step_start
        for p in step_gradients(model, self.master_weights):
            p.grad = None
        self._train_stats.copy_(stats[:len(self._train_stats)])
        self._aux_stats.copy_(stats[len(self._train_stats):])
        self.step_control.begin(self.args.device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        index = next((i for i, batch in enumerate(batches) if batch is inputs), 0)
        for earlier in batches[:index]:  # their losses are in Trainer's sum already
            self.training_step(model, earlier, num_items_in_batch)
        return self.training_step(model, inputs, num_items_in_batch)

    def _train_piece(self, model, inputs, num_items_in_batch):
        """Trainer's step on a micro-batch; under sequence parallelism with the Ulysses attention installed for its
        forward and backward."""
        if self.sp is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with self.sp.attention(self.model):
            return super().training_step(model, inputs, num_items_in_batch)

    @override
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        weights = inputs.pop("weights")
        source_lines = inputs.pop("source_lines", None)
        source_views = inputs.pop("source_views", None)
        source_ids = inputs.pop("source_ids", None)
        given = pop_targets(inputs)  # where its trained tokens are, as the collator found them
        aux_values = {k: inputs.pop(k) for k in [k for k in inputs if k.startswith("aux_")]}
        # the second model sees the micro-batch as it is (its attention may need the mask the model is spared); a
        # cached teacher's logits leave the batch here
        second = (self.second_model.outputs(inputs, lean=self.loss_impl != "naive")
                  if self.second_model is not None else None)
        evaluating = not model.training and self._eval_rows is not None and source_lines is not None
        training = model.training and num_items_in_batch is not None
        model_inputs, columns = self.sp.shard(inputs) if self.sp is not None and model.training else (inputs, None)
        if (columns is None and self._packed_rows_need_no_mask and is_packed(model_inputs)
                and "cu_seq_lens_q" in model_inputs):
            # the attention keeps the samples apart by their boundaries: the model is told its mask is built, so it
            # builds none (transformers reads the packing from the positions first, a wait for the device each forward)
            model_inputs = {**model_inputs, "attention_mask": self._mask_not_needed}
        outputs, terms, hidden = self._forward_terms(model, model_inputs, labels, weights, accuracy=evaluating,
                                                     keep_hidden=training and bool(self.aux_terms),
                                                     position_ids=inputs.get("position_ids"), columns=columns,
                                                     given=given, second=second)
        if columns is not None:  # this rank's slice: the per-sample sums of the whole micro-batch, for the logs
            terms = self.sp.whole_terms(terms)
        if training:
            denominator = num_items_in_batch.clamp_min(1e-12).to(terms.loss_sum.dtype)
            loss = terms.loss_sum / denominator
            if self.aux_terms:
                loss = loss + self._aux_loss(hidden, {**inputs, **aux_values, "labels": labels,
                                                      "weights": weights}).to(loss.dtype)
            tokens = input_tokens(inputs)
            aux = outputs.aux_loss.float() if self.router_aux_coef else torch.zeros((), device=loss.device)
            if self.router_aux_coef:  # the step's aux loss: its micro-batches' mean, weighted by their tokens
                step_tokens = self._step_tokens if self._step_tokens is not None else tokens
                loss = loss + self.router_aux_coef * aux * (tokens / step_tokens.clamp_min(1)).to(loss.dtype)
            loss = loss * self.accelerator.num_processes
            judged = loss  # the micro-batch's share of the step loss, as summed over the ranks
            if columns is not None:  # the whole micro-batch's, once per group
                judged = terms.numerator.sum() / denominator * self.accelerator.num_processes / self.sp.size
            stats = (terms.ce_sum.sum(), terms.weight_sum.sum(), terms.tokens.sum(), len(terms.tokens), tokens,
                     labels.numel(), aux.detach() * tokens)
            self._train_stats += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self._train_stats.device)
                                              for v in stats])
            batch = [inputs.get(k) for k in ("input_ids", "attention_mask", "position_ids")]
            self.step_control.add_micro_batch(judged, source_lines, source_ids,
                                              terms.ce_sum / terms.tokens.clamp_min(1), batch)
        else:
            loss = terms.loss_sum / terms.denominator.sum().clamp_min(1e-12)
            if evaluating:
                per_row = torch.stack([terms.numerator, terms.denominator, terms.ce_sum, terms.tokens, terms.correct], 1)
                n = len(source_lines)
                views = source_views.tolist() if source_views is not None else [0] * n
                sources = source_ids.tolist() if source_ids is not None else [0] * n
                self._eval_rows.update(zip(zip(sources, source_lines.tolist(), views), per_row.double().tolist()))
        return (loss, outputs) if return_outputs else loss

    def _aux_loss(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        """The auxiliary terms' share of this micro-batch: `coef * numerator / the step's denominator` each."""
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        for i, (name, term) in enumerate(self.aux_terms.items()):
            part = AuxBatch.of(batch, name)
            numerator = term.numerator(hidden, part)
            total = total + term.coef * numerator.double() / self._aux_denominators[i].clamp_min(1e-12)
            self._aux_stats[2 * i] += numerator.detach().double()
            self._aux_stats[2 * i + 1] += term.denominator(part).double().to(self._aux_stats.device)
        return total

    def _forward_terms(self, model, inputs, labels, weights, accuracy: bool, keep_hidden: bool = False,
                       position_ids=None, columns=None, given=None, second=None):
        """The model's forward, the loss terms, and the final hidden states (None unless a lean loss or
        `keep_hidden` needs them); the logits either materialised (`naive`) or not. `position_ids` are the batch's
        (`inputs` may be a sequence-parallel slice of it, of the positions `columns`); `second`: the second model's
        outputs on the batch."""
        if self.loss_impl == "naive":
            if keep_hidden:
                outputs, hidden = self._forward_keeping_hidden(model, **inputs)
            else:
                outputs, hidden = model(**inputs, use_cache=False), None
            with torch.profiler.record_function("sft.loss"):  # a scope in a profile (sft.bench.profile)
                terms = self.loss.terms(labels, weights, logits=outputs.logits, position_ids=position_ids,
                                        accuracy=accuracy, columns=columns, given=given, second=second)
            return outputs, terms, hidden
        no_logits = torch.empty(0, dtype=torch.long, device=labels.device)
        outputs, hidden = self._forward_keeping_hidden(model, **inputs, logits_to_keep=no_logits)
        # cce computes no argmax: evaluation (no gradient) takes the chunked path, which gives the accuracy.
        impl = self.loss_impl if model.training else "chunked"
        with self._gathered_lm_head(), torch.profiler.record_function("sft.loss"):
            terms = self.loss.terms(labels, weights, hidden=hidden, lm_head=self._lm_head.weight,
                                    position_ids=position_ids, impl=impl, accuracy=accuracy,
                                    transform=self.logit_transform, columns=columns, given=given, second=second)
        return outputs, terms, hidden

    def _forward_keeping_hidden(self, model, **inputs):
        """The model's forward (no KV cache), and its decoder's output: the final hidden states."""
        return forward_keeping_hidden(model, self._decoder, **inputs)

    def _gathered_lm_head(self):
        """Under ZeRO-3 the projection's weight is sharded; gather it for the loss (read-only)."""
        if not self._zero3_head:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([self._lm_head.weight], modifier_rank=None)

    @override
    def _track_num_input_tokens(self, inputs):
        """Trainer's count of the input tokens seen, made at each log from the micro-batches' own sums (`log`): Trainer
        gathers and reads it on the host after every micro-batch, a GPU wait and a collective each."""

    @override
    def log(self, logs, start_time=None):
        if "loss" in logs:  # a training log: every rank gets here together
            ce_sum, weight_sum, tokens, samples, inputs, positions, aux = (
                self._sum_over_batches(self._train_stats).tolist())
            self._train_stats.zero_()
            self.state.num_input_tokens_seen += int(inputs)  # (`_track_num_input_tokens`): before Trainer logs it
            if tokens:
                logs["ce"] = ce_sum / tokens
                logs["weight_mean"] = weight_sum / tokens
            if self.router_aux_coef and inputs:
                logs["aux_loss"] = aux / inputs
            if self.aux_terms:
                sums = self._sum_over_ranks(self._aux_stats).tolist()
                self._aux_stats.zero_()
                for i, name in enumerate(self.aux_terms):
                    logs[f"aux/{name}"] = sums[2 * i] / max(sums[2 * i + 1], 1e-12)
            logs.update(self.throughput.log_values(samples, inputs, positions, tokens))
            logs.update(self.clip_policy.log_values())
            for controller in self.controllers.values():
                logs.update(controller.log_values())
        super().log(logs, start_time)

