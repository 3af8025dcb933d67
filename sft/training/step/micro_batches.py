"""A micro-batch trained in pieces: a packed one in pieces of at most so many tokens (`trainer.micro_batch_tokens`,
or the memory plan's budget: `sft.run.memory_plan`), and, on a CUDA out-of-memory error, any one in smaller pieces
from then on: the step is trained again from its first micro-batch (`trainer.oom_retry`).

The step keeps its rows, its loss and its update. The loss of a piece is its tokens' weighted sum over the
denominator of the whole step (`sft.loss.base`), so the pieces' gradients add up to their micro-batch's, as the
micro-batches' add up to the step's: gradient accumulation with a smaller micro-batch and the same global batch.
After an out-of-memory error the step starts again from its first micro-batch because an error inside the backward
leaves some gradients accumulated and others not; the token budget is halved (or, without one, every micro-batch
cut into twice as many pieces), said in the log and kept in every checkpoint, so that a resume trains as the run did.

    padded, 4 rows, 2 pieces:   input_ids [4, T] -> [2, T] [2, T]; labels, weights, source_lines alike by row
    packed, one row of samples (position_ids 0 1 2 0 1 0 1 2 3), 2 pieces: cut where a sample starts, near the
    middle of the tokens -> position_ids 0 1 2 0 1 | 0 1 2 3; each piece's cu_seq_lens and max_length its own
    packed, the same row, at most 5 tokens a piece: consecutive samples while they fit (one longer alone)
    -> position_ids 0 1 2 0 1 | 0 1 2 3

Not cut (an out-of-memory error is raised, saying why, and `sft.training.observability.advice` adds the settings that
lower memory; a token budget is refused in one line): a micro-batch of one sample; more than one process (the
other ranks would wait in the step's all-reduce); DeepSpeed (its engine owns the backward and the accumulation);
sequence parallelism; a router aux loss (a mixture of experts' balance loss of a micro-batch is not the sum of its
pieces').
"""

from __future__ import annotations

import logging

import torch

from sft.data.tokens.batch import TARGET_KEYS, packed_bounds, sample_starts

log = logging.getLogger("sft")

PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # recomputed for each piece


def is_packed(batch: dict) -> bool:
    """Whether `batch` is packed: one row of samples told apart by `position_ids` restarting at 0, no mask."""
    return "attention_mask" not in batch and "position_ids" in batch and batch["input_ids"].shape[0] == 1


def samples_in(batch: dict) -> int:
    """The samples of a micro-batch: its rows, or a packed row's samples."""
    if is_packed(batch):
        return int(sample_starts(batch["position_ids"][0]).sum())
    return batch["input_ids"].shape[0]


def split_micro_batch(batch: dict, pieces: int) -> list[dict]:
    """`batch` as at most `pieces` micro-batches of its samples in order (fewer where it has fewer samples)."""
    if pieces <= 1 or samples_in(batch) <= 1:
        return [batch]
    batch = without_targets(batch)
    return _split_packed(batch, pieces) if is_packed(batch) else _split_rows(batch, pieces)


def without_targets(batch: dict) -> dict:
    """`batch` without the collator's trained positions (`sft.data.tokens.batch.TARGET_KEYS`: the whole micro-batch's):
    each piece's loss finds its own."""
    return {key: value for key, value in batch.items() if key not in TARGET_KEYS}


def _split_rows(batch: dict, pieces: int) -> list[dict]:
    rows = batch["input_ids"].shape[0]
    for key, value in batch.items():
        if not (torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows):
            raise ValueError(f"a padded micro-batch's {key!r} is not a tensor of one entry a row")
    return [{key: value[group[0]:group[-1] + 1] for key, value in batch.items()}
            for group in torch.arange(rows).tensor_split(min(pieces, rows))]


def split_by_tokens(batch: dict, budget: int | None) -> list[dict]:
    """A packed `batch` as pieces of consecutive samples of at most `budget` tokens each (a longer sample alone in
    its own); a padded one, or any where `budget` is None, whole."""
    if budget is None or not is_packed(batch) or batch["input_ids"].shape[1] <= budget:
        return [batch]
    batch = without_targets(batch)
    bounds = packed_bounds(batch["position_ids"][0]).tolist()
    groups, used = [[]], 0
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if groups[-1] and used + (end - start) > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += end - start
    return _packed_pieces(batch, bounds, groups)


def longest_sample(batch: dict) -> int:
    """The tokens of the longest sample of a micro-batch (a padded one: its row length)."""
    if is_packed(batch):
        return int(packed_bounds(batch["position_ids"][0]).diff().max())
    return batch["input_ids"].shape[1]


def _split_packed(batch: dict, pieces: int) -> list[dict]:
    bounds = packed_bounds(batch["position_ids"][0]).tolist()
    starts, ends, length = bounds[:-1], bounds[1:], bounds[-1]
    # each sample to the piece its middle token falls in: consecutive samples, about equal tokens a piece
    piece_of = [min(pieces - 1, int((start + end) / 2 * pieces / length)) for start, end in zip(starts, ends)]
    return _packed_pieces(batch, bounds, [[i for i, p in enumerate(piece_of) if p == piece] for piece in range(pieces)])


