"""Liger's fused RMSNorm, RoPE and SwiGLU in the decoder's layers (`trainer.use_liger_kernel=true`): transformers'
own switch, which patches the model at the start of `train()` through liger-kernel's table of families
(`MODEL_TYPE_TO_APPLY_LIGER_FN`). What sft adds:

- the layers' kernels only (`LAYER_KERNELS`): sft computes the loss from the decoder's output itself, so Liger's
  cross entropy and its fused linear cross entropy (which replaces the model's forward) stay off; `loss.impl=liger`
  is that kernel, per token;
- a family the table does not hold, which liger-kernel would leave unpatched with an info line, is refused in one
  line, as are a CPU (the kernels are Triton's) and compiled layers (not checked together).

Exact by test on a GPU (tests/e2e/test_gpu.py): the step losses of the unfused layers.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

LAYER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}
LOSS_KERNELS = ("cross_entropy", "fused_linear_cross_entropy")


def liger_config(asked: dict | None) -> dict:
    """The kernels Liger applies: `LAYER_KERNELS`, with what `trainer.liger_kernel_config` sets over them."""
    return {**LAYER_KERNELS, **(asked or {})}


def liger_refusal(model_type: str, compile_layers: bool) -> str | None:
    """Why Liger's layer kernels cannot patch a model of `model_type`, or None."""
    try:
        found = version("liger-kernel")
    except PackageNotFoundError:
        return "liger-kernel is not installed (pip install -e '.[gpu]')"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return (f"liger-kernel {found} has no kernels for {model_type} (it patches "
                f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}): set it to false")
    if compile_layers:
        return "and trainer.compile_layers=true are not checked together: set one of them"
    return None
