"""How far a student's next-token distribution is from a teacher's, per token (knowledge distillation's term):
forward KL, reverse KL and the skewed Jensen-Shannon divergence between `softmax(student / T)` and
`softmax(teacher / T)`, times `T ** 2` (so that the gradients keep their scale as the temperature changes, as in
Hinton et al., 2015). Pure maths on `[tokens, vocabulary]` logits; `sft.loss.builtin.DistillLoss` mixes it with the
cross entropy.

    student = [[0, 0]], teacher = [[log 3, 0]]  (p_S = [1/2, 1/2], p_T = [3/4, 1/4])
    forward:  KL(p_T || p_S) = 3/4 log(3/2) + 1/4 log(1/2)  = 0.1308
    reverse:  KL(p_S || p_T) = 1/2 log(2/3) + 1/2 log(2)    = 0.1438
    jsd, beta=0.5:  m = [5/8, 3/8]; 1/2 KL(p_T || m) + 1/2 KL(p_S || m) = 0.0338
"""

from __future__ import annotations

import math

import torch


def token_divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str = "forward", beta: float = 0.5,
                     temperature: float = 1.0) -> torch.Tensor:
    """Per-row divergence `[N]` between the distributions of `student` and `teacher` logits `[N, V]` (float32),
    differentiable in `student` (the teacher's are constants), of `kind` (`sft.loss.builtin.Divergence`): `forward`
    KL(teacher || student), mass-covering, the classic distillation term; `reverse` KL(student || teacher),
    mode-seeking (MiniLLM's); `jsd` beta KL(teacher || m) + (1 - beta) KL(student || m), m = beta teacher + (1 - beta)
    student (GKD's generalised Jensen-Shannon), `beta` in (0, 1). Output layers of other widths over one vocabulary
    (Qwen2.5-7B's 152,064 rows beside 0.5B's 151,936, both padding the same 151,665 tokens) are compared over their
    shared first columns."""
    width = min(student.size(-1), teacher.size(-1))
    s = torch.log_softmax(student[:, :width] / temperature, dim=-1)
    t = torch.log_softmax(teacher[:, :width] / temperature, dim=-1)
    if kind == "forward":
        value = _kl(t, s)
    elif kind == "reverse":
        value = _kl(s, t)
    elif kind == "jsd":
        m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log1p(-beta)]), dim=0)
        value = beta * _kl(t, m) + (1 - beta) * _kl(s, m)
    else:
        raise ValueError(f"divergence {kind!r}: forward, reverse or jsd")
    return value * temperature ** 2


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probabilities; a token p gives no mass adds nothing (0 log 0 = 0)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
