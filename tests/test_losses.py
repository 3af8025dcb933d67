"""Loss values against hand computations."""

import math

import numpy as np
import pytest
import torch

from sft.loss.builtin import CrossEntropyLoss, DFTLoss, FocalLoss, HardSampleLoss, LengthLoss

# Two samples, 4 positions, vocabulary of 3. Position t's logits predict label t+1.
LOGITS = torch.tensor(
    [
        [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 2.0], [0.0, 0.0, 0.0]],
        [[1.0, 2.0, 3.0], [0.0, 0.0, 4.0], [1.0, 0.0, 0.0], [0.0, 3.0, 1.0]],
    ]
)
# Sample 0 trains on positions 2 and 3 (targets 1, 2); sample 1 on positions 1..3 (targets 2, 0, 1).
LABELS = torch.tensor([[-100, -100, 1, 2], [-100, 2, 0, 1]])
W0, W1 = 2.0, 0.5
WEIGHTS = torch.tensor([[0.0, 0.0, W0, W0], [0.0, W1, W1, W1]])


def ce(logits, target):
    return math.log(sum(math.exp(v) for v in logits)) - logits[target]


def hand_ce():
    rows = LOGITS.tolist()
    s0 = [ce(rows[0][1], 1), ce(rows[0][2], 2)]
    s1 = [ce(rows[1][0], 2), ce(rows[1][1], 0), ce(rows[1][2], 1)]
    return s0, s1


def hard_sample(normalize):
    loss = HardSampleLoss(alpha=1.0, normalize=normalize)
    return loss(LOGITS, LABELS, WEIGHTS)


def test_weight_normalisation_matches_hand_computation():
    s0, s1 = hand_ce()
    expected = (W0 * sum(s0) + W1 * sum(s1)) / (W0 * len(s0) + W1 * len(s1))
    assert hard_sample("weight").item() == pytest.approx(expected, rel=1e-6)


def test_token_normalisation_matches_hand_computation():
    s0, s1 = hand_ce()
    expected = (W0 * sum(s0) + W1 * sum(s1)) / (len(s0) + len(s1))
    assert hard_sample("token").item() == pytest.approx(expected, rel=1e-6)


def test_sample_normalisation_matches_hand_computation():
    s0, s1 = hand_ce()
    expected = (W0 * sum(s0) / len(s0) + W1 * sum(s1) / len(s1)) / (W0 + W1)
    assert hard_sample("sample").item() == pytest.approx(expected, rel=1e-6)


def test_modes_differ_so_the_tests_above_discriminate():
    values = {m: hard_sample(m).item() for m in ("weight", "token", "sample")}
    assert len({round(v, 6) for v in values.values()}) == 3


def test_ce_is_the_plain_token_mean():
    s0, s1 = hand_ce()
    ones = (LABELS != -100).float()
    assert CrossEntropyLoss()(LOGITS, LABELS, ones).item() == pytest.approx((sum(s0) + sum(s1)) / 5, rel=1e-6)


@pytest.mark.parametrize(
    "score, alpha, lo, hi, expected",
    [(2.5, 1.0, 0.0, 100.0, 2.5), (3.0, 2.0, 0.0, 100.0, 9.0), (3.0, 2.0, 0.0, 4.0, 4.0),
     (0.1, 1.0, 0.5, 100.0, 0.5), (0.0, -1.0, 0.0, 10.0, 10.0), (4.0, 0.0, 0.0, 100.0, 1.0),
     (1e300, 2.0, 0.0, 100.0, 100.0)],
)
def test_hard_sample_weight_is_clamped_power_of_the_score(score, alpha, lo, hi, expected):
    loss = HardSampleLoss(alpha=alpha, min_weight=lo, max_weight=hi)
    assert loss.sample_weight({"difficulty_score": score}) == pytest.approx(expected)


