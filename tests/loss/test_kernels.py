"""How the cross entropy is computed (`sft.loss.kernels`): chunked equals naive in value and gradients; a kernel that
cannot be used falls back with its reason."""

import pytest
import torch

from sft.loss.builtin import DFTLoss, FocalLoss, HardSampleLoss

FACTOR_LOSSES = {"hard_sample": HardSampleLoss, "focal": lambda **k: FocalLoss(gamma=2.0, **k), "dft": DFTLoss}


@pytest.mark.parametrize("loss_name", sorted(FACTOR_LOSSES))
@pytest.mark.parametrize("normalize", ["weight", "token", "sample"])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_naive_in_value_and_gradients(normalize, packed, loss_name):
    torch.manual_seed(0)
    rows, length, hidden_size, vocab = (1, 40, 16, 97) if packed else (3, 13, 16, 97)
    hidden = torch.randn(rows, length, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, length))
    labels[:, :2] = -100
    position_ids = None
    if packed:  # three samples of 15, 12 and 13 tokens in one row, each with a prompt
        position_ids = torch.cat([torch.arange(n) for n in (15, 12, 13)])[None]
        labels[position_ids < 3] = -100
    weights = torch.rand(rows, length) * (labels != -100)
    loss = FACTOR_LOSSES[loss_name](normalize=normalize, chunk_tokens=5)  # the weights are given
    naive = loss.terms(labels, weights, logits=hidden @ weight.T, position_ids=position_ids, accuracy=True)
    chunked = loss.terms(labels, weights, hidden=hidden, lm_head=weight, position_ids=position_ids,
                         impl="chunked", accuracy=True)
    assert chunked.loss_sum.item() == pytest.approx(naive.loss_sum.item(), abs=1e-5)
    for a, b in zip(torch.autograd.grad(naive.loss_sum * 3.0, [hidden, weight]),
                    torch.autograd.grad(chunked.loss_sum * 3.0, [hidden, weight])):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    for field in ("numerator", "denominator", "ce_sum", "tokens", "correct"):
        torch.testing.assert_close(getattr(chunked, field), getattr(naive, field), atol=1e-5, rtol=1e-6)
    assert len(naive.tokens) == (3 if packed else rows)


def test_choose_impl_falls_back_with_a_logged_reason(caplog):
    from sft.loss.kernels import choose_impl

    with caplog.at_level("WARNING", logger="sft"):
        assert choose_impl("cce", vocab_size=151936, on_gpu=False) == "chunked"
        assert "loss.impl=cce: needs a CUDA GPU; using chunked" in caplog.text
        assert choose_impl("liger", vocab_size=151936, on_gpu=False) == "chunked"
        assert "loss.impl=liger: needs a CUDA GPU; using chunked" in caplog.text
        assert choose_impl("chunked", vocab_size=320, on_gpu=False, zero3_trainable_head=True) == "naive"
        assert "sharded by ZeRO-3" in caplog.text
    assert choose_impl("auto", vocab_size=320, on_gpu=False) == "chunked"
    assert choose_impl("auto", vocab_size=320, on_gpu=False, zero3_trainable_head=True) == "naive"
    assert choose_impl("naive", vocab_size=151936, on_gpu=False) == "naive"
    with pytest.raises(ValueError, match="impl='fast': must be one of auto, naive, chunked, liger, cce"):
        HardSampleLoss(impl="fast")  # a loss built in Python, where no composition checked the choice


@pytest.mark.parametrize("liger, cce, expected", [(None, None, "liger"), ("not installed", None, "chunked"),
                                                  ("not installed", "not installed", "chunked")])
