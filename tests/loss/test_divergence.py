"""The divergences between two models' next-token distributions (`sft.loss.divergence`): each against an independent
computation (PyTorch's `kl_div`, a float64 sum by hand), in value and in gradient, at temperatures other than 1."""

import math

import pytest
import torch
import torch.nn.functional as F

from sft.loss.divergence import token_divergence

GENERATOR = torch.Generator().manual_seed(0)
STUDENT = torch.randn(5, 11, generator=GENERATOR) * 3
TEACHER = torch.randn(5, 11, generator=GENERATOR) * 3


def by_hand(student, teacher, kind, beta=0.5, temperature=1.0):
    """The divergence as a float64 sum over the vocabulary, from the probabilities themselves."""
    p_s = torch.softmax(student.double() / temperature, -1)
    p_t = torch.softmax(teacher.double() / temperature, -1)

    def kl(p, q):
        return (p * (p / q).log()).sum(-1)

    if kind == "forward":
        value = kl(p_t, p_s)
    elif kind == "reverse":
        value = kl(p_s, p_t)
    else:
        m = beta * p_t + (1 - beta) * p_s
        value = beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)
    return value * temperature ** 2


def test_the_docstring_example():
    student, teacher = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3), 0.0]])
    assert token_divergence(student, teacher, "forward").item() == pytest.approx(0.1308, abs=1e-4)
    assert token_divergence(student, teacher, "reverse").item() == pytest.approx(0.1438, abs=1e-4)
    assert token_divergence(student, teacher, "jsd", beta=0.5).item() == pytest.approx(0.0338, abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_forward_and_reverse_kl_are_pytorchs_kl_div(temperature):
    log_s = F.log_softmax(STUDENT / temperature, -1)
    log_t = F.log_softmax(TEACHER / temperature, -1)
    forward = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1) * temperature ** 2
    reverse = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1) * temperature ** 2
    torch.testing.assert_close(token_divergence(STUDENT, TEACHER, "forward", temperature=temperature), forward)
    torch.testing.assert_close(token_divergence(STUDENT, TEACHER, "reverse", temperature=temperature), reverse)


@pytest.mark.parametrize("kind, beta, temperature", [("forward", 0.5, 1.0), ("reverse", 0.5, 1.5),
                                                     ("jsd", 0.5, 1.0), ("jsd", 0.1, 2.0), ("jsd", 0.9, 1.0)])
def test_each_divergence_is_its_formula_by_hand(kind, beta, temperature):
    ours = token_divergence(STUDENT, TEACHER, kind, beta, temperature)
    torch.testing.assert_close(ours.double(), by_hand(STUDENT, TEACHER, kind, beta, temperature), atol=1e-5, rtol=1e-5)
    assert (ours >= -1e-6).all()
    assert token_divergence(TEACHER, TEACHER, kind, beta, temperature).abs().max() < 1e-5  # zero for one distribution


def test_the_forward_kl_gradient_is_the_students_minus_the_teachers_probabilities():
    # d/dz_s of T^2 KL(p_T || p_S), p = softmax(z / T): T (p_S - p_T), the soft-target cross entropy's gradient
    temperature = 2.0
    student = STUDENT.clone().requires_grad_(True)
    token_divergence(student, TEACHER, "forward", temperature=temperature).sum().backward()
    expected = temperature * (torch.softmax(STUDENT / temperature, -1) - torch.softmax(TEACHER / temperature, -1))
    torch.testing.assert_close(student.grad, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["reverse", "jsd"])
def test_the_other_gradients_are_those_of_the_formula_by_hand(kind):
    student = STUDENT.double().clone().requires_grad_(True)
    by_hand(student, TEACHER, kind, 0.3, 1.5).sum().backward()
    ours = STUDENT.clone().requires_grad_(True)
    token_divergence(ours, TEACHER, kind, 0.3, 1.5).sum().backward()
    torch.testing.assert_close(ours.grad.double(), student.grad, atol=1e-5, rtol=1e-4)


def test_an_unknown_divergence_is_refused():
    with pytest.raises(ValueError, match="forward, reverse or jsd"):
        token_divergence(STUDENT, TEACHER, "wasserstein")
