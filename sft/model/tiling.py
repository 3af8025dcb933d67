"""Tiled MLPs for long rows (`model.tiled_mlp_tokens`): each decoder layer's MLP computed over the sequence in tiles,
through DeepSpeed ALST's `TiledMLP`, which runs the tiles without keeping their activations and runs them again,
tile by tile, in the backward.

At 32k tokens a Qwen2.5-7B MLP holds `3 x 18944` intermediate values per token (3.4 GiB in bf16 per layer, the
largest activation of the step once attention is flash and the loss is lean); in tiles of 4096 tokens it holds an
eighth of that. The outputs and gradients are the untiled MLP's (the same operations on row slices), at the cost of
one more MLP forward per step.

    tile_mlps(model, tokens=4096)  # -> 28 MLPs of Qwen2.5-7B tiled; a row of 32k tokens runs in 8 tiles

Dense MLPs only (a module `mlp` whose class name ends in `MLP`: Llama, Qwen2/3, Mistral, Gemma, Phi-3 ...); a mixture of
experts' block routes tokens and adds a router loss, and is left as it is.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("sft")


DENSE_MLP_NAMES = ("mlp", "feed_forward", "shared_mlp")


def tile_mlps(model: torch.nn.Module, tokens: int) -> int:
    """Compute every dense decoder MLP of `model` in tiles of at most `tokens` tokens; the number of MLPs tiled."""
    tiled = 0
    for name, module in model.named_modules():
        # a decoder layer's dense MLP, by its name and its class's (LFM2 and Falcon-H1 call it feed_forward, Granite-4
        # shared_mlp); never a mixture of experts' block (gpt-oss names its one GptOssMLP): it has experts
        if name.rsplit(".", 1)[-1] in DENSE_MLP_NAMES and type(module).__name__.endswith("MLP") \
                and not hasattr(module, "experts"):
            module.forward = _tiled_forward(module, module.forward, tokens)
            tiled += 1
    log.info("model.tiled_mlp_tokens=%d: %d MLPs tiled", tokens, tiled)
    return tiled


def _tiled_forward(module: torch.nn.Module, forward, tokens: int):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def tiled(hidden_states: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return forward(hidden_states)  # evaluation and generation keep no activations
        # one row of tokens: TiledMLP tiles the forward along the sequence but the backward along the flattened
        # batch, which for several rows are other tiles (their dropout masks drawn in another order)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tiles = math.ceil(flat.shape[0] / tokens)
        if tiles <= 1:
            return forward(hidden_states)
        # DeepSpeed needs the trainable weights, to reduce each one's gradient once, after the last tile
        params = [p for p in module.parameters() if p.requires_grad]
        replay = _Replay(forward, len(torch.chunk(flat, tiles, dim=0)), hidden_states.device)
        return TiledMLP.apply(replay, module, flat, tiles, params).view_as(hidden_states)

    return tiled


class _Replay:
    """A tiled MLP's tiles, computed in the backward as in the forward, as torch's checkpoint recomputes: the same
    random numbers (LoRA's dropout masks: the RNG state at the first tile is restored for the backward's first, and
    the state from before the backward put back after its last) and the same autocast (a bf16 mixed-precision
    forward is not recomputed in float32)."""

    def __init__(self, forward, tiles: int, device: torch.device):
        self.forward, self.tiles, self.device, self.calls = forward, tiles, device, 0
        self.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def _rng(self):
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def _set_rng(self, state) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def __call__(self, _module, x: torch.Tensor) -> torch.Tensor:
        if self.calls == 0:
            self.start = self._rng()
        elif self.calls == self.tiles:  # the backward's first tile
            self.outside = self._rng()
            self._set_rng(self.start)
        self.calls += 1
        enabled, dtype = self.autocast
        with torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
            out = self.forward(x)
        if self.calls == 2 * self.tiles:
            self._set_rng(self.outside)
        return out
