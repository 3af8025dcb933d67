"""Muon (`trainer.optim=muon`): PyTorch's `torch.optim.Muon` on the hidden layers' matrices, AdamW on the rest, as its
authors prescribe (Jordan et al., 2024; Moonlight, Liu et al., 2025): Muon orthogonalises each 2-D weight's momentum
(Newton-Schulz), which suits the layers' matrices; the embeddings, the output layer (rows of a vocabulary, not a linear
map to orthogonalise), norms and biases stay on AdamW. One learning rate serves both: Muon's update is scaled to
AdamW's RMS (`adjust_lr_fn="match_rms_adamw"`, Moonlight's), so the schedule and `trainer.learning_rate` mean what
they mean for AdamW.

    optimizer = MuonWithAdamW.of(model, args, trainer.get_decay_parameter_names(model))  # WeightedLossTrainer's
      Qwen2's q/k/v/o, gate/up/down weights (and LoRA's A and B)  ->  Muon
      embed_tokens, lm_head, the norms, the biases                ->  AdamW (Trainer's betas, epsilon, weight decay)

The two halves are one optimizer to Trainer, its schedule and its checkpoints: their parameter groups in one list, a
step that steps both, one state dict holding both (a resume goes on from both states).
"""

from __future__ import annotations

from collections import ChainMap

import torch

MUON_MOMENTUM = 0.95  # torch's and the authors' default
TORCH_MUON = "2.9"  # the first PyTorch with torch.optim.Muon


def muon_missing() -> str | None:
    """Why this PyTorch has no Muon, or None."""
    if hasattr(torch.optim, "Muon"):
        return None
    return f"torch.optim.Muon came with PyTorch {TORCH_MUON}; this is {torch.__version__}"


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over `matrices`, `torch.optim.AdamW` over `others` (parameter groups), as one optimizer."""

    def __init__(self, matrices: list, others: list[dict], *, lr: float, weight_decay: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, momentum: float = MUON_MOMENTUM):
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__([p for group in self.halves_groups() for p in group["params"]], {"lr": lr})
        # the halves' own groups (the schedule sets each one's lr) and states, seen through this optimizer
        self.param_groups = self.halves_groups()
        self.state = ChainMap(self.muon.state, self.adamw.state)

    @classmethod
    def of(cls, model: torch.nn.Module, args, decayed: list[str]) -> MuonWithAdamW:
        """The optimizer of `model`'s trained parameters with `TrainingArguments` `args`' learning rate, AdamW betas,
        epsilon and weight decay, decayed on the parameters named in `decayed` (Trainer's
        `get_decay_parameter_names`: none on biases and norms, as its own AdamW)."""
        aside = {id(layer.weight) for layer in (model.get_input_embeddings(), model.get_output_embeddings())
                 if layer is not None}
        decayed = set(decayed)
        matrices, decay, no_decay = [], [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim == 2 and id(p) not in aside:
                matrices.append(p)
            else:
                (decay if name in decayed else no_decay).append(p)
        others = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        return cls(matrices, [g for g in others if g["params"]], lr=args.learning_rate,
                   weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)

    def halves_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.halves_groups()  # (loading replaces the halves' group dicts)
        self.state = ChainMap(self.muon.state, self.adamw.state)
