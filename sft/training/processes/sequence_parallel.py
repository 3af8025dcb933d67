"""Sequence parallelism (the `sp` group, `sp=ulysses sp.size=2`): each sequence split over a group of ranks.

A group of `size` consecutive ranks trains the same micro-batch, each rank the model's forward on its own
`1/size` of the positions; inside every attention layer DeepSpeed's Ulysses exchange (`UlyssesSPAttentionHF`,
two all-to-alls) gives each rank all positions for `1/size` of the heads, so attention sees whole sequences.
World = data-parallel × `size`: the groups are data-parallel replicas of each other.

What sft does around DeepSpeed's attention, and why not through accelerate's `ParallelismConfig`
(`sp_backend="deepspeed"`, which transformers' Trainer wires to DeepSpeed's `UlyssesSPDataLoaderAdapter`):
that path fixes the attention's batch size at the per-device batch (a packed micro-batch is one row, an epoch's
last batch may be short), accepts only `sdpa` and flash attention (not `sdpa_varlen`, packing's), computes the
loss as a token mean of its own, and its data adapter has no `dataset`, so Trainer's mid-epoch resume
(`skip_first_batches`) fails on it. So:

- data (`SequenceParallel.sampler`): each micro-batch's rows are given `size` times in a row to the loader, which
  accelerate deals out to consecutive ranks, so the ranks of a group get the same batches (with Trainer's own
  skipping on resume); the collator pads each batch to a multiple of `size` positions and always gives
  `position_ids` (`sft.data.tokens.collator`);
- the forward (`SequenceParallel.shard`): the model gets its rank's slice of `input_ids` and `position_ids`;
  DeepSpeed's attention gathers the positions, so RoPE, causality and packed samples (`sdpa_varlen`, flash
  attention's varlen) see the whole sequence;
- the loss: every rank keeps the whole micro-batch's labels and weights, so the step's denominator and the
  per-sample normalisers are the unsplit batch's; a rank's numerator is the part of its positions
  (`sft.loss.terms`, `columns`), and the gradients' sum over the group is the whole numerator's. DDP and
  DeepSpeed (without a sequence-parallel `mpu`) average gradients over all ranks, as for data parallelism, so
  the loss keeps its usual world-size factor; sums over ranks of what every rank of a group holds alike (the
  denominator, statistics) are divided by `size`.
- evaluation and generation run unsplit, each rank on its own eval rows: the Ulysses attention is installed
  only while a training step runs (`SequenceParallel.attention`).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

from sft.config.schema import Schema, config_schema, knob

log = logging.getLogger("sft")

# The attention implementations Ulysses can wrap: they take whole sequences and position_ids, and need no mask
SUPPORTED_ATTENTION = ("sdpa", "sdpa_varlen", "sdpa_slots", "flash_attention_2", "flash_attention_3")


@config_schema("sp", "sp")
@dataclass
class SequenceParallelConfig(Schema):
    """DeepSpeed Ulysses sequence parallelism: `size` ranks split every sequence (see the module docstring)."""

    size: int = knob(2, "ranks that split each sequence; the attention heads (and key/value heads, or the size by "
                        "them) must divide by it, and the processes by it (world = data-parallel x size)")

    def check(self, cfg=None):
        self.require("size", self.size >= 2, "must be >= 2 (sp=none: no sequence parallelism)")
        if cfg is None:
            return
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.require("size", world % self.size == 0,
                     f"splits each sequence over {self.size} processes, and this run has {world}: launch a "
                     f"multiple of {self.size} (./launch.sh --nproc {self.size} ...)")
        self.require("", cfg.fsdp is None, "sequence parallelism runs with DDP or DeepSpeed ZeRO, not under FSDP2 "
                     "here: fsdp=none (deepspeed=zero3 shards the weights)")
        attn = cfg.model.attn_implementation
        self.require("", attn in SUPPORTED_ATTENTION, f"model.attn_implementation={attn} cannot attend over a "
                     f"sequence split across ranks (Ulysses needs one of {', '.join(SUPPORTED_ATTENTION)})")
        self.require("", not (cfg.loss.get("aux") or {}), "loss.aux terms read the hidden states of whole "
                     "sequences, which sequence parallelism splits: not with sp (loss.aux={})")
        self.require("", not cfg.model.get("tiled_mlp_tokens"), "model.tiled_mlp_tokens is not combined with "
                     "sequence parallelism here: each rank's MLPs already see 1/size of the tokens")


def sequence_parallel_size(cfg) -> int:
    """The ranks that split each sequence in a config's run: `sp.size`, or 1 where the `sp` group is off."""
    return cfg.sp.size if cfg.sp is not None else 1