def test_auto_on_a_gpu_is_liger_where_usable_and_never_cut_cross_entropy(monkeypatch, liger, cce, expected):
    """The GPU pack measured (H200, Qwen2.5-7B's output layer, bf16): Liger as fast as the chunked loss and as close
    to fp32; cut-cross-entropy twice as slow, its hidden states' gradient 5x further from fp32: only on request."""
    from sft.loss import kernels

    monkeypatch.setattr(kernels, "_liger_problem", lambda: liger)
    monkeypatch.setattr(kernels, "_cce_problem", lambda: cce)
    assert kernels.choose_impl("auto", vocab_size=151936, on_gpu=True) == expected
    assert kernels.choose_impl("auto", vocab_size=151936, on_gpu=True, zero3_trainable_head=True) == "naive"
    assert kernels.choose_impl("cce", vocab_size=151936, on_gpu=True) == ("cce" if cce is None else "chunked")
    # a loss that reads the logits (distill, asft, eaft): neither kernel, whose outputs are cross entropies only
    assert kernels.choose_impl("auto", vocab_size=151936, on_gpu=True, reads_logits=True) == "chunked"
    assert kernels.choose_impl("liger", vocab_size=151936, on_gpu=True, reads_logits=True) == "chunked"
    assert kernels.choose_impl("cce", vocab_size=320, on_gpu=True, reads_logits=True,
                               zero3_trainable_head=True) == "naive"


@pytest.mark.parametrize("installed, reason", [
    (None, "liger-kernel is not installed (pip install 'liger-kernel>=0.8.2')"),
    ("0.6.4", "liger-kernel 0.6.4 scales the gradient it computes in the forward by one scalar"),
    ("0.8.1", "liger-kernel 0.8.1 scales the gradient"),
])
def test_liger_on_a_gpu_needs_a_version_with_a_per_token_gradient(monkeypatch, caplog, installed, reason):
    """Liger's reduction="none" got a per-token gradient in 0.8.2; before, weights would be applied to a wrong one,
    so an older version (or none) falls back to chunked, saying why."""
    import importlib.metadata

    from sft.loss.kernels import choose_impl

    def version(name):
        if name != "liger-kernel" or installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    with caplog.at_level("WARNING", logger="sft"):
        assert choose_impl("liger", vocab_size=151936, on_gpu=True) == "chunked"
    assert f"loss.impl=liger: {reason}" in caplog.text and "using chunked" in caplog.text
    with caplog.at_level("WARNING", logger="sft"):
        assert choose_impl("liger", vocab_size=151936, on_gpu=True, zero3_trainable_head=True) == "naive"


@pytest.mark.parametrize("hidden, weight, problem", [
    (torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float16, None),
    (torch.float32, torch.float32, "its kernels take float16/bfloat16 only"),
    (torch.bfloat16, torch.float32, "its kernels take float16/bfloat16 only"),  # fp32 master weights under autocast
    (torch.bfloat16, torch.float16, "differ in dtype"),
])
def test_cce_is_used_only_for_the_dtypes_its_kernels_take(hidden, weight, problem):
    from sft.loss.kernels import kernel_dtype_problem

    found = kernel_dtype_problem("cce", hidden, weight)
    assert (found is None) if problem is None else problem in found
    if hidden == weight:  # Liger's kernel takes fp32 too, but one dtype for both
        assert kernel_dtype_problem("liger", hidden, weight) is None
    else:
        assert "differ in dtype" in kernel_dtype_problem("liger", hidden, weight)


def test_loss_impl_cce_on_fp32_tensors_is_the_chunked_loss_exactly_with_one_warning(caplog, monkeypatch):
    # cut-cross-entropy's backward takes bf16/fp16 only: an fp32 run, or QLoRA's fp32 lm_head, falls back (issue 32).
    from sft.loss import kernels

    monkeypatch.setattr(kernels, "_warned", set())
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    labels = torch.tensor([[-100, 3, 5, -100, 7, 9], [-100, -100, 1, 2, 3, 4]])
    weights = torch.rand(2, 6)
    loss = HardSampleLoss(alpha=1.0)
    with caplog.at_level("WARNING", logger="sft"):
        results = [loss.terms(labels, weights, hidden=hidden, lm_head=weight, impl=impl)
                   for impl in ("cce", "cce", "chunked")]
    grads = []
    for terms in (results[0], results[2]):
        hidden.grad = weight.grad = None
        terms.loss_sum.backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    assert torch.equal(results[0].loss_sum, results[2].loss_sum) and torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])
    warned = [r.message for r in caplog.records if "loss.impl=cce" in r.message]
    assert warned == ["loss.impl=cce: its kernels take float16/bfloat16 only, and the hidden states are float32, the "
                      "lm_head float32; using chunked (exact) for these tensors"]
