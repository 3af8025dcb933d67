"""Packed rows on models whose layers are not all attention: each sample's state starts from nothing.

A packed row (`data.packing`) holds several samples one after another. Attention keeps them apart by their
boundaries (`sft.model.attention`); a layer that carries state along the sequence does not: a state-space mixer
(Mamba, Mamba-2: Jamba, Bamba, Granite-4, Falcon-H1, Nemotron-H), a gated delta rule (Qwen3-Next, Qwen3.5, OLMo
hybrid, Kimi-Linear), a short convolution (LFM2), lightning attention (MiniMax), a recurrent block (RecurrentGemma).
transformers' own kernels take the boundaries only through CUDA packages (`flash-linear-attention`, `mamba-ssm`,
`causal-conv1d`); its PyTorch paths carry each sample's state into the next, or refuse.

`keep_samples_apart` wraps each such layer: in a packed row, its input is laid out as a batch of the row's samples,
one a row, right-padded ([1, T, d] -> [samples, longest, d]), run as a padded batch runs (from a zero state; the
padding after a sample's end never reaches its tokens, the layer being causal), and its output gathered back
([1, T, d]). Outside packed rows (padded batches, generation) the layer runs as it is. That makes packing exact on
every such architecture, at the cost of the padding inside those layers only.

`check_packing` is the proof, run on the model about to train: a few short random samples through it packed and
padded must give the same logits; where they do not (an architecture whose attention builds its mask without the
samples' positions: gpt-oss under eager), `data.packing=true` is one config error naming the model and the way out.

    keep_samples_apart(model) -> ["Qwen3NextGatedDeltaNet"]   # the classes wrapped
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re

import torch

from sft.data.tokens.batch import packed_bounds, packed_slots

log = logging.getLogger("sft")

# Layers that carry a state along the sequence, by their class's name (each family names its own).
STATEFUL = re.compile(r"(Mixer|MambaLayer|GatedDeltaNet|DeltaAttention|ShortConv(olution)?|LightningAttention|"
                      r"RecurrentBlock)$")
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

# The packed row's sample boundaries during the forward of a model with wrapped layers (`_note_bounds`).
_BOUNDS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("sft_packed_bounds", default=None)


def stateful_layers(model) -> list[torch.nn.Module]:
    """The layers of `model` that carry state along the sequence (`STATEFUL`), outermost only."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if STATEFUL.search(type(module).__name__) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return [module for _, module in found]


def keep_samples_apart(model) -> list[str]:
    """Wrap each stateful layer of `model` so that the samples of a packed row pass it apart (see the module
    docstring); returns the wrapped layers' class names (none: nothing to do)."""
    layers = [m for m in stateful_layers(model) if not getattr(m, "_sft_samples_apart", False)]
    for layer in layers:
        layer.forward = _apart(layer.forward)
        layer._sft_samples_apart = True
    if layers:
        model.register_forward_pre_hook(_note_bounds, with_kwargs=True)
        model.register_forward_hook(_forget_bounds, always_call=True)
    return sorted({type(m).__name__ for m in layers})


def _note_bounds(module, args, kwargs):
    positions = kwargs.get("position_ids")
    packed = positions is not None and positions.shape[0] == 1 and kwargs.get("attention_mask") is None \
        and int(torch.count_nonzero(positions == 0)) > 1
    _BOUNDS.set(packed_bounds(positions[0]) if packed else None)


def _forget_bounds(module, args, kwargs, output=None):
    _BOUNDS.set(None)