@dataclass
class SequenceParallel:
    """A run's sequence parallelism at run time: its group of ranks, and this rank's place in it."""

    size: int
    rank: int  # this process's place in its group
    group: object  # the torch process group of this rank's group
    _ulysses: object = field(default=None, repr=False)  # UlyssesAttention, built at the first training step

    @classmethod
    def start(cls, size: int) -> "SequenceParallel":
        """The groups of `size` consecutive ranks (every process calls this, in the same order)."""
        import torch.distributed as dist

        world, me = dist.get_world_size(), dist.get_rank()
        mine = None
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= me < first + size:
                mine = group
        _start_deepspeed_comm()
        log.info("sequence parallelism: %d groups of %d ranks (rank %d is %d of its group)", world // size, size,
                 me, me % size)
        return cls(size=size, rank=me % size, group=mine)

    def columns(self, length: int) -> tuple[int, int]:
        """The positions `[start, end)` of a `length`-long micro-batch that this rank computes."""
        chunk = length // self.size
        return self.rank * chunk, (self.rank + 1) * chunk

    def shard(self, inputs: dict) -> tuple[dict, tuple[int, int]]:
        """The model's inputs for this rank's positions, and which those are: `input_ids` and `position_ids`
        sliced (no mask: the attention gathers the positions, which tell it the samples and causality).

            input_ids [[5, 6, 7, 8]], position_ids [[0, 1, 0, 1]], size 2, rank 1
              ->  {input_ids [[7, 8]], position_ids [[0, 1]]}, (2, 4)
        """
        start, end = self.columns(inputs["input_ids"].shape[1])
        return {k: inputs[k][:, start:end] for k in ("input_ids", "position_ids")}, (start, end)

    def sum_over_group(self, t):
        """`t` summed over this rank's group (in place; no gradient flows through it)."""
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def whole_terms(self, terms):
        """A rank's loss terms of its slice of the positions (`sft.loss.terms.LossTerms`), with the per-sample sums
        (detached) summed over the group: the whole micro-batch's; `loss_sum` stays the slice's (its gradient)."""
        import torch

        from sft.loss.terms import LossTerms

        parts = [terms.numerator, terms.denominator, terms.ce_sum, terms.weight_sum, terms.tokens]
        if terms.correct is not None:
            parts.append(terms.correct)
        whole = [w.to(p.dtype) for w, p in zip(self.sum_over_group(torch.stack([p.double() for p in parts])), parts)]
        return LossTerms(terms.loss_sum, *whole[:5], whole[5] if terms.correct is not None else None)

    def sampler(self, inner, batch_size: int, seed: int):
        """The training sampler: `inner`'s indices, each micro-batch's `size` times in a row (see `RepeatedBatches`).
        A random order is drawn from `seed` and the epoch (accelerate's `SeedableRandomSampler`, which accelerate
        puts in a plain random sampler's place, and not in a wrapped one's), so that every rank draws the same."""
        from accelerate.data_loader import SeedableRandomSampler
        from torch.utils.data import RandomSampler

        if type(inner) is RandomSampler:
            inner = SeedableRandomSampler(inner.data_source, data_seed=seed)
        return RepeatedBatches(inner, batch_size, self.size)

    @contextmanager
    def attention(self, model):
        """DeepSpeed's Ulysses exchange around the model's attention while the block runs (a training step: its
        forward, and the backward's recomputation under activation checkpointing)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name = model.config._attn_implementation
        original = ALL_ATTENTION_FUNCTIONS[name]
        if self._ulysses is None:
            self._ulysses = UlyssesAttention(_core_attention(name, original), model.config, self.group)
        ALL_ATTENTION_FUNCTIONS[name] = self._ulysses
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS[name] = original


class UlyssesAttention:
    """transformers' attention signature around DeepSpeed's `UlyssesSPAttentionHF`, one per micro-batch size (its
    shapes fix the batch size: a packed micro-batch is one row). The mask is dropped, as DeepSpeed's own
    registration does: it was built for the local slice; the gathered `position_ids` carry causality and the
    packed samples' bounds to `core`."""

    def __init__(self, core, config, group):
        self.core, self.config, self.group = core, config.get_text_config(), group
        self._by_batch: dict[int, object] = {}

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        batch = query.shape[0]
        if batch not in self._by_batch:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            c = self.config
            self._by_batch[batch] = UlyssesSPAttentionHF(
                attn=self.core, batch_size=batch, attn_head_count=c.num_attention_heads,
                attn_head_size=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                kv_head_count=c.num_key_value_heads, num_hidden_layers=c.num_hidden_layers,
                process_group=self.group, seq_length_is_variable=True)
            log.info("sequence parallelism: DeepSpeed's Ulysses attention over %d ranks, micro-batches of %d row(s), "
                     "each rank %d of %d heads", self._by_batch[batch].world_size, batch,
                     c.num_attention_heads // self._by_batch[batch].world_size, c.num_attention_heads)
        return self._by_batch[batch](module, query, key, value, None, *args, **kwargs)


def _core_attention(name: str, original):
    """The attention Ulysses calls on whole sequences: sft's `sdpa_varlen` for sdpa (it separates the packed samples
    given by position_ids alone, where sdpa would need a mask), the model's own otherwise (flash attention's varlen
    reads position_ids itself)."""
    if name in ("sdpa", "sdpa_varlen", "sdpa_slots"):
        from sft.model.attention import sdpa_varlen_attention

        return sdpa_varlen_attention
    return original


def _start_deepspeed_comm() -> None:
    """DeepSpeed's collectives (`deepspeed.comm`, which its Ulysses attention calls) over torch's process group, also
    where DeepSpeed's engine is not the run's (DDP)."""
    import deepspeed.comm
    import torch.distributed as dist

    if not deepspeed.comm.is_initialized():
        from sft.training.processes.engines import announce_deepspeed_comm_build

        announce_deepspeed_comm_build()
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)


class RepeatedBatches:
    """A sampler that gives each micro-batch's indices `times` times in a row: accelerate deals the loader's batches
    out to the ranks in turn, so `times` consecutive ranks get the same batch. An epoch's last incomplete batch is
    left out (a loader would merge its copies into one batch).

        RepeatedBatches([4, 2, 7, 1, 3], batch_size=2, times=2)  ->  4 2 4 2 7 1 7 1   (3 left out)
    """

    def __init__(self, inner, batch_size: int, times: int):
        self.inner, self.batch_size, self.times = inner, batch_size, times
        self._warned = False

    def __len__(self) -> int:
        return len(self.inner) // self.batch_size * self.batch_size * self.times

    def __iter__(self):
        batch = []
        for index in self.inner:
            batch.append(index)
            if len(batch) == self.batch_size:
                for _ in range(self.times):
                    yield from batch
                batch = []
        if batch and not self._warned:
            self._warned = True
            log.warning("sequence parallelism: the epoch's last %d rows (fewer than a micro-batch of %d) are left "
                        "out", len(batch), self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)
