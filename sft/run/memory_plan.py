"""How a run fits its step in memory, decided before the first step from the estimate (`sft.model.memory`): the
rows of a micro-batch, and whether activations are checkpointed. Said in one line:

    memory: about 61.2 GiB of 71.2 GiB (90% of the GPU's 79.1) for up to 16,384 tokens a micro-batch: weights 15.2,
    gradients 0.2, optimizer 0.3, activations 44.9, loss 0.6 GiB (activation checkpointing off; on, about 19.1 GiB);
    4 rows a micro-batch x 4 accumulated: the step's 16 rows (set: 16 x 1)

The step's rows on a device, `per_device_train_batch_size x gradient_accumulation_steps`, are the user's and stay:
the plan only splits them, so the step's loss and update are those of the split as set (the loss is exact over
micro-batches). In order, the first that fits the limit:

1. without activation checkpointing (unless `trainer.activation_checkpointing=true`), the most rows a micro-batch
   that divide the step's (`trainer.fit_micro_batch=true`; else the micro-batch as set); packed rows in one process
   are fitted in tokens instead: the step's rows in one micro-batch, whole where it fits, else trained in pieces of
   consecutive samples of as many tokens as fit (`sft.training.step.micro_batches`), so that a micro-batch is as
   large as the memory allows whatever its samples' lengths, not sized for its longest samples;
2. the same with activation checkpointing (unless `trainer.activation_checkpointing=false`): it recomputes each
   layer's forward in the backward, about a third more compute, so it is on only where memory needs it.

    memory: about 70.9 GiB of 71.2 GiB (90% of the GPU's 79.1) for up to 21,504 tokens a micro-batch: ... (activation
    checkpointing off; on, about 22.0 GiB); the step's 80 rows in one packed micro-batch (set: 40 x 2), trained in
    pieces of at most 21,504 tokens

`trainer.micro_batch_tokens` sets the pieces' tokens itself (the split of the rows as set; checkpointing chosen at
it). Where nothing fits, the smallest micro-batch (a piece of one sample), with checkpointing unless it is false,
and a warning; a CUDA out-of-memory error then cuts the step further (`trainer.oom_retry`). The limit is
`trainer.memory_limit_gib`, or 90% of the GPU's memory (the rest for what the estimate leaves out: CUDA's allocator
cache, kernels' workspaces, the optimizer step's transient peak). On a CPU without `memory_limit_gib` nothing is fitted: the micro-batch as set,
checkpointing off unless set; the line is logged. Under DeepSpeed, FSDP2 or sequence parallelism, whose sharding
and splitting the estimate does not count, nothing is estimated: the micro-batch as set, checkpointing off unless
set. Under DDP rank 0's plan is every rank's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omegaconf import DictConfig

from sft.model.memory import GIB, Footprint, MemoryEstimate

log = logging.getLogger("sft")

DEVICE_SHARE = 0.9  # of a GPU's memory, where trainer.memory_limit_gib is null


@dataclass(frozen=True)
class MicroBatchBound:
    """The most a micro-batch of so many rows can hold, from the training split's longest samples: padded rows are
    each as long as the longest sample (rounded up to the collator's `pad_to_multiple_of`); a packed row is the
    longest samples one after another, each attending within itself. A stream, whose samples are not known before
    they are read, is bounded by `data.max_length`.

        longest (9, 5, 2), padded: 2 rows -> 18 tokens, squares 2 x 81;  packed: 14 tokens, squares 81 + 25
    """

    longest: tuple[int, ...]  # the longest samples' lengths, longest first
    packed: bool

    def tokens(self, rows: int) -> tuple[int, int]:
        """A micro-batch of `rows` rows: (its tokens, the sum of its attention spans' squares)."""
        if self.packed:
            top = self.longest[:rows]
            return sum(top), sum(n * n for n in top)
        return rows * self.longest[0], rows * self.longest[0] ** 2

    def piece(self, budget: int) -> tuple[int, int]:
        """A piece of a packed micro-batch cut at `budget` tokens: (its tokens, at most; its squares, at most). A
        sample longer than the budget is a piece alone; every sample is at most the longest, so the squares are at
        most the tokens times it.

            longest (9, 5, 2): budget 12 -> (12, 108); budget 4 -> (9, 81)
        """
        tokens = max(budget, self.longest[0])
        return tokens, tokens * self.longest[0]

    @classmethod
    def of(cls, train, rows: int, max_length: int, packed: bool, pad_to_multiple_of: int | None) -> MicroBatchBound:
        """The bound for micro-batches of up to `rows` rows of the split `train` (a stream: `max_length` each)."""
        import datasets
        import pyarrow.compute as pc

        if isinstance(train, datasets.Dataset) and len(train):
            ids = train.with_format("arrow").select_columns(["input_ids"])[:]["input_ids"]
            lengths = sorted(pc.list_value_length(ids).to_pylist(), reverse=True)[:rows]
        else:
            lengths = [max_length] * rows
        if not packed and pad_to_multiple_of:
            lengths = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in lengths]
        return cls(tuple(lengths), packed)


@dataclass(frozen=True)
class MemoryPlan:
    rows: int  # a micro-batch's
    accumulation: int  # micro-batches a step
    estimate: MemoryEstimate  # at `rows`, with its checkpointing
    fits: bool  # the estimate is within the limit
    tokens: int | None = None  # a packed micro-batch trained in pieces of at most so many tokens (None: whole)

    @property
    def checkpointing(self) -> bool:
        return self.estimate.checkpointing


def plan(footprint: Footprint, bound: MicroBatchBound, per_device: int, accumulation: int, limit: float | None,
         checkpointing: bool | None, fit: bool, by_tokens: bool = False, tokens: int | None = None) -> MemoryPlan:
    """The micro-batch's rows (and, packed, its pieces' tokens) and the checkpointing for a step of
    `per_device x accumulation` rows (see the module's docstring). `limit` None: nothing is fitted; `by_tokens`: a
    packed step fitted in tokens; `tokens`: the pieces' tokens as set. With a step of 16 rows:

        fit, 16 rows fit without checkpointing                  -> 16 x 1, off
        fit, only 4 fit without it                              -> 4 x 4, off
        fit by tokens, pieces of up to 3,000 fit without it     -> 16 x 1 in pieces of 3,000 tokens, off
        fit, not 1 without it, 8 with it                        -> 8 x 2, on
        not fit (per_device 16), 16 do not fit without it       -> 16 x 1, on
        checkpointing=False, not 1 fits                         -> 1 x 16, off (fits: False)
    """
    def estimate(rows: int, way: bool) -> MemoryEstimate:
        return footprint.estimate_tokens(*bound.tokens(rows), way)

    def in_pieces(budget: int, way: bool) -> MemoryEstimate:
        return footprint.estimate_tokens(*bound.piece(budget), way)

    step_rows = per_device * accumulation
    ways = [checkpointing] if checkpointing is not None else [False, True]
    if tokens is not None:  # the pieces as set: checkpointing where they need it
        budget = min(tokens, bound.tokens(per_device)[0])
        if limit is None:
            return MemoryPlan(per_device, accumulation, in_pieces(budget, bool(checkpointing)), True, tokens)
        found = next((e for e in (in_pieces(budget, way) for way in ways) if e.total <= limit), None)
        return MemoryPlan(per_device, accumulation, found or in_pieces(budget, ways[-1]), found is not None, tokens)
    if limit is None:
        return MemoryPlan(per_device, accumulation, estimate(per_device, bool(checkpointing)), True)
    by_tokens &= fit
    if by_tokens:
        sizes = [step_rows]  # whole; else in pieces of tokens (below)
    elif fit:
        sizes = [rows for rows in range(step_rows, 0, -1) if step_rows % rows == 0]
    else:
        sizes = [per_device]
    for way in ways:
        for rows in sizes:
            found = estimate(rows, way)
            if found.total <= limit:
                return MemoryPlan(rows, step_rows // rows, found, True)
        if by_tokens and (budget := largest_budget(lambda b: in_pieces(b, way).total <= limit, bound.longest[0],
                                                   bound.tokens(step_rows)[0])):
            return MemoryPlan(step_rows, 1, in_pieces(budget, way), True, budget)
    if by_tokens:  # a piece of one sample, the least there is
        return MemoryPlan(step_rows, 1, in_pieces(bound.longest[0], ways[-1]), False, bound.longest[0])
    return MemoryPlan(sizes[-1], step_rows // sizes[-1], estimate(sizes[-1], ways[-1]), False)


def largest_budget(fits, least: int, whole: int) -> int | None:
    """The most tokens below `whole` for which `fits(tokens)` (true up to some number, false beyond it), at least
    `least` (a piece's longest sample); None where `least` does not fit."""
    if not fits(least):
        return None
    low, high = least, whole  # fits(low); high: does not (the whole micro-batch, tried before)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def fit_step_in_memory(trainer: DictConfig, data, args, model, loss, train, pad_to_multiple_of: int | None,
                       engine: str | None = None, second_model=None) -> int | None:
    """The plan of the `trainer` section (its activation checkpointing, memory limit and micro-batch knobs) for
    `model` and the training split `train` of the `data` section (`packing`, `max_length`), logged and put into `args`
    (the micro-batch's rows, the accumulation, the checkpointing), before the trainer is built from them; returns the
    tokens of a packed micro-batch's pieces for the trainer (None: whole). None planned under an `engine` that shards
    the step (DeepSpeed, FSDP2, sequence parallelism: `sft.run.build.sharding_engine`). On a GPU the model is moved
    there first (the plain Trainer would), as the activations are measured where they will be held. The
    `second_model` the loss reads at each step (a teacher) is counted beside the model (`sft.model.memory`)."""
    import torch

    from sft.loss.kernels import choose_impl
    from sft.loss.logits import router_aux_loss_coef
    from sft.model.memory import footprint
    from sft.training.step.micro_batches import refusal as pieces_refusal

    asked = trainer.activation_checkpointing
    if engine is not None:
        if asked is None:
            log.info("activation checkpointing: off (trainer.activation_checkpointing=null chooses it from the "
                     "memory estimate, which %s does not have: set it)", engine)
        return trainer.micro_batch_tokens
    on_gpu = args.device.type == "cuda"
    if on_gpu and next(model.parameters()).device.type == "cpu":
        model.to(args.device)
    impl = choose_impl(loss.impl, vocab_size=model.config.vocab_size, on_gpu=on_gpu, zero3_trainable_head=False,
                       reads_logits=loss.reads_logits)
    device = torch.cuda.get_device_properties(args.device).total_memory if on_gpu else None
    limit_gib = trainer.memory_limit_gib
    limit = limit_gib * GIB if limit_gib is not None else DEVICE_SHARE * device if device else None
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    # packed rows fitted in tokens where the trainer can cut them (DeepSpeed and sequence parallelism returned above)
    by_tokens = bool(data.packing) and pieces_refusal(args.world_size, False, False,
                                                          bool(router_aux_loss_coef(model.config))) is None
    try:
        found = footprint(model, optim=args.optim, optim_args=args.optim_args, pure=trainer.precision == "pure",
                          autocast_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
                          lean_loss=impl != "naive", chunk_tokens=getattr(loss, "chunk_tokens", 1024),
                          second_model=second_model)
    except Exception as e:  # noqa: BLE001 - a model the probe's plain forward does not fit: the run goes on as set
        chosen = f"the probe's forward of {type(model).__name__} failed: " + (str(e).splitlines()[0] if str(e) else
                                                                            type(e).__name__)
    else:
        bound = MicroBatchBound.of(train, per_device * accumulation, data.max_length, data.packing,
                                   pad_to_multiple_of)
        chosen = plan(found, bound, per_device, accumulation, limit, asked, trainer.fit_micro_batch, by_tokens,
                      trainer.micro_batch_tokens)
    chosen = same_on_every_rank(chosen)  # every rank, whatever its own probe did: all join the broadcast
    if isinstance(chosen, str):
        log.info("memory: not estimated (%s); activation checkpointing %s", chosen, "on" if asked else "off")
        return trainer.micro_batch_tokens
    log.info("%s", line(chosen, per_device, accumulation, limit, limit_gib, device))
    if not chosen.fits:
        log.warning("memory: no micro-batch of the step's %d rows fits the limit%s: set a smaller data.max_length%s, "
                    "or a larger trainer.memory_limit_gib where the device has more; an out-of-memory error will "
                    "cut the step further (trainer.oom_retry)", chosen.rows * chosen.accumulation,
                    "" if chosen.checkpointing else " without activation checkpointing",
                    "" if chosen.checkpointing else ", trainer.activation_checkpointing=null (or true)")
    args.per_device_train_batch_size, args.gradient_accumulation_steps = chosen.rows, chosen.accumulation
    if chosen.checkpointing and not args.activation_checkpointing:
        args.activation_checkpointing = True
        args.activation_checkpointing_kwargs = {"use_reentrant": False}
    return chosen.tokens


def line(chosen: MemoryPlan, per_device: int, accumulation: int, limit: float | None, limit_gib: float | None,
         device: int | None) -> str:
    """The one line the plan is said in (the module's docstring)."""
    if limit is None:
        said = chosen.estimate.line()  # a CPU
    elif limit_gib is not None:
        size = f"{limit / GIB:.1f} GiB" if limit >= GIB else f"{limit / 2**20:.0f} MiB"
        said = chosen.estimate.line(f"{size} (trainer.memory_limit_gib)")
    else:
        said = chosen.estimate.line(f"{limit / GIB:.1f} GiB ({DEVICE_SHARE:.0%} of the GPU's {device / GIB:.1f})")
    changed = (chosen.rows, chosen.accumulation) != (per_device, accumulation)
    if chosen.tokens is not None:
        rows = (f"the step's {chosen.rows} rows in one packed micro-batch (set: {per_device} x {accumulation})"
                if changed else "each packed micro-batch")
        said += f"; {rows}, trained in pieces of at most {chosen.tokens:,} tokens"
    elif changed:
        said += (f"; {chosen.rows} row{'s' if chosen.rows > 1 else ''} a micro-batch x {chosen.accumulation} "
                 f"accumulated: the step's "
                 f"{chosen.rows * chosen.accumulation} rows (set: {per_device} x {accumulation})")
    return said


def same_on_every_rank(chosen: MemoryPlan | str) -> MemoryPlan | str:
    """Rank 0's plan (or why it has none) on every rank: a split that differed between ranks would hang the first
    all-reduce."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return chosen
    shared = [chosen]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
