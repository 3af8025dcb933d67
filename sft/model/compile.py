"""Regional compilation (`trainer.compile_layers=true`): each decoder layer compiled in place by `torch.compile`
(`nn.Module.compile`, so the model, its parameters' names and its checkpoints stay as they are), the embedding, the
final norm and the loss left eager. The layers share one class, so the first compile serves them all: a cold start
of seconds, not the minutes of the whole model's graph, and the layer's kernels fused (its norms, RoPE, SwiGLU).

Exact by test, family by family: `COMPILE_CHECKED` holds the model types whose compiled layers give the eager
layers' logits and gradients (tests/model/test_compile.py); a model of another type is refused in one line, never
trained on an unchecked graph. Refused too where the model is not run as itself: under DeepSpeed (its hooks on every
parameter) and FSDP2, and beside transformers' `torch_compile` (the whole model).
"""

from __future__ import annotations

COMPILE_CHECKED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")


def compile_refusal(model, deepspeed: bool, fsdp: bool, torch_compile: bool) -> str | None:
    """Why `model`'s layers are not compiled, or None."""
    model_type = model.config.model_type
    if model_type not in COMPILE_CHECKED:
        return (f"{model_type}'s compiled layers are not checked against its eager ones (checked: "
                f"{', '.join(COMPILE_CHECKED)}; tests/model/test_compile.py): set it to false")
    if deepspeed or fsdp:
        return f"compiles the model's own layers, which {'DeepSpeed' if deepspeed else 'FSDP2'} wraps: set it to false"
    if torch_compile:
        return "and trainer.torch_compile=true (the whole model) both compile it: set one of them"
    return None


def compile_layers(model) -> int:
    """Compile each decoder layer of `model` (a PEFT model's base's) in place; the number compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def decoder_layers(model):
    """The decoder's layers (`model.layers` of transformers' decoders), through a PEFT wrapper."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.get_base_model().get_decoder()
    return decoder.layers
