"""The linear layers' weights held in bf16 over fp32 master weights in the optimizer (`trainer.precision=pure`).

Under bf16 autocast (`trainer.precision=mixed`) the parameters are fp32 and every forward casts each linear layer's
weight to bf16 again (a frozen LoRA base too, every micro-batch), and holds the fp32 weights besides. `pure` holds
those weights in bf16 (`hold_linear_weights_in_bf16`: the very values autocast would cast them to) and keeps, in the
optimizer, an fp32 copy of each trained one; everything else (embeddings, norms, the output layer, the residual
sums) stays as autocast runs it, so a step computes what a mixed step computes:

- the optimizer steps the fp32 copies (its state is fp32 too), and each bf16 parameter is then set to its copy,
  rounded: an update smaller than bf16's resolution (8 bits of mantissa: a weight of 0.03 moves in steps of 1.2e-4)
  accumulates in the copy until it shows, where a bf16 optimizer would drop it every step;
- each micro-batch's bf16 gradient is added into the copy's fp32 gradient as soon as it is accumulated (a hook
  after the parameter's gradient accumulation), so gradient accumulation sums in fp32;
- the copies travel in the optimizer's state dict (`fp32_weight` of each parameter's state), so a resume goes on
  from the fp32 values, not from the bf16 weights of the checkpoint's model.

    hold_linear_weights_in_bf16(model)       # nn.Linear weights: bf16; the rest fp32, under autocast
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    master = MasterWeights.attach(optimizer)  # the optimizer now steps fp32 copies
    loss(model).backward()                    # bf16 gradients -> the copies' fp32 .grad
    optimizer.step()                          # fp32 step; the bf16 weights set to the copies, rounded

Trained parameters that are fp32 (embeddings, norms, the output layer) are stepped as they are; LoRA's adapters are
linear layers, held in bf16 over copies like the rest, and the frozen base they adapt in bf16 alone. One process only: DDP all-reduces the parameters' own gradients, which the hook hands over to the
copies (FSDP2 and DeepSpeed keep fp32 masters of their own; `TrainerConfig.check` says so).
"""

from __future__ import annotations

import torch

from sft.config.schema import ConfigError

STATE_KEY = "fp32_weight"  # the copy, in the optimizer state of the parameter it stands for
KEPT = "sft_fp32_value"  # a trained parameter's fp32 value from before the cast, until the optimizer takes it


@torch.no_grad()
def hold_linear_weights_in_bf16(model: torch.nn.Module) -> int:
    """Cast the weights (and biases) of the model's `nn.Linear` layers to bf16 in place (LoRA's adapters and the frozen
    layers they adapt too), but the output layer's (the loss projects in its own dtype; a tied one is the input
    embedding); return how many parameters that holds in bf16. A trained parameter keeps its fp32 value beside it,
    which `MasterWeights.attach` makes its copy: the copy starts where autocast's fp32 weight does, not rounded.
    Subclasses (bitsandbytes' 4-bit layers) are left alone. The model then runs under bf16 autocast only, as
    accelerate runs it once prepared (its forward wrapped in autocast)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    held = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not output:
            for param in module.parameters(recurse=False):
                if param.dtype != torch.float32:
                    continue
                if param.requires_grad:
                    setattr(param, KEPT, param.data)
                param.data = param.data.to(torch.bfloat16)
                held += param.numel()
    return held


class MasterWeights:
    """The fp32 copies an optimizer steps in place of its low-precision parameters (see the module)."""

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.optimizer = optimizer
        self.pairs = pairs  # (the model's bf16 parameter, its fp32 copy)
        self._copy_of = {id(param): copy for param, copy in pairs}
        for param, copy in pairs:  # the hooks live as long as the parameters and the optimizer: the run
            param.register_post_accumulate_grad_hook(self._hand_over(copy))
        optimizer.register_step_post_hook(lambda *_: self.copy_to_model())
        optimizer.register_load_state_dict_post_hook(lambda *_: self.restore())

    @classmethod
    def attach(cls, optimizer: torch.optim.Optimizer, processes: int = 1) -> MasterWeights | None:
        """Give `optimizer` an fp32 copy of each parameter of another floating dtype, in place of it, in its param
        groups (before its first step: it holds no state yet); None where all its parameters are fp32. On one
        process only (`processes`: the run's)."""
        if processes > 1:
            raise ConfigError("trainer.precision", "pure", f"{processes} processes: DDP all-reduces the parameters' "
                              "own gradients, which pure hands to the optimizer's fp32 copies; one process only (set "
                              "trainer.precision=mixed)")
        pairs = []
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                if param.is_floating_point() and param.dtype != torch.float32:
                    kept = param.__dict__.pop(KEPT, None)
                    if kept is not None and not torch.equal(kept.to(param.device, param.dtype), param.detach()):
                        kept = None  # the parameter was set since (a checkpoint's weights): its own value then
                    copy = param.detach().float() if kept is None else kept.to(param.device)
                    group["params"][i] = copy
                    pairs.append((param, copy))
        return cls(optimizer, pairs) if pairs else None

    @staticmethod
    def _hand_over(copy: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            # this micro-batch's gradient, summed in fp32; the bf16 one is freed at once
            copy.grad = param.grad.float() if copy.grad is None else copy.grad.add_(param.grad)
            param.grad = None

        return hook

    def trained(self) -> list[torch.Tensor]:
        """What the optimizer steps: the copies, and the fp32 parameters as they are."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def holding_gradients(self, params) -> list[torch.Tensor]:
        """The tensor that holds each parameter's gradient (its copy, or itself), in the parameters' order: what a
        step's norm, clipping and skipping act on, summed in the order they would be without copies."""
        return [self._copy_of.get(id(p), p) for p in params]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After a step: each bf16 parameter set to its copy (rounded to nearest), the copies' gradients dropped, and
        each copy named in its state, which is how a checkpoint holds it."""
        for param, copy in self.pairs:
            param.copy_(copy)
            state = self.optimizer.state[copy]
            # Not in a state the optimizer has still to make (AdamW makes it at a parameter's first gradient, and
            # would take a non-empty one for made); SGD without momentum makes none and reads none.
            if state or copy.grad is not None:
                state[STATE_KEY] = copy
            copy.grad = None

    @torch.no_grad()
    def restore(self) -> None:
        """After the optimizer's state is loaded (a resume): each copy takes its saved fp32 value, and the model's
        parameter that value rounded."""
        for param, copy in self.pairs:
            state = self.optimizer.state.get(copy)
            if state and STATE_KEY in state:
                copy.copy_(state[STATE_KEY])
                state[STATE_KEY] = copy
                param.copy_(copy)
