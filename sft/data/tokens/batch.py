"""What a batch of tokens holds, read the same way everywhere: the label without a loss, and the
samples of a packed row.

A packed row (`data.packing`) holds several samples one after another; its `position_ids` restart at
0 where each sample starts (`DataCollatorWithFlattening`). `sample_starts` is that one rule;
`packed_bounds` (for the attention kernels and reports: where each sample of a row begins and ends)
and `sample_index` (for the loss: which sample every token belongs to, over the whole batch) read it.

    positions [[0, 1, 2, 0, 1]]  ->  packed_bounds(positions[0]) = [0, 3, 5]
                                     sample_index(positions)    = ([[0, 0, 0, 1, 1]], 2)
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100  # a label that takes no loss (prompt tokens, padding), as transformers' losses use it
# Where a batch's trained tokens are, found by the collator on the CPU (`trained_positions`): the loss reads them
# instead of finding them on the device, which would wait for the GPU (a `nonzero`, a count of the samples)
TARGET_KEYS = ("target_rows", "target_cols", "target_samples", "num_samples")
# A cached teacher's largest logits (`sft.model.teacher_cache`): a row's columns, its trained tokens' k ids and logits
# flat, and a batch's, `[rows, positions, k]` at the positions predicting them (the collator's `teacher_top_k`)
TEACHER_TOP_K_COLUMNS = ("teacher_ids", "teacher_logits")
TEACHER_TOP_K_KEYS = ("teacher_top_ids", "teacher_top_logits")


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """True where a packed sample begins: its position restarts at 0."""
    return position_ids == 0


def packed_bounds(positions: torch.Tensor) -> torch.Tensor:
    """The sample boundaries of one packed row (as `cu_seq_lens_q`): each sample's start, then the end."""
    starts = sample_starts(positions).nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([positions.numel()])])


def packed_slots(bounds: torch.Tensor, tokens: int, longest: int) -> torch.Tensor:
    """Each token of a packed row (of `tokens`, sample boundaries `bounds`) as its place in the row's samples laid
    out one a row, right-padded to the `longest`: [samples * longest].

        bounds [0, 3, 5], tokens 5, longest 3  ->  [0, 1, 2, 3, 4]  (sample 1 in slots 3, 4 of 0..5)
    """
    starts = bounds[:-1]
    sample = torch.repeat_interleave(torch.arange(starts.numel(), device=bounds.device), bounds[1:] - starts,
                                     output_size=tokens)
    return sample * longest + torch.arange(tokens, device=bounds.device) - starts[sample]


def sample_index(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each token's sample, numbered over the whole batch row after row, and the number of samples."""
    starts = sample_starts(position_ids).long()
    per_row = starts.sum(dim=1)
    index = starts.cumsum(dim=1) - 1 + (per_row.cumsum(0) - per_row)[:, None]
    return index, int(per_row.sum())


def input_tokens(batch: dict) -> torch.Tensor:
    """The tokens of a micro-batch that are not padding (all of a packed row's)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)


def trained_tokens(labels) -> np.ndarray:
    """The positions of a sequence's trained tokens as the loss reads them: labels other than -100, after the first
    (position t - 1 predicts the token at t).

        labels [-100, -100, 7, 8, -100]  ->  [2, 3]
    """
    labels = np.asarray(labels)
    return np.flatnonzero(labels[1:] != IGNORE_INDEX) + 1


def trained_positions(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
    """Where a batch's trained tokens are, as the loss reads them (`TARGET_KEYS`): the row and column of each position
    that predicts an assistant token (position t predicts label t + 1), that token's sample (its row, or its sample of
    a packed row), and the batch's number of samples; made by the collator, on the CPU, before the batch moves.

        labels [[-100, 5, 6, -100]]  ->  target_rows [0, 0], target_cols [0, 1], target_samples [0, 0], num_samples 1
    """
    rows, cols = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    if position_ids is None:
        samples, count = rows, labels.shape[0]
    else:
        index, count = sample_index(position_ids)
        samples = index[:, 1:][rows, cols]
    return {"target_rows": rows, "target_cols": cols, "target_samples": samples, "num_samples": count}


def targets_of(batch: dict) -> tuple | None:
    """A batch's trained positions (`trained_positions`), left in it; None where it has none."""
    return None if "target_rows" not in batch else tuple(batch[key] for key in TARGET_KEYS)


def pop_targets(batch: dict) -> tuple | None:
    """A batch's trained positions (`trained_positions`), taken out of it (the model's forward never sees them); None
    where it has none (a batch cut into pieces, a collator of your own)."""
    found = [batch.pop(key, None) for key in TARGET_KEYS]
    return None if found[0] is None else tuple(found)
