"""Batches: `WeightedDataCollator` pads (or packs) sequences and puts each token's weight on its assistant
tokens."""

from __future__ import annotations

import math

import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from sft.data.tokens.batch import (IGNORE_INDEX, TEACHER_TOP_K_COLUMNS, TEACHER_TOP_K_KEYS, trained_positions,
                                  trained_tokens)


class WeightedDataCollator(DataCollatorForSeq2Seq):
    """`DataCollatorForSeq2Seq` that also builds per-token `weights` and keeps each row's `source_line`.

    A sequence's `sample_weight` (times its `token_weights`, where the loss has static token weights) goes on its
    assistant tokens (labels other than -100), 0 elsewhere:

        {labels: [-100, -100, 7, 8], sample_weight: 2.0, token_weights: [1, 1, 3, 1]}  ->  weights [[0, 0, 6, 2]]

    With `packing`, the micro-batch becomes one row without padding (`DataCollatorWithFlattening`):
    `position_ids` restart at 0 for every sample, which is how the model's attention (a block-diagonal
    mask for sdpa and eager) and the loss tell the samples apart, and the samples' boundaries
    (`cu_seq_lens_q/k`, `max_length_q/k`) go to the attention for flash attention's varlen kernels and
    `sdpa_varlen` (`sft.model.attention`); there is no `attention_mask`.

    Where the trained tokens are is found here, on the CPU (`sft.data.tokens.batch.trained_positions`: `target_*`,
    `num_samples`), so that the loss need not find them on the device.

    The batch holds what the model's forward takes plus `labels`, `weights`, `source_lines`,
    `source_views` (which text of its row a sequence is, see `chat_views`), a mixture's `source_ids` (the
    rows' `source`, `sft.data.splits.mixture`), each auxiliary term's row values `aux_<name>` ([rows]) and a cached
    teacher's logits (`teacher_top_k`), which the trainer pops before the forward; from a stream, `stream_state`, the
    stream's position after the micro-batch's last sequence (`sft.data.splits.streaming`), which the trainer keeps.

    `sequence_parallel` > 1 (`sft.training.processes.sequence_parallel`: that many ranks split each sequence): every
    batch's length is a multiple of it (a packed row padded at its end, its last sample's positions going on), and every
    batch has `position_ids` (a padded batch's 0, 1, ... per row), which tell the split attention the sequence; no
    `cu_seq_lens`/`max_length` (they would describe the whole row to each slice).
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None, packing: bool = False,
                 sequence_parallel: int = 1):
        if sequence_parallel > 1:
            pad_to_multiple_of = math.lcm(pad_to_multiple_of or 1, sequence_parallel)
        super().__init__(tokenizer=tokenizer, padding=True, pad_to_multiple_of=pad_to_multiple_of,
                         label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
        self.packing = packing
        self.sequence_parallel = sequence_parallel
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True) if packing else None

    def __call__(self, features, return_tensors=None):
        raw = features
        lines = torch.as_tensor([f["source_line"] for f in features], dtype=torch.long)
        views = torch.as_tensor([f.get("view", 0) for f in features], dtype=torch.long)
        weights = torch.as_tensor([f["sample_weight"] for f in features], dtype=torch.float32)
        aux = {k: torch.as_tensor([f[k] for f in features], dtype=torch.float64)
               for k in features[0] if k.startswith("aux_")}
        token_weights = [torch.as_tensor(f["token_weights"], dtype=torch.float32) * w
                         for f, w in zip(features, weights)] if "token_weights" in features[0] else None
        sources = (torch.as_tensor([f["source"] for f in features], dtype=torch.long) if "source" in features[0]
                   else None)
        cached = [[f[key] for key in TEACHER_TOP_K_COLUMNS] for f in features] if TEACHER_TOP_K_COLUMNS[0] in raw[0] \
            else None
        features = [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
        if self.packing:
            batch = self.flatten(features)
            if token_weights is None:
                lengths = torch.as_tensor([len(f["input_ids"]) for f in features])
                row_weights = weights.repeat_interleave(lengths)[None, :]
            else:
                row_weights = torch.cat(token_weights)[None, :]
        else:
            batch = super().__call__(features, return_tensors)
            row_weights = weights[:, None]
            if token_weights is not None:
                row_weights = torch.zeros(batch["labels"].shape)
                left = self.tokenizer.padding_side == "left"
                for i, w in enumerate(token_weights):
                    if left:
                        row_weights[i, row_weights.size(1) - len(w):] = w
                    else:
                        row_weights[i, :len(w)] = w
        batch["weights"] = torch.where(batch["labels"] != IGNORE_INDEX, row_weights, 0.0)
        batch["source_lines"], batch["source_views"] = lines, views
        if sources is not None:  # a mixture's: which source each row is of
            batch["source_ids"] = sources
        batch.update(aux)
        if cached is not None:
            batch.update(self.teacher_top_k(batch, [f["labels"] for f in features], cached))
        if "stream_state" in raw[-1]:  # a stream's position after this micro-batch (sft.data.splits.streaming)
            batch["stream_state"] = raw[-1]["stream_state"]
        if self.sequence_parallel > 1:
            self._whole_positions(batch)
        batch.update(trained_positions(batch["labels"], batch.get("position_ids") if self.packing else None))
        return batch

    def teacher_top_k(self, batch: dict, labels: list, cached: list) -> dict:
        """A cached teacher's logits (`sft.model.teacher_cache`) laid out as the batch's positions, `TEACHER_TOP_K_KEYS`
        `[rows, positions, k]`: each sequence's trained tokens' k ids and logits (its `labels`; `cached`: its flat
        `TEACHER_TOP_K_COLUMNS`) at the positions predicting them, where the second model's logits would be; 0 at the
        others, which no loss reads.

            labels [-100, -100, 7, 8], ids [4, 1, 0, 2] (k = 2)  ->  teacher_top_ids [[[0, 0], [4, 1], [0, 2], [0, 0]]]
        """
        length = batch["labels"].shape[1]
        predicting = [torch.as_tensor(trained_tokens(own)) - 1 for own in labels]  # each sequence's positions
        k = next((len(ids) // len(at) for (ids, _), at in zip(cached, predicting) if len(at)), 1)
        ids = torch.zeros(*batch["labels"].shape, k, dtype=torch.int32)
        values = torch.zeros(*batch["labels"].shape, k, dtype=torch.float32)
        offset = 0
        for row, (own, at, (own_ids, own_values)) in enumerate(zip(labels, predicting, cached)):
            if self.packing:
                row, at = 0, at + offset
                offset += len(own)
            elif self.tokenizer.padding_side == "left":
                at = at + length - len(own)
            if len(own_ids) != len(at) * k:
                raise ValueError(f"a sequence with {len(at)} trained tokens has {len(own_ids)} cached teacher ids, "
                                 f"not {len(at)} x {k}: a cache written for other data")
            ids[row, at] = torch.as_tensor(own_ids, dtype=torch.int32).view(len(at), k)
            values[row, at] = torch.as_tensor(own_values, dtype=torch.float32).view(len(at), k)
        return dict(zip(TEACHER_TOP_K_KEYS, (ids, values)))

    def _whole_positions(self, batch: dict) -> None:
        """`position_ids` everywhere and a length that divides by `sequence_parallel` (see the class docstring)."""
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            batch.pop(key, None)
        if not self.packing:
            rows, length = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
            return
        extra = -batch["input_ids"].shape[1] % self.pad_to_multiple_of
        if extra:
            last = batch["position_ids"][:, -1:]
            pads = {"input_ids": torch.full((1, extra), self.tokenizer.pad_token_id),
                    "labels": torch.full((1, extra), IGNORE_INDEX),
                    "position_ids": last + torch.arange(1, extra + 1)[None],
                    "weights": torch.zeros(1, extra)}
            for key, pad in pads.items():
                batch[key] = torch.cat([batch[key], pad.to(batch[key].dtype)], dim=1)
