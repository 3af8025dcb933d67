"""The built-in losses (`sft.loss.builtin`): each against its formula in value and gradient, and against the model's
own loss; the keyword loss's token weights."""

import math

import pytest
import torch
from conftest import SAFETY, write_jsonl
from loss_math import LABELS, LOGITS, hand_ce

from sft.data.tokens.collator import WeightedDataCollator
from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec
from sft.config.schema import ConfigError
from sft.loss.builtin import (ASFTLoss, CrossEntropyLoss, DFTLoss, DistillLoss, EAFTLoss, FocalLoss, HardSampleLoss,
                              KeywordLoss, LengthLoss, ReferenceWeightedLoss)


def weighted_text(tokenizer, data, row: int, weight: float) -> str:
    """The decoded tokens of a row that the collator gives loss weight `weight`."""
    batch = WeightedDataCollator(tokenizer)([data.train[row]])
    ids = batch["input_ids"][0][batch["weights"][0] == weight]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("knobs, expected", [
    ({}, ["PASSWORD", "", " password"]),  # case folded, whole words: "Passwords" is another word
    ({"case_fold": False}, ["", "", " password"]),
    ({"whole_words": False}, ["PASSWORD", "Password", " password"]),  # the tokens overlapping "Password"
])
def test_keyword_weights_fall_on_the_assistant_tokens_of_each_phrase(tmp_path, tokenizer, knobs, expected):
    path = write_jsonl(tmp_path / "t.jsonl", SAFETY)
    data = load_sft_datasets(DataSpec(train_file=str(path)), tokenizer, KeywordLoss(phrases=["password"], factor=3.0,
                                                                                    **knobs))
    for row, text in enumerate(expected):  # the prompts say "password" too: never weighted, never trained
        assert weighted_text(tokenizer, data, row, 3.0).strip() == text.strip()


def test_a_phrases_file_is_part_of_the_cache_key_and_a_phrase_that_matches_nothing_warns(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "t.jsonl", SAFETY)
    phrases = tmp_path / "phrases.txt"
    phrases.write_text("# safety words\nlogin page\n\n")
    first = load_sft_datasets(DataSpec(train_file=str(path)), tokenizer, KeywordLoss(phrases_file=str(phrases)))
    assert weighted_text(tokenizer, first, 0, 3.0).strip() == "login page"
    phrases.write_text("nothing like this\n")  # the same path, other phrases: tokenised again, another hash
    with caplog.at_level("WARNING", logger="sft.data"):
        second = load_sft_datasets(DataSpec(train_file=str(path)), tokenizer, KeywordLoss(phrases_file=str(phrases)))
    assert second.data_hash != first.data_hash and weighted_text(tokenizer, second, 0, 3.0) == ""
    trained = second.summary["train"].trained_tokens
    assert f"its token weights leave every one of the {trained} trained tokens of {path} at 1" in caplog.text


def test_inspect_data_shows_the_keyword_stretches_and_their_count(tmp_path):
    from sft.commands.inspect import inspect

    path = write_jsonl(tmp_path / "t.jsonl", SAFETY[:1])
    report = inspect([f"data.train_file={path}", "data.eval_file=null", "loss=keywords", "loss.phrases=[password]",
                      "loss.regex=false", "loss.alpha=1"], rows=1)
    # difficulty 2, times 3 on the phrase's tokens (the tiny tokenizer spells PASSWORD in 8)
    answer = "⟦Never share your ⟧×2⟦PASSWORD⟧×6⟦; reset it from the login page.<|im_end|>⟧×2"
    assert f"assistant\n{answer}\n" in report
    assert "trained (59.3%), 8 of them reweighted by the loss's token weights\n\ntemplate: " in report


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


def test_length_weight_is_the_power_of_the_answers_length():
    loss = LengthLoss(length_ref=100, length_beta=0.5, alpha=1.0)
    assert loss.sample_weight({"difficulty_score": 2.0, "assistant_tokens": 400}) == pytest.approx(2.0 * 0.5)
    assert LengthLoss(length_beta=0.0).sample_weight({"difficulty_score": 3.0, "assistant_tokens": 9}) == 1.0


