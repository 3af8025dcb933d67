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
