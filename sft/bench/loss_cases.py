"""The bench's loss-only cases (`python -m sft.bench 'bench.cases=[loss_naive,loss_lean]'`): forward and backward of
the cross entropy alone at `bench.loss_batch x bench.loss_seq` tokens of `bench.loss_hidden` over a
`bench.loss_vocab` vocabulary, in `bench.loss_dtype`: the naive path against the lean kernels, the kernel each case
asks for being its `loss.impl` (`sft.bench.cases`). Run in a process of its own, like every case."""

from __future__ import annotations

import time

from sft.bench.device import memory_peak, memory_reset, on_gpu, sync

LOSS_TIMED_CALLS = 2  # after one untimed call: Triton compiles and autotunes a kernel at its first call


def run_loss_case(case: str, cfg) -> dict:
    """Forward and backward of the loss alone, computed as `loss.impl` says: the naive path (logits, then cross
    entropy), the lean kernel that training picks here (`auto`: Liger's on a GPU where installed, the chunked loss on a
    CPU), or a kernel by name (`chunked`, `cce`, `liger`); `impl` in the result is the one that ran. Peak memory is the first call's; the time
    the best of `LOSS_TIMED_CALLS` after it (the first compiles Triton's kernels). In half precision also each
    kernel's error: the relative (norm) distance of its rows' losses and of the hidden states' gradient from fp32's."""
    import torch

    from sft.loss.builtin import CrossEntropyLoss
    from sft.loss.kernels import choose_impl

    b = cfg.bench
    device = "cuda" if on_gpu() else "cpu"
    dtype = getattr(torch, b.loss_dtype)
    torch.manual_seed(0)
    hidden = torch.randn(b.loss_batch, b.loss_seq, b.loss_hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(b.loss_vocab, b.loss_hidden, device=device, dtype=dtype) * 0.02).requires_grad_(
        b.loss_trainable_head)
    labels = torch.randint(0, b.loss_vocab, (b.loss_batch, b.loss_seq), device=device)
    weights = torch.rand(b.loss_batch, b.loss_seq, device=device)
    loss = CrossEntropyLoss(chunk_tokens=cfg.loss.chunk_tokens)
    impl = choose_impl(str(cfg.loss.impl), vocab_size=b.loss_vocab, on_gpu=device == "cuda")

    def forward_backward(h, w, impl):
        if impl == "naive":
            terms = loss.terms(labels, weights, logits=torch.nn.functional.linear(h, w))  # the output projection's
        else:
            terms = loss.terms(labels, weights, hidden=h, lm_head=w, impl=impl)
        terms.loss_sum.backward()
        return terms

    def timed() -> float:
        sync(device)
        started = time.perf_counter()
        forward_backward(hidden, weight, impl)
        sync(device)
        hidden.grad = weight.grad = None
        return time.perf_counter() - started

    baseline = memory_reset(device)
    first = timed()
    result = {"first_seconds": first, "peak_memory_gb": memory_peak(device) - baseline,
              "seconds": min(timed() for _ in range(LOSS_TIMED_CALLS)), "tokens": b.loss_batch * b.loss_seq,
              "impl": impl}
    if dtype != torch.float32:
        result.update(loss_errors(forward_backward, hidden, weight, impl))
    return result


def loss_errors(forward_backward, hidden, weight, impl: str) -> dict:
    """How far a half-precision kernel's rows' losses and hidden-state gradient are from fp32's (the chunked loss
    on the same values upcast), each as ||kernel - fp32|| / ||fp32||."""
    terms = forward_backward(hidden, weight, impl)
    rows, grad = terms.ce_sum.float(), hidden.grad.float()
    hidden.grad = weight.grad = None
    exact_hidden = hidden.detach().float().requires_grad_()
    exact = forward_backward(exact_hidden, weight.detach().float(), "chunked")

    def relative(actual, expected):
        return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))

    return {"loss_error": relative(rows, exact.ce_sum.float()), "grad_error": relative(grad, exact_hidden.grad)}


def show_loss(name: str, report: dict) -> list[str]:
    """A loss case's line in the printed report: tokens/s and peak memory, the kernel it ran, its error from fp32."""
    c = report["cases"][name]
    errors = f"; from fp32: losses {c['loss_error']:.2g}, gradient {c['grad_error']:.2g}" if "grad_error" in c else ""
    return [f"{name:<22}{c['tokens'] / c['seconds']:>12.0f}{'':>8}{c['peak_memory_gb']:>10.2f}   "
            f"({c['seconds']:.3f} s forward+backward, {report['raw'][name][0]['impl']}; first call "
            f"{c['first_seconds']:.2f} s{errors})"]