def test_distill_is_its_docstring_example():
    loss = DistillLoss(kd_ratio=0.5)
    value, ce = loss.token_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([0]), torch.tensor([[math.log(3), 0.0]]))
    assert ce.item() == pytest.approx(math.log(2))
    assert value.item() == pytest.approx(0.4120, abs=1e-4)


def test_distill_is_the_weighted_mix_of_ce_and_kl_in_value_and_gradient():
    # Independent form: per token (1 - r) * -log p_S(y) + r * sum_v p_T(v) log(p_T(v) / p_S(v)), hard-sample weighted
    torch.manual_seed(0)
    teacher = LOGITS + torch.randn(LOGITS.shape)
    weights = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 3.0, 3.0, 3.0]])  # sample 1 three times as hard
    mask = LABELS[:, 1:] != -100
    logits = LOGITS.clone().requires_grad_(True)
    log_s, log_t = logits[:, :-1].log_softmax(-1), teacher[:, :-1].log_softmax(-1)
    ce = -log_s.gather(-1, LABELS[:, 1:].clamp_min(0)[..., None])[..., 0]
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    w = weights[:, 1:]
    expected = ((0.7 * ce + 0.3 * kl) * w)[mask].sum() / w[mask].sum()
    ours = DistillLoss(kd_ratio=0.3)(logits, LABELS, weights, second_logits=teacher)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(expected, logits)[0])
    # kd_ratio 0 is the cross entropy, whatever the teacher says
    assert DistillLoss(kd_ratio=0.0)(LOGITS, LABELS, weights, second_logits=teacher).item() == pytest.approx(
        HardSampleLoss(alpha=0.0)(LOGITS, LABELS, weights).item(), rel=1e-6)


def test_distill_over_output_layers_of_other_widths_compares_the_shared_columns():
    # a teacher whose output layer pads the vocabulary with more rows: the divergence over the first 3 columns
    wide = torch.cat([LOGITS + 0.5, torch.full((2, 4, 2), 9.0)], -1)
    narrow = DistillLoss(kd_ratio=1.0)(LOGITS, LABELS, (LABELS != -100).float(), second_logits=LOGITS + 0.5)
    padded = DistillLoss(kd_ratio=1.0)(LOGITS, LABELS, (LABELS != -100).float(), second_logits=wide)
    assert narrow.item() == pytest.approx(0.0, abs=1e-6)  # a shift of every logit is the same distribution
    assert padded.item() == pytest.approx(narrow.item(), abs=1e-6)


@pytest.mark.parametrize("knobs, field", [({"kd_ratio": 1.5}, "kd_ratio"), ({"temperature": 0.0}, "temperature"),
                                          ({"beta": 1.0}, "beta"), ({"divergence": "tv"}, "divergence")])
def test_distill_refuses_a_bad_knob_naming_it(knobs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        DistillLoss(**knobs)


def test_eaft_is_its_docstring_example():
    logits = torch.tensor([[0.0, 0.0, -30.0], [5.0, 0.0, -30.0]])  # the third logit falls outside the top 2
    value, ce = EAFTLoss(top_k=2).token_loss(logits, torch.tensor([0, 1]), None)
    assert (value / ce).tolist() == pytest.approx([1.0, 0.0580], abs=1e-4)


def test_eaft_is_the_papers_formula_in_value_and_gradient():
    # The form of LLaMA-Factory's port: top-k logits, softmax, entropy with a 1e-10 floor, normalised (there by 3.0,
    # about log 20; here by log k), ** alpha, detached, times each token's cross entropy
    mask = LABELS[:, 1:] != -100
    logits = LOGITS.clone().requires_grad_(True)
    shifted = logits[:, :-1][mask]
    with torch.no_grad():
        top = torch.topk(shifted.float(), k=2, dim=-1).values
        probs = torch.softmax(top, dim=-1)
        weights = torch.pow(-(probs * torch.log(probs + 1e-10)).sum(-1) / math.log(2), 1.5)
    ce = torch.nn.functional.cross_entropy(shifted, LABELS[:, 1:][mask], reduction="none")
    expected = (weights * ce).sum() / mask.sum()
    ours = EAFTLoss(top_k=2, entropy_power=1.5)(logits, LABELS, (LABELS != -100).float())
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(expected, logits)[0],
                               atol=1e-6, rtol=1e-5)
    assert EAFTLoss(entropy_power=0.0)(LOGITS, LABELS, (LABELS != -100).float()).item() == pytest.approx(
        CrossEntropyLoss()(LOGITS, LABELS, (LABELS != -100).float()).item(), rel=1e-6)