def test_ce_equals_the_models_own_loss(tokenizer):
    from sft.model.loading import load_model

    torch.manual_seed(0)
    model = load_model("tiny")
    ids = torch.randint(10, len(tokenizer), (3, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 9:] = -100
    out = model(input_ids=ids, labels=labels)
    ours = CrossEntropyLoss()(out.logits, labels, (labels != -100).float())
    assert ours.item() == pytest.approx(out.loss.item(), rel=1e-5)


def test_focal_and_dft_factors_match_their_formulas_in_value_and_gradient():
    # Independent forms: focal -(1-p)^gamma log p and DFT -p log p, p the softmax probability of the target
    # with the factor's p detached (a constant in the gradient), over the same 5 tokens.
    mask = LABELS != -100
    for loss, factor in ((FocalLoss(gamma=2.0), lambda p: (1 - p) ** 2), (DFTLoss(), lambda p: p)):
        logits = LOGITS.clone().requires_grad_(True)
        p = logits[:, :-1].softmax(-1).gather(-1, LABELS[:, 1:].clamp_min(0)[..., None])[..., 0][mask[:, 1:]]
        expected = -(factor(p.detach()) * p.log()).sum() / mask.sum()
        ours = loss(logits, LABELS, mask.float())
        assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
        torch.testing.assert_close(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(expected, logits)[0])


def test_a_forward_factor_scales_the_numerator_only():
    # Halving every factor halves the loss: the denominator (summed before any forward) does not follow it.
    class Half(CrossEntropyLoss):
        def token_factor(self, ce):
            return torch.full_like(ce, 0.5)

    ones = (LABELS != -100).float()
    assert Half()(LOGITS, LABELS, ones).item() == pytest.approx(0.5 * CrossEntropyLoss()(LOGITS, LABELS, ones).item())


def test_length_weight_is_the_power_of_the_answers_length():
    loss = LengthLoss(length_ref=100, length_beta=0.5, alpha=1.0)
    assert loss.sample_weight({"difficulty_score": 2.0, "assistant_tokens": 400}) == pytest.approx(2.0 * 0.5)
    assert LengthLoss(length_beta=0.0).sample_weight({"difficulty_score": 3.0, "assistant_tokens": 9}) == 1.0


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


def test_packed_sample_normalisation_counts_each_sample_on_its_own():
    # The padded batch of LOGITS as one packed row: the same per-sample means, hence the same loss.
    packed_logits = LOGITS.reshape(1, 8, 3)
    packed_labels = LABELS.reshape(1, 8).clone()
    packed_labels[0, 4] = -100  # a sample's first token is never a target (DataCollatorWithFlattening)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    loss = HardSampleLoss(alpha=1.0, normalize="sample")
    packed = loss(packed_logits, packed_labels, WEIGHTS.reshape(1, 8), position_ids=position_ids)
    assert packed.item() == pytest.approx(hard_sample("sample").item(), rel=1e-6)


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
    with pytest.raises(ValueError, match="loss.impl='fast'"):
        choose_impl("fast", vocab_size=320, on_gpu=False)


# Families whose forward transforms the projected logits (Gemma-2/3 softcapping, Cohere's logit_scale,
# Granite's logits_scaling) and one that does not; the lm_head is scaled up so that the logits reach the
# softcap's range, as a trained model's do.
TRANSFORMS = {"gemma2": {"final_logit_softcapping": 5.0}, "cohere": {"logit_scale": 0.5},
              "granite": {"logits_scaling": 4.0}, "qwen2": {}}


@pytest.mark.parametrize("model_type", sorted(TRANSFORMS))
def test_the_lean_loss_applies_the_models_own_logit_transform(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft.loss.logits import LogitTransform

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                  **TRANSFORMS[model_type])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100.0)
    ids = torch.randint(0, 97, (2, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    own = model(input_ids=ids, labels=labels)
    own_grads = torch.autograd.grad(own.loss, [model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight])

    transform = LogitTransform.of(model.config)
    assert transform != LogitTransform() or model_type == "qwen2"
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    projected = hidden @ model.lm_head.weight.T
    assert projected.abs().max() > 10, "the logits never reach a softcap's range: the test would not see it"
    terms = CrossEntropyLoss(chunk_tokens=5).terms(labels, (labels != -100).float(), hidden=hidden,
                                                   lm_head=model.lm_head.weight, impl="chunked", transform=transform)
    ours = terms.loss_sum / terms.denominator.sum()
    assert ours.item() == pytest.approx(own.loss.item(), rel=1e-5)
    for a, b in zip(own_grads, torch.autograd.grad(ours, [model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight])):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    if model_type != "qwen2":  # without the transform the lean loss would be another loss
        plain = CrossEntropyLoss().terms(labels, (labels != -100).float(), hidden=hidden.detach(),
                                         lm_head=model.lm_head.weight.detach(), impl="chunked")
        assert abs((plain.loss_sum / plain.denominator.sum()).item() - own.loss.item()) > 1e-2


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


def test_difficulty_weights_of_a_split_are_each_rows_difficulty_weight():
    scores = np.array([0.0, 0.5, 1.0, 3.0, 1e300, float("nan"), 7.25])
    for loss in (HardSampleLoss(alpha=1.0), HardSampleLoss(alpha=2.0, max_weight=10.0, min_weight=0.5),
                 HardSampleLoss(alpha=-1.5), HardSampleLoss(alpha=0.0), CrossEntropyLoss()):
        expected = [loss.difficulty_weight(s) for s in scores]
        np.testing.assert_array_equal(loss.difficulty_weights(scores), expected)
