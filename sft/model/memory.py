"""What a training step holds in memory, known before the first step: one line at the start of a run (`sft.run.build`).

    memory: about 61.2 GiB of 79.1 GiB for up to 32,768 tokens a micro-batch: weights 15.2, gradients 0.2,
    optimizer 0.3, activations 44.9, loss 0.6 GiB (activation checkpointing off; on, about 19.1 GiB)

- weights: each parameter's bytes in its dtype (a LoRA base held in bf16 counts 2 bytes a parameter);
- gradients: each trained parameter's, in its dtype; under `trainer.precision=pure`, a bf16 one's fp32 copy and
  that copy's fp32 gradient (the bf16 gradient is handed over at once);
- optimizer: AdamW's two fp32 moments a trained parameter (8 bytes; its 8-bit variants 2), SGD's momentum where
  `optim_args` sets one (4), Adafactor's factored moments (counted as none);
- activations: measured, not modelled. The decoder runs forward as training runs it (its dtypes, autocast, LoRA and
  its dropout, the attention kernel) over rows of three lengths, and every tensor autograd keeps for the backward
  is counted once, by its storage (`torch.autograd.graph.saved_tensors_hooks`; the parameters left out). From the
  differences: the bytes a token of a row, and the bytes that grow with the square of a row's length (an attention
  mask or eager attention's scores, T x T a row; none for flash, sdpa without a mask or `sdpa_varlen`), times the
  micro-batch's rows and their length. With activation checkpointing each layer keeps its input
  (hidden size x the activations' bytes a token) and one layer is recomputed at a time (the per-token figure over
  the layers);
- loss: the lean loss's one chunk of logits (`loss.chunk_tokens` x vocabulary x 4 bytes, its softmax and gradient:
  x 3), or the naive loss's logits for every position of the micro-batch (x 2);
- second model (a teacher, or ASFT's reference, read at each step): its weights, its no-grad forward's peak and its
  logits (`SecondFootprint`; said only where there is one).

Left out: CUDA's allocator (its cache and fragmentation), kernels' workspaces, an optimizer step's transient peak,
and everything of DeepSpeed and FSDP2 (sharded weights; no line is logged under either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2**30
PROBE_TOKENS = (32, 64, 96)  # the rows' lengths the activations are measured at (equally spaced)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int  # as the run trains: with activation checkpointing where it is on
    loss: int
    tokens: int  # a micro-batch's, at most
    checkpointing: bool
    other_activations: int  # with checkpointing the other way round
    second_model: int = 0  # a teacher's or reference's weights and no-grad forward (`SecondFootprint`)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.loss + self.second_model

    @property
    def total_other_way(self) -> int:
        """The total with activation checkpointing the other way round."""
        return self.total - self.activations + self.other_activations

    def line(self, limit: str = "") -> str:
        """The estimate in one line; `limit` (what the step may fill, in words: "71.2 GiB (90% of the GPU's 79.1)")
        after its total."""
        unit, size = ("GiB", GIB) if max(self.total, self.total_other_way) >= GIB else ("MiB", 2**20)
        digits = 1 if unit == "GiB" else 0
        parts = ", ".join(f"{name} {value / size:.{digits}f}" for name, value in (
            ("weights", self.weights), ("gradients", self.gradients), ("optimizer", self.optimizer),
            ("activations", self.activations), ("loss", self.loss))
            + ((("second model", self.second_model),) if self.second_model else ()))
        of = f" of {limit}" if limit else ""
        return (f"memory: about {self.total / size:.{digits}f} {unit}{of} for up to {self.tokens:,} tokens a "
                f"micro-batch: {parts} {unit} (activation checkpointing {'on' if self.checkpointing else 'off'}; "
                f"{'off' if self.checkpointing else 'on'}, about {self.total_other_way / size:.{digits}f} {unit})")


def optimizer_bytes_per_parameter(optim: str, optim_args: str | None = None) -> int:
    """The bytes of optimizer state a trained parameter holds under transformers' `optim` name."""
    name = optim.lower()
    if "8bit" in name:
        return 2
    if name.startswith("sgd"):  # a momentum buffer only where optim_args sets a momentum above 0
        args = dict(part.split("=", 1) for part in (optim_args or "").replace(" ", "").split(",") if "=" in part)
        return 4 if float(args.get("momentum", 0)) > 0 else 0
    if "adafactor" in name:
        return 0
    return 8  # AdamW and its kin: two fp32 moments


def activation_bytes(model, autocast_dtype: torch.dtype | None = None) -> tuple[float, float]:
    """The bytes autograd keeps for the backward, all decoder layers together (see the module's docstring): per
    token of a row, and per square of a row's length, from rows of `PROBE_TOKENS` lengths (what does not grow with the
    row is left out). The model's train/eval mode is restored, and the random numbers the run draws next (dropout,
    the data's order) are those it would have drawn without this; nothing is kept."""
    decoder = model.get_decoder()
    device = next(model.parameters()).device
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            short, middle, long = (saved_bytes(decoder, torch.randint(0, model.config.vocab_size, (1, length),
                                                                      device=device), parameters, autocast_dtype)
                                   for length in PROBE_TOKENS)
    finally:
        model.train(was_training)
    step = PROBE_TOKENS[1] - PROBE_TOKENS[0]  # bytes(T) = fixed + per_token T + per_square T^2
    per_square = max(0.0, ((long - middle) - (middle - short)) / (2 * step * step))
    per_token = (middle - short) / step - per_square * (PROBE_TOKENS[0] + PROBE_TOKENS[1])
    return per_token, per_square


