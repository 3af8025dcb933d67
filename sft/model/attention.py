"""`sdpa_varlen`: sdpa that attends each sample of a packed row on its own.

A packed micro-batch (`data.packing`) is one row holding several samples. Flash attention's varlen
kernels take the samples' boundaries (`cu_seq_lens_q`) and attend within each sample; transformers'
sdpa and eager paths instead build a block-diagonal mask over the whole row and compute attention
across all of it, quadratic in the row's length, which can cost more than the padding saved. This is
the varlen path for sdpa, registered through transformers' `AttentionInterface`: each sample's queries
attend to its own keys only, with sdpa's causal kernel, in one call for the whole row. Without
boundaries (padded batches, generation) it is plain sdpa. The recipe uses it in place of `sdpa` when
`data.packing=true`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sft.data.tokens.batch import packed_bounds, packed_slots

NAME = "sdpa_varlen"


def sdpa_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature; query [1, heads, T, d] and keys of a packed row, or any batch.

    The packed row's queries, keys and values are laid out as [samples, heads, longest, d] for one causal
    sdpa call, and the outputs gathered back: causal attention never looks past a query's own position, so
    the slots after a short sample's end are never attended to by its tokens, and their outputs are dropped.
    Only attention sees this layout; everything else runs on the packed tokens. A sliding-window layer
    gets a banded causal mask once a sample is longer than its window.
    """
    bounds, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    positions = kwargs.get("position_ids")
    if bounds is None and attention_mask is None and positions is not None and positions.shape[0] == 1:
        bounds = packed_bounds(positions[0])  # a packed row given by its position_ids alone
        longest = (bounds[1:] - bounds[:-1]).max()
    window = kwargs.get("sliding_window")  # Mistral, Gemma-2/3, Qwen2 layers attend to the last `window` keys
    if bounds is None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        if attention_mask is None and key.shape[2] == query.shape[2]:  # sdpa_varlen_mask returned no mask
            attention_mask = _causal_band(query.shape[2], window, query.device)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    samples, longest = bounds.numel() - 1, int(longest)
    slots = packed_slots(bounds, query.shape[2], longest)

    def spread(x):  # [1, heads, T, d] -> [samples, heads, longest, d]
        out = x.new_zeros(x.shape[1], samples * longest, x.shape[3])
        out[:, slots] = x[0]
        return out.view(x.shape[1], samples, longest, x.shape[3]).transpose(0, 1)

    band = _causal_band(longest, window, query.device)
    out, _ = sdpa_attention_forward(module, spread(query), spread(key), spread(value), band, dropout=dropout,
                                    scaling=scaling, is_causal=band is None)
    return out.reshape(samples * longest, *out.shape[2:])[slots][None], None  # [1, T, heads, d]


def sdpa_varlen_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """sdpa's mask, but none for an unpadded input without a cache: `sdpa_varlen_attention` separates the
    samples of a packed row itself, and a block-diagonal mask over the whole row would cost O(T^2)."""
    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


def _causal_band(length: int, window: int | None, device) -> torch.Tensor | None:
    """A sliding window's causal mask [1, 1, length, length] (query i sees keys i - window < j <= i, as
    transformers' sliding-window masks), or None where plain causal attention is the same."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    return ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window))[None, None]


def register() -> None:
    """Make `attn_implementation="sdpa_varlen"` loadable."""
    AttentionInterface.register(NAME, sdpa_varlen_attention)
    AttentionMaskInterface.register(NAME, sdpa_varlen_mask)
