"""How the cross entropy is computed (`loss.impl`): the memory-lean chunked kernel of this project, and the
choice among it, the model's own logits (`naive`), cut-cross-entropy and Liger (`choose_impl`)."""

from __future__ import annotations

import inspect
import logging
import re
from typing import Callable

import torch

from sft.loss.logits import LogitTransform

LARGE_VOCAB = 32768  # from here on `auto` never materialises the logits


log = logging.getLogger("sft")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t coef_t * f_t * CE(transform(hidden_t @ weight.T), label_t), a chunk of tokens at a time, with
    f_t = factor(ce_t) a detached per-token factor (1 without one).

    The gradients are computed chunk by chunk in the forward pass, while each chunk's logits exist (as
    Liger's fused linear cross entropy does): the backward only scales them, so nothing is recomputed and
    at most one chunk of logits is ever held. The loss is linear in what the backward receives, so this is
    exact for any upstream gradient. Every chunk reuses one logits buffer and works on it in place: a new
    buffer per chunk would cost fresh pages from the OS each time on CPU.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, coef, chunk_tokens, accuracy, transform, factor):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale, softcap = transform.scale, transform.softcap
        n = hidden.size(0)
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        coef = coef.clone() if factor is not None else coef  # becomes coef * factor, chunk by chunk
        correct = torch.empty(n, dtype=torch.bool, device=hidden.device) if accuracy else None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        # Project in the hidden states' dtype, as autocast would (bf16 activations over fp32 master weights).
        weight_in = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        rows = min(chunk_tokens, n)
        buffer = torch.empty(rows, weight.size(0), dtype=hidden.dtype, device=hidden.device)
        buffer32 = buffer if hidden.dtype == torch.float32 else torch.empty_like(buffer, dtype=torch.float32)
        capped = torch.empty_like(buffer32) if softcap and (need_hidden or need_weight) else None
        autocast_off = torch.autocast(hidden.device.type, enabled=False)
        autocast_off.__enter__()
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            h, y = hidden[start:end], labels[start:end]
            logits = torch.mm(h, weight_in.T, out=buffer[: end - start])
            if logits.dtype != torch.float32:
                logits = buffer32[: end - start].copy_(logits)
            if scale != 1.0:
                logits.mul_(scale)
            if softcap:  # t = c * tanh(z / c), whose derivative 1 - tanh^2 the gradient needs below
                logits.div_(softcap).tanh_()
                if capped is not None:
                    capped[: end - start].copy_(logits)
                logits.mul_(softcap)
            if accuracy:
                correct[start:end] = logits.argmax(-1) == y
            target = logits.gather(1, y[:, None]).squeeze(1)
            top = logits.amax(-1)
            probs = logits.sub_(top[:, None]).exp_()  # in place: the logits become unnormalised probabilities
            total = probs.sum(-1)
            ce[start:end] = top + total.log() - target
            if factor is not None:
                coef[start:end] *= factor(ce[start:end])
            if need_hidden or need_weight:
                probs.mul_((coef[start:end] / total)[:, None])  # coef * softmax
                probs[torch.arange(end - start, device=y.device), y] -= coef[start:end]  # minus coef * one-hot
                if capped is not None:  # back through the softcap, then the scale
                    probs.mul_(capped[: end - start].square_().neg_().add_(1.0))
                if scale != 1.0:
                    probs.mul_(scale)
                grad_logits = probs if hidden.dtype == torch.float32 else buffer[: end - start].copy_(probs)
                if need_hidden:
                    torch.mm(grad_logits, weight_in, out=grad_hidden[start:end])
                if need_weight:
                    grad_weight.addmm_(probs.T, h.float())
        autocast_off.__exit__(None, None, None)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        if accuracy:
            ctx.mark_non_differentiable(ce, correct, coef)
        else:
            ctx.mark_non_differentiable(ce, coef)
        return (coef * ce).sum(), ce, correct, coef

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct, _grad_coef):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 coef: torch.Tensor, chunk_tokens: int = 1024, accuracy: bool = False,
                                 transform: LogitTransform | None = None, factor: Callable | None = None):
    """`(sum_t c_t * ce_t, ce [N], correct [N] or None, c [N])` for hidden states [N, H] and a projection
    weight [V, H], the logits `transform(hidden @ weight.T)`, without ever holding more than
    `chunk_tokens` rows of logits; `c = coef * factor(ce)` (detached), or `coef` without a factor."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, coef.float(), chunk_tokens, accuracy,
                                            transform or LogitTransform(), factor)


def token_loss_chunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor,
                       token_loss: Callable, second, chunk_tokens: int = 1024, accuracy: bool = False,
                       transform: LogitTransform | None = None):
    """`(sum_t c_t l_t, ce [N], l [N], correct [N] or None)` for a loss `l_t` read from the model's logits and a second
    model's (`token_loss(logits, labels, second_logits) -> (l, ce)`; `second`: the second model's outputs at the same
    N targets, `sft.loss.terms.SecondOutputs`, or None), a chunk of `chunk_tokens` targets at a time. Each chunk's
    loss is checkpointed: its logits (both models') exist only while it is computed, and again in the backward, which
    recomputes them, so at most one chunk of logits is held at any time, at the cost of a second projection."""
    from torch.utils.checkpoint import checkpoint

    transform = transform or LogitTransform()
    weight_in = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
    n = hidden.size(0)
    total = hidden.new_zeros((), dtype=torch.float32)
    ce, values = torch.empty(n, device=hidden.device), torch.empty(n, device=hidden.device)
    correct = torch.empty(n, dtype=torch.bool, device=hidden.device) if accuracy else None
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)

        def chunk(h, w, start=start, end=end):
            logits = transform((h @ w.T).float())
            with torch.no_grad():
                second_logits = second.logits_of(start, end) if second is not None else None
            loss, chunk_ce = token_loss(logits, labels[start:end], second_logits)
            found = logits.argmax(-1) == labels[start:end] if accuracy else loss.new_empty(0)
            return (coef[start:end] * loss).sum(), loss.detach(), chunk_ce.detach(), found

        part, values[start:end], ce[start:end], found = checkpoint(chunk, hidden[start:end], weight_in,
                                                                   use_reentrant=False)
        if accuracy:
            correct[start:end] = found
        total = total + part
    return total, ce, values, correct


def lean_logits_error(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                      transform: LogitTransform) -> str | None:
    """How a model's own `logits` differ from its decoder's output `hidden` projected by its output layer's `weight`
    (with the model's known `transform`), beyond their dtype's rounding; None where they agree: a lean loss, which
    projects the hidden states itself, then computes the model's own loss."""
    theirs = logits.float()
    ours = transform(hidden.float() @ weight.float().T)
    relative = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16/fp16 rounding
    error = (ours - theirs).abs().max().item()
    return None if error <= relative * max(1.0, theirs.abs().max().item()) else f"they differ by up to {error:.3g}"


def choose_impl(requested: str, *, vocab_size: int, on_gpu: bool, zero3_trainable_head: bool = False,
                reads_logits: bool = False) -> str:
    """The implementation to run for `loss.impl=requested`, logging why a requested one is not used.

    `auto` on a GPU is Liger's kernel where usable: measured on an H200 at Qwen2.5-7B's output layer (bf16, 8k
    tokens), it is as fast as the chunked loss and as close to fp32, in a third of its memory; cut-cross-entropy
    takes the least memory but twice the time, and its hidden states' gradient is 5-12x further from fp32
    (docs/losses.md), so it runs only when asked for. A loss that reads the logits beyond each target's cross entropy
    (`reads_logits`: `WeightedTokenLoss.token_loss`) runs neither: both kernels return cross entropies only."""
    # DeepSpeed ZeRO-3 updates a sharded lm_head only through its module's own forward and backward.
    lean = "naive" if zero3_trainable_head else "chunked"
    if reads_logits and requested in ("cce", "liger"):
        log.warning("loss.impl=%s: its kernel computes the cross entropy only, and this loss reads the logits; "
                    "using %s", requested, lean)
        return lean
    kernels = () if reads_logits else (("cce", _cce_problem), ("liger", _liger_problem))
    for kernel, why_not in kernels:
        if requested == kernel or (requested == "auto" and kernel == "liger" and on_gpu):
            problem = ("needs a CUDA GPU" if not on_gpu else "the lm_head is trainable and sharded by ZeRO-3"
                       if zero3_trainable_head else why_not())
            if problem is None:
                return kernel
            if requested == kernel:
                log.warning("loss.impl=%s: %s; using %s", kernel, problem, lean)
                return lean
    if requested == "chunked" and zero3_trainable_head:
        log.warning("loss.impl=chunked: the lm_head is trainable and sharded by ZeRO-3, which updates it only "
                    "through its module's own forward; using naive (with LoRA the lm_head is frozen and chunked works)")
    if requested == "auto":
        return lean if not on_gpu or vocab_size >= LARGE_VOCAB else "naive"
    return lean if requested == "chunked" else requested


CCE_DTYPES = (torch.float16, torch.bfloat16)  # cut-cross-entropy's kernels (its backward) take no other


def kernel_dtype_problem(impl: str, hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> str | None:
    """Why a fused kernel (`cce`, `liger`) cannot run on hidden states and a projection weight of these dtypes (an
    fp32 run for cut-cross-entropy; fp32 master weights under bf16 autocast, QLoRA's fp32 lm_head for both), or
    None."""
    if impl == "cce" and (hidden_dtype not in CCE_DTYPES or weight_dtype not in CCE_DTYPES):
        return (f"its kernels take float16/bfloat16 only, and the hidden states are {str(hidden_dtype)[6:]}, the "
                f"lm_head {str(weight_dtype)[6:]}")
    if hidden_dtype != weight_dtype:
        return f"the hidden states ({str(hidden_dtype)[6:]}) and the lm_head ({str(weight_dtype)[6:]}) differ in dtype"
    return None


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log a warning the first time this process meets it (a fallback taken at every micro-batch)."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _cce_problem() -> str | None:
    """Why cut-cross-entropy cannot give per-token losses here, or None if it can."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as e:  # not installed, or it fails to import (no triton ...)
        return f"cut-cross-entropy is not usable ({type(e).__name__}: {e})"
    parameters = inspect.signature(linear_cross_entropy).parameters
    if "reduction" not in parameters:
        return "this cut-cross-entropy has no reduction='none' (per-token losses), which the weights need"
    if "filter_eps" not in parameters:
        return "this cut-cross-entropy cannot turn off its gradient filtering (filter_eps): its gradients are approximate"
    return None


LIGER_PER_TOKEN = (0, 8, 2)  # the first liger-kernel whose reduction="none" has a per-token gradient


def _liger_problem() -> str | None:
    """Why Liger's fused linear cross entropy cannot give weighted per-token losses here, or None if it can.
    Before 0.8.2 its backward scaled a gradient computed in the forward by one scalar, which per-token
    weights would make wrong."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("liger-kernel")
    except PackageNotFoundError:
        return "liger-kernel is not installed (pip install 'liger-kernel>=0.8.2')"
    numbers = tuple(int(part) for part in re.findall(r"\d+", found)[:3])
    if numbers < LIGER_PER_TOKEN:
        return (f"liger-kernel {found} scales the gradient it computes in the forward by one scalar, so per-token "
                "weights would get a wrong gradient (0.8.2 and later compute a per-token one)")
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as e:  # it fails to import (no triton ...)
        return f"liger-kernel {found} is not usable ({type(e).__name__}: {e})"
    if "reduction" not in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        return f"liger-kernel {found} has no reduction='none' (per-token losses)"
    return None