def _packed_pieces(batch: dict, bounds: list[int], groups: list[list[int]]) -> list[dict]:
    """One micro-batch for each group of consecutive samples (the indices of samples of the packed row whose sample
    boundaries are `bounds`); empty groups left out."""
    starts, ends, length = bounds[:-1], bounds[1:], bounds[-1]
    per_sample = [key for key, value in batch.items() if key not in PACKED_KWARGS and torch.is_tensor(value)
                  and value.dim() == 1 and value.shape[0] == len(starts)]
    out = []
    for group in (g for g in groups if g):
        first, last = group[0], group[-1]
        a, b = starts[first], ends[last]
        piece = {}
        for key, value in batch.items():
            if key in per_sample:
                piece[key] = value[first:last + 1]
            elif key in PACKED_KWARGS:
                continue
            elif torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (1, length):
                piece[key] = value[:, a:b]  # a token's (a cached teacher's logits: [1, length, k])
            else:
                raise ValueError(f"a packed micro-batch's {key!r} is neither a token's nor a sample's")
        own_bounds = packed_bounds(piece["position_ids"][0])
        for side in ("q", "k"):
            if f"cu_seq_lens_{side}" in batch:
                piece[f"cu_seq_lens_{side}"] = own_bounds.to(batch[f"cu_seq_lens_{side}"].dtype)
            if f"max_length_{side}" in batch:
                piece[f"max_length_{side}"] = int(own_bounds.diff().max())
        out.append(piece)
    return out


class MicroBatchPieces:
    """How each micro-batch trains: a packed one in pieces of at most `tokens` tokens (None: whole), each micro-batch
    or piece in `pieces` parts (1 until an out-of-memory error without a token budget); and why this run cannot cut
    them after an out-of-memory error (`refusal`; None where it can)."""

    def __init__(self, refusal: str | None, tokens: int | None = None):
        self.pieces = 1
        self.tokens = tokens
        self.halved = False  # the token budget was halved after an out-of-memory error (kept on resume)
        self.refusal = refusal

    def split(self, batch: dict) -> list[dict]:
        """`batch` as the pieces it trains in, in order."""
        return [piece for part in split_by_tokens(batch, self.tokens) for piece in split_micro_batch(part, self.pieces)]

    def state_dict(self) -> dict:
        return {"micro_batch_pieces": self.pieces, "micro_batch_tokens": self.tokens if self.halved else None}

    def load_state_dict(self, state: dict) -> None:
        self.pieces = int(state.get("micro_batch_pieces", 1))
        if self.pieces > 1:
            log.info("trainer.oom_retry: each micro-batch trains in %d pieces, as the run did since an out-of-memory "
                     "error (the step's rows and loss unchanged)", self.pieces)
        saved = state.get("micro_batch_tokens")
        if saved is not None:
            self.tokens, self.halved = min(int(saved), self.tokens or int(saved)), True
            log.info("trainer.oom_retry: packed micro-batches train in pieces of at most %d tokens, as the run did "
                     "since an out-of-memory error (the step's rows and loss unchanged)", self.tokens)

    def after_out_of_memory(self, error: torch.OutOfMemoryError, batch: dict, step: int) -> None:
        """Halve the token budget (without one: cut every micro-batch into twice as many pieces) from now on, saying
        so; or raise `error` saying why the step cannot be retried smaller."""
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        samples = samples_in(batch)
        why = self.refusal
        budget = self.tokens is not None and is_packed(batch)
        if why is None and budget and self.tokens <= longest_sample(batch):
            why = f"each piece holds one sample (pieces of at most {self.tokens} tokens)"
        elif why is None and not budget and -(-samples // self.pieces) <= 1:
            why = f"each piece of the micro-batch ({samples} sample(s) in {self.pieces} piece(s)) holds one sample"
        if why is not None:
            raise torch.OutOfMemoryError(f"{first_line} (not retried at a smaller micro-batch: {why})") from error
        if budget:
            self.tokens, self.halved = self.tokens // 2, True
            smaller = f"each packed micro-batch in pieces of at most {self.tokens} tokens"
        else:
            self.pieces *= 2
            smaller = f"each micro-batch in {self.pieces} pieces"
        log.warning("step %d: out of memory in a micro-batch of %d sample(s) (%s): training the step again from its "
                    "first micro-batch with %s (the step's rows, loss and update unchanged; kept for the rest of the "
                    "run and in its checkpoints)", step, samples, first_line, smaller)


def refusal(processes: int, deepspeed: bool, sequence_parallel: bool, router_aux: bool) -> str | None:
    """Why this run cannot train a micro-batch in pieces (None: it can)."""
    if processes > 1:
        return f"{processes} processes: the other ranks would wait in the step's all-reduce"
    if deepspeed:
        return "DeepSpeed's engine owns the backward and the accumulation"
    if sequence_parallel:
        return "sequence parallelism splits each sequence over the ranks"
    if router_aux:
        return "the router aux loss of a micro-batch is not the sum of its pieces' (model.router_aux_loss_coef)"
    return None