@pytest.mark.parametrize("knobs, field", [({"top_k": 1}, "top_k"), ({"entropy_power": -1.0}, "entropy_power")])
def test_eaft_refuses_a_bad_knob_naming_it(knobs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        EAFTLoss(**knobs)


def test_asft_is_its_docstring_example():
    value, _ = ASFTLoss(kl_weight=0.05).token_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([0]),
                                                   torch.tensor([[math.log(3), 0.0]]))
    assert value.item() == pytest.approx(0.3531, abs=1e-4)


def test_asft_is_dft_plus_the_kl_anchor_in_value_and_gradient():
    # LLaMA-Factory's form: the DFT loss's token mean plus kl_weight times the token mean of
    # kl_div(log_softmax(model), softmax(reference)) summed over the vocabulary
    torch.manual_seed(1)
    reference = LOGITS + torch.randn(LOGITS.shape)
    mask = LABELS[:, 1:] != -100
    logits = LOGITS.clone().requires_grad_(True)
    shifted, labels = logits[:, :-1][mask], LABELS[:, 1:][mask]
    ce = torch.nn.functional.cross_entropy(shifted, labels, reduction="none")
    dft = (ce * torch.exp(-ce).detach()).mean()
    kl = torch.nn.functional.kl_div(shifted.log_softmax(-1), reference[:, :-1][mask].softmax(-1),
                                    reduction="none").sum(-1).mean()
    expected = dft + 0.1 * kl
    ours = ASFTLoss(kl_weight=0.1)(logits, LABELS, (LABELS != -100).float(), second_logits=reference)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(expected, logits)[0],
                               atol=1e-6, rtol=1e-5)
    # kl_weight 0 is dft
    assert ASFTLoss(kl_weight=0.0)(LOGITS, LABELS, (LABELS != -100).float(), second_logits=reference).item() == \
        pytest.approx(DFTLoss()(LOGITS, LABELS, (LABELS != -100).float()).item(), rel=1e-6)


def test_reference_weights_are_their_docstring_examples():
    assert ReferenceWeightedLoss(top_ratio=0.5).weights_of([2.0, -1.0, 0.5, 0.0]).tolist() == [1, 0, 1, 0]
    assert ReferenceWeightedLoss(select="soft").weights_of([1.0, 0.0]) == pytest.approx([1.4621, 0.5379], abs=1e-4)


def test_reference_weights_keep_the_top_share_by_excess_or_weigh_by_its_exponential():
    import numpy as np

    excess = np.random.default_rng(0).normal(size=1000)
    kept = ReferenceWeightedLoss(top_ratio=0.3).weights_of(excess)
    assert set(kept.tolist()) == {0.0, 1.0} and kept.sum() == 300
    assert excess[kept == 1].min() > excess[kept == 0].max()  # the highest 300, whatever the order
    soft = ReferenceWeightedLoss(select="soft", temperature=0.5).weights_of(excess)
    assert soft.mean() == pytest.approx(1.0)
    i, j = 3, 7  # each weight proportional to exp(excess / T)
    assert soft[i] / soft[j] == pytest.approx(math.exp((excess[i] - excess[j]) / 0.5), rel=1e-9)
    assert "300 of 1,000 trained tokens kept (top 30%" in ReferenceWeightedLoss(top_ratio=0.3).describe_weights(excess)


@pytest.mark.parametrize("knobs, field", [({"top_ratio": 0.0}, "top_ratio"), ({"top_ratio": 1.5}, "top_ratio"),
                                          ({"temperature": 0.0}, "temperature"), ({"select": "median"}, "select")])
def test_reference_weighted_refuses_a_bad_knob_naming_it(knobs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        ReferenceWeightedLoss(**knobs)