def saved_bytes(decoder, ids: torch.Tensor, parameters: set[int], autocast_dtype: torch.dtype | None) -> int:
    """The bytes of the tensors autograd keeps for the backward of `decoder` on `ids`, each storage once, those of
    `parameters` (their storages' addresses) left out."""
    saved: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), torch.autocast(
            ids.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        decoder(input_ids=ids, use_cache=False)
    return sum(saved.values())


def parameter_bytes(model, pure: bool = False) -> tuple[int, int, int]:
    """The bytes of the weights and of the gradients, and the number of trained parameters (see the module's
    docstring)."""
    weights = gradients = trained = 0
    for p in model.parameters():
        weights += p.numel() * p.element_size()
        if p.requires_grad:
            trained += p.numel()
            held_in_half = pure and p.element_size() < 4  # pure: the fp32 copy and its gradient, not the bf16 one
            gradients += p.numel() * (8 if held_in_half else p.element_size())
    return weights, gradients, trained


@dataclass(frozen=True)
class SecondFootprint:
    """What the frozen second model a loss reads at each step holds (a teacher, `sft.model.second_model`): its weights,
    and, a token of the micro-batch, its no-grad forward's peak (modelled, not measured: nothing is kept for a
    backward, so autograd has nothing to count): the final hidden states kept for the loss and the largest layer's
    working set, its MLP's (the residual and its norm, the gate, up and product projections: 3 x hidden + 3 x
    intermediate, in its dtype); and its logits, every position's at once (`naive`) or a chunk's (x 2: projected again
    in the backward)."""

    weights: int
    per_token: int
    vocab: int

    @classmethod
    def of(cls, model) -> SecondFootprint:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hidden = config.hidden_size
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        element = next(model.parameters()).element_size()
        return cls(weights=parameter_bytes(model)[0], per_token=(3 * hidden + 3 * intermediate) * element,
                   vocab=config.vocab_size)

    def bytes(self, tokens: int, lean_loss: bool, chunk_tokens: int) -> int:
        logits = min(chunk_tokens, tokens) * self.vocab * 4 * 2 if lean_loss else tokens * self.vocab * 4
        return self.weights + tokens * self.per_token + logits


@dataclass(frozen=True)
class Footprint:
    """What a model's training step holds, measured once (`footprint`): the estimate of any micro-batch from it."""

    weights: int
    gradients: int
    optimizer: int
    per_token: float  # activations, all decoder layers: bytes a token of a row
    per_square: float  # and bytes a square of a row's length
    layers: int
    hidden: int
    activation_size: int  # bytes of an activation's element
    vocab: int
    lean_loss: bool
    chunk_tokens: int
    second: SecondFootprint | None = None

    def estimate(self, rows: int, length: int, checkpointing: bool) -> MemoryEstimate:
        """The step's memory for micro-batches of up to `rows` rows of up to `length` tokens (see the module's
        docstring)."""
        return self.estimate_tokens(rows * length, rows * length * length, checkpointing)

    def estimate_tokens(self, tokens: int, squares: int, checkpointing: bool) -> MemoryEstimate:
        """The step's memory for micro-batches of up to `tokens` tokens whose attention spans add up to `squares`
        (the sum of each row's length squared; each sample's, where packed)."""
        whole = tokens * self.per_token + squares * self.per_square
        checkpointed = tokens * self.layers * self.hidden * self.activation_size + whole / self.layers
        loss = (min(self.chunk_tokens, tokens) * self.vocab * 4 * 3 if self.lean_loss
                else tokens * self.vocab * 4 * 2)
        return MemoryEstimate(weights=self.weights, gradients=self.gradients, optimizer=self.optimizer,
                              activations=int(checkpointed if checkpointing else whole), loss=loss, tokens=tokens,
                              checkpointing=checkpointing,
                              other_activations=int(whole if checkpointing else checkpointed),
                              second_model=self.second.bytes(tokens, self.lean_loss, self.chunk_tokens)
                              if self.second is not None else 0)


def footprint(model, *, optim: str, optim_args: str | None = None, pure: bool = False,
              autocast_dtype: torch.dtype | None = None, lean_loss: bool = True,
              chunk_tokens: int = 1024, second_model=None) -> Footprint:
    """The model's parameters counted and its activations measured (three short forwards, `activation_bytes`); the
    `second_model` a loss reads at each step beside it, where it has one (`SecondFootprint`)."""
    weights, gradients, trained = parameter_bytes(model, pure)
    per_token, per_square = activation_bytes(model, autocast_dtype)
    config = model.config
    return Footprint(weights=weights, gradients=gradients,
                     optimizer=trained * optimizer_bytes_per_parameter(optim, optim_args),
                     per_token=per_token, per_square=per_square, layers=config.num_hidden_layers,
                     hidden=config.hidden_size,
                     activation_size=2 if autocast_dtype is not None else next(model.parameters()).element_size(),
                     vocab=config.vocab_size, lean_loss=lean_loss, chunk_tokens=chunk_tokens,
                     second=SecondFootprint.of(second_model) if second_model is not None else None)


def estimate(model, rows: int, length: int, *, optim: str, optim_args: str | None = None, pure: bool = False,
             autocast_dtype: torch.dtype | None = None, checkpointing: bool = False, lean_loss: bool = True,
             chunk_tokens: int = 1024) -> MemoryEstimate:
    """A training step's memory for micro-batches of up to `rows` rows (samples, where packed) of up to `length`
    tokens (see the module's docstring)."""
    return footprint(model, optim=optim, optim_args=optim_args, pure=pure, autocast_dtype=autocast_dtype,
                     lean_loss=lean_loss, chunk_tokens=chunk_tokens).estimate(rows, length, checkpointing)
