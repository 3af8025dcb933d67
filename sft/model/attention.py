"""`sdpa_varlen`: attention on each sample of a packed row on its own, with no flash-attn build.

A packed micro-batch (`data.packing`) is one row holding several samples. Flash attention's varlen
kernels take the samples' boundaries (`cu_seq_lens_q`) and attend within each sample; transformers'
sdpa and eager paths instead build a block-diagonal mask over the whole row and compute attention
across all of it, quadratic in the row's length, which can cost more than the padding saved. This is
the varlen path for sdpa, registered through transformers' `AttentionInterface`, in one call for the whole row:

- on a CUDA GPU in half precision, PyTorch's own varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`,
  torch 2.10+): the samples' boundaries as flash attention takes them, nothing padded;
- elsewhere (a CPU, fp32), each sample laid out in a slot of the longest sample's length for one causal sdpa call
  (`sdpa_slots` forces this path: the bench measures the kernel against it).

The boundaries come once a micro-batch from the collator (`cu_seq_lens_q`, `max_length_q`: no device read in any
layer), and the slots' index is built once a micro-batch and reused by every layer. Without boundaries (padded
batches, generation) it is plain sdpa. The recipe uses it in place of `sdpa` when `data.packing=true`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sft.data.tokens.batch import packed_bounds, packed_slots

NAME = "sdpa_varlen"
SLOTS = "sdpa_slots"  # the same, always on sdpa's slots (the bench's measure of PyTorch's varlen kernel)
_slots_of = {}  # the slots' index of the micro-batch going through the layers: (its boundaries, tokens) -> index


def sdpa_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, kernel=NAME,
                          **kwargs):
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
    if kernel == NAME and torch_varlen_runs(query, dropout) and not (window is not None and longest > window
                                                                      and not varlen_takes_window()):
        return _torch_varlen(query, key, value, bounds, longest, scaling, window), None
    slots = _slots(bounds, query.shape[2], longest)

    def spread(x):  # [1, heads, T, d] -> [samples, heads, longest, d]
        out = x.new_zeros(x.shape[1], samples * longest, x.shape[3])
        out[:, slots] = x[0]
        return out.view(x.shape[1], samples, longest, x.shape[3]).transpose(0, 1)

    band = _causal_band(longest, window, query.device)
    out, _ = sdpa_attention_forward(module, spread(query), spread(key), spread(value), band, dropout=dropout,
                                    scaling=scaling, is_causal=band is None)
    return out.reshape(samples * longest, *out.shape[2:])[slots][None], None  # [1, T, heads, d]


def sdpa_slots_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`sdpa_varlen_attention` on sdpa's slots alone, never PyTorch's varlen kernel."""
    return sdpa_varlen_attention(module, query, key, value, attention_mask, dropout, scaling, kernel=SLOTS, **kwargs)


def _slots(bounds: torch.Tensor, tokens: int, longest: int) -> torch.Tensor:
    """The slots' index of a packed row (`packed_slots`), built by the first layer that asks and reused by the others:
    every layer of a forward gets the same boundaries tensor (the collator's, once a micro-batch)."""
    cached = _slots_of.get("row")
    if cached is not None and cached[0] is bounds and cached[1] == (tokens, longest):
        return cached[2]
    slots = packed_slots(bounds, tokens, longest)
    _slots_of["row"] = (bounds, (tokens, longest), slots)
    return slots


def torch_varlen_runs(query: torch.Tensor, dropout: float) -> bool:
    """Whether PyTorch's varlen flash kernel runs here: a CUDA tensor in half precision, no attention dropout, and a
    torch that has the kernel (2.10+)."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16) or dropout:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_takes_window() -> bool:
    """Whether this torch's varlen kernel takes a sliding window (torch 2.13's `window_size`)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "window_size" in inspect.signature(varlen_attn).parameters


def _torch_varlen(query, key, value, bounds, longest: int, scaling, window: int | None) -> torch.Tensor:
    """PyTorch's varlen flash kernel on a packed row: query [1, heads, T, d], keys [1, kv heads, T, d] -> [1, T, heads,
    d]; causal, within each sample, within `window` keys where the layer has one (transformers' window counts the
    query itself: the kernel's left window is one fewer)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, d]
    cu = bounds.to(torch.int32)
    extra = {}
    takes = inspect.signature(varlen_attn).parameters
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        if "enable_gqa" in takes:
            extra["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if "window_size" in takes:  # torch 2.13: (-1, 0) is causal
        extra["window_size"] = (window - 1 if window is not None and longest > window else -1, 0)
    else:  # torch 2.10-2.11, without a window (a windowed layer takes the slots: sdpa_varlen_attention)
        extra["is_causal"] = True
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)
    return out[None]


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
    """Make `attn_implementation="sdpa_varlen"` (and `sdpa_slots`) loadable."""
    AttentionInterface.register(NAME, sdpa_varlen_attention)
    AttentionMaskInterface.register(NAME, sdpa_varlen_mask)
    AttentionInterface.register(SLOTS, sdpa_slots_attention)
    AttentionMaskInterface.register(SLOTS, sdpa_varlen_mask)


def packed_rows_need_no_mask(model) -> bool:
    """Whether `model`'s packed rows need no attention mask: its attention is sft's (`sdpa_varlen`, `sdpa_slots`: the
    samples kept apart by their boundaries) and every layer that mixes positions is attention (no state-space or
    convolution layer, which reads the mask: `sft.model.packing`). The trainer then tells the model its mask is built
    (a 4-d tensor transformers takes as given, which these kernels ignore where the row's boundaries are given)."""
    from sft.model.packing import stateful_layers

    return getattr(model.config, "_attn_implementation", None) in (NAME, SLOTS) and not stateful_layers(model)