def _apart(forward):
    @functools.wraps(forward)
    def samples_apart(*args, **kwargs):
        bounds = _BOUNDS.get()
        hidden = args[0] if args else next(iter(kwargs.values()))
        if bounds is None or hidden.dim() != 3 or hidden.shape[0] != 1:
            return forward(*args, **kwargs)
        tokens, samples = hidden.shape[1], bounds.numel() - 1
        longest = int((bounds[1:] - bounds[:-1]).max())
        slots = packed_slots(bounds, tokens, longest)

        def spread(x):  # [1, T, ...] -> [samples, longest, ...], zero after each sample's end
            if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (1, tokens)):
                return x
            out = x.new_zeros(samples * longest, *x.shape[2:])
            out[slots] = x[0]
            return out.view(samples, longest, *x.shape[2:])

        def spread_all(x):
            if isinstance(x, tuple):  # position embeddings (cos, sin)
                return tuple(spread(t) for t in x)
            return spread(x)

        args = tuple(spread_all(a) for a in args)
        kwargs = {k: (None if k == "attention_mask" else spread_all(v)) for k, v in kwargs.items()
                  if k not in PACKING_KWARGS}
        if "position_ids" in kwargs and kwargs["position_ids"] is not None:  # each sample's own, 0, 1, ...
            kwargs["position_ids"] = torch.arange(longest, device=hidden.device).expand(samples, longest)
        output = forward(*args, **kwargs)

        def gather(x):
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (samples, longest):
                return x.reshape(samples * longest, *x.shape[2:])[slots][None]
            return x

        return tuple(gather(o) for o in output) if isinstance(output, tuple) else gather(output)

    return samples_apart


# how far above the kernels' own rounding (the packed row's first sample) a later sample's difference is a leak
LEAK_OVER_ROUNDING = 8


def check_packing(model) -> float | None:
    """The largest difference between the logits of a few short random samples packed into one row and padded, as
    training forms both (`use_cache=False`, in eval mode, no gradients); raises `ConfigError` on `data.packing`
    where a later sample's difference is beyond rounding: 1e-3 of the logits' scale, and 8x the first sample's
    (which sees nothing foreign in either form, so its difference is the kernels' rounding in the model's dtype).
    None where the weights are sharded over the ranks (ZeRO-3 until its engine runs: no forward yet), which the
    probe cannot run on."""
    from transformers import DataCollatorWithFlattening

    from sft.config.schema import ConfigError

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        log.info("data.packing: the probe of packed rows skipped (ZeRO-3 shards the weights before training)")
        return None
    vocab_size = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (7, 12, 5)]
    device = next(model.parameters()).device
    padded = torch.zeros(len(samples), max(map(len, samples)), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, s in enumerate(samples):
        padded[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in samples])
    packed.pop("labels", None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = model(input_ids=padded.to(device), attention_mask=mask.to(device), use_cache=False).logits
            together = model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()},
                             use_cache=False).logits[0]
    except TypeError as e:  # a forward without position_ids (pure Mamba): it cannot tell the samples apart
        raise ConfigError("data.packing", True, f"{type(model).__name__} does not take a packed row ({e}): train "
                          "padded rows, data.packing=false") from None
    finally:
        model.train(was_training)
    # The first sample of a packed row has nothing before it, so what separates its two logits is the kernels'
    # rounding alone (a different shape, another sdpa kernel): in bf16 on a deep model that is well above 1e-3 of
    # the scale. A leak shows in the later samples only, far above that rounding.
    per_sample = [alone[i, :len(s)].float() for i, s in enumerate(samples)]
    together = together.float().split([len(s) for s in samples])
    differences = [float((t - a).abs().max()) for t, a in zip(together, per_sample)]
    rounding, difference = differences[0], max(differences[1:])
    scale = max(float(torch.cat(per_sample).abs().max()), 1.0)
    if difference > max(1e-3 * scale, LEAK_OVER_ROUNDING * rounding):
        attention = getattr(model.config, "_attn_implementation", None)
        raise ConfigError("data.packing", True, f"{type(model).__name__} (attention: {attention}) lets the samples of a "
                          f"packed row see each other: their logits differ from the padded samples' by up to "
                          f"{difference:.3g} on a probe (the first sample's, rounding alone: {rounding:.3g}); train "
                          "padded rows: data.packing=false")
    return difference
