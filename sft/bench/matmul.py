"""The bench's `matmul` case: how fast this machine multiplies matrices of the model's own shapes, the limit of a
training step that is nothing but its matrix products (`hw_exec_<case>`: `sft.bench.report.hardware_ratios`)."""

from __future__ import annotations

import time

from omegaconf import OmegaConf

from sft.bench.device import on_gpu, sync


def model_matmul_shapes(cfg) -> dict[tuple[int, int], int]:
    """The (in, out) shapes of the model's linear layers and how many of each (per layer: q, k, v, o, gate, up, down;
    the output layer), read from its config: the matrix products a training step is made of."""
    from transformers import AutoConfig

    from sft.model.loading import resolve

    model = cfg.model
    if model.random_init:
        config = AutoConfig.for_model(**OmegaConf.to_container(model.random_init, resolve=True))
    else:
        config = AutoConfig.from_pretrained(resolve(model.name_or_path, model.get("gguf_file")),
                                            trust_remote_code=model.trust_remote_code)
    config = config.get_text_config()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    intermediate = config.intermediate_size
    shapes: dict[tuple[int, int], int] = {}
    for shape, count in (((hidden, heads * head_dim), 1), ((hidden, kv), 2), ((heads * head_dim, hidden), 1),
                         ((hidden, intermediate), 2), ((intermediate, hidden), 1)):
        shapes[shape] = shapes.get(shape, 0) + count * layers
    shapes[(hidden, config.vocab_size)] = shapes.get((hidden, config.vocab_size), 0) + 1
    return shapes


def run_matmul_case(case: str, cfg) -> dict:
    """The rate of `torch.mm` over the model's own products (`model_matmul_shapes`, `bench.matmul_tokens` rows each,
    in `model.dtype`: `matmul_bf16` sets it to bf16; the cases' threads): each shape's best of 5 timings after one
    untimed, weighted by how often the model has it. What a training step of this model could reach if it were
    nothing but its matrix products."""
    import torch

    device = "cuda" if on_gpu() else "cpu"
    dtype_name = str(cfg.model.dtype)
    dtype = getattr(torch, dtype_name)
    tokens = cfg.bench.matmul_tokens
    flops = seconds = 0.0
    for (n_in, n_out), count in model_matmul_shapes(cfg).items():
        x = torch.randn(tokens, n_in, device=device, dtype=dtype)
        w = torch.randn(n_in, n_out, device=device, dtype=dtype)
        out = torch.empty(tokens, n_out, device=device, dtype=dtype)
        best = float("inf")
        for attempt in range(6):
            sync(device)
            started = time.perf_counter()
            torch.mm(x, w, out=out)
            sync(device)
            if attempt:
                best = min(best, time.perf_counter() - started)
        flops += count * 2.0 * tokens * n_in * n_out
        seconds += count * best
    return {"gflops": flops / seconds / 1e9, "tokens": tokens, "threads": torch.get_num_threads(), "dtype": dtype_name}


def show_matmul(name: str, report: dict) -> list[str]:
    """A matmul case's line in the printed report: its best reading and the spread over the rounds."""
    m = report["cases"][name]
    return [f"{name}: torch.mm over the model's products in {m['dtype']} ({m['tokens']:.0f} rows each): best "
            f"{m['gflops_best']:.1f} GFLOP/s, rounds {m['gflops_spread'][0]:.1f}-{m['gflops_spread'][1]:.1f}"]
