"""Throughput in the training logs: tokens per second, padding, an MFU estimate and peak memory.

Counted per optimizer step by the trainer (summed over ranks at each log) and timed here over the
training steps only: the clock stops for evaluations and checkpoint saves. Logged keys:

- `tokens_per_second`: input tokens (padding excluded) per second, all ranks together;
- `trainable_tokens_per_second`: assistant tokens (those with a loss) per second;
- `padding_fraction`: share of the batches' positions that are padding (0 with `data.packing`);
- `mfu`: model FLOPs utilisation, `flops_per_token * tokens_per_second / (peak FLOP/s * devices)` with
  `flops_per_token = 2N + 2N + 2N_trainable + 6 * layers * attention_width * mean_sequence_length`: a
  forward (2N), the activations' gradients (2N) and the trainable weights' gradients (2N_trainable) over
  the N weights of the linear layers, plus causal attention (its forward and backward, half the context
  on average). That is 6N for full fine-tuning and about 4N with LoRA. The peak is
  `throughput.peak_tflops`, else the bf16 dense peak of the GPU found by name in `PEAK_TFLOPS`; no
  `mfu` without either (on CPU set `throughput.peak_tflops`);
- `peak_memory_gb`: this rank's peak: the CUDA allocator's on GPU, the process's resident set on CPU.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass
from typing import Optional

from sft.config.schema import Schema, knob
from sft.training.callbacks import Callback

log = logging.getLogger("sft")

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor data sheets), matched in this order.
PEAK_TFLOPS = [("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
               ("H100", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
               ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0),
               ("MI300X", 1307.0), ("MI250", 362.0), ("V100", 125.0), ("T4", 65.0)]


def device_peak_tflops(name: str | None = None) -> float | None:
    """The table's peak for the GPU of that name (None: this machine's), or None (no GPU, or not in the table, which
    `unknown_peak` says in a line)."""
    if name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def unknown_peak(name: str) -> str:
    """The line that says why a GPU's throughput has no MFU."""
    return (f"throughput: no mfu: {name} is not in the table of peak bf16 rates "
            "(sft.training.observability.throughput.PEAK_TFLOPS); set throughput.peak_tflops=<its TFLOP/s>")


def peak_memory_gb() -> float:
    """This process's peak memory: the CUDA allocator's on GPU, else the resident set (Linux: KiB)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def flops_per_token(model, mean_sequence_length: float, logit_fraction: float = 1.0) -> float:
    """Training FLOPs per input token (see the module docstring) for `model` at a mean sequence length: what a step
    executes. `logit_fraction`: the share of positions whose logits the loss computes (1 for the model's own
    logits; the trained positions' share for a lean kernel, which projects only those), which scales the output
    layer's products."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = trainable = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            n = getattr(module.weight, "ds_numel", module.weight.numel())  # ZeRO-3 shards
            n *= logit_fraction if module is head else 1.0
            linear += n
            trainable += n if module.weight.requires_grad else 0
    return 4 * linear + 2 * trainable + attention_flops_per_token(model, mean_sequence_length)


def model_flops_per_token(model, mean_sequence_length: float) -> float:
    """The MFU convention's FLOPs per token: 6N over the N weights of the model's own linear layers (every
    position's logits, every weight's gradient, whether trained or frozen; adapters not counted) plus attention."""
    import torch

    adapters = {id(m) for name, m in model.named_modules() if any(p.startswith("lora_") for p in name.split("."))}
    weights = sum(getattr(m.weight, "ds_numel", m.weight.numel()) for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and id(m) not in adapters)
    return 6 * weights + attention_flops_per_token(model, mean_sequence_length)


def attention_flops_per_token(model, mean_sequence_length: float) -> float:
    """Causal attention's forward and backward per token: its two products over half the context on average."""
    config = model.config
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 6 * config.num_hidden_layers * width * mean_sequence_length


@dataclass(eq=False)
class ThroughputMeter(Callback, Schema):
    """Times the training steps; turns the trainer's token counts into the logged throughput values."""

    _target_: str = "sft.training.observability.throughput.ThroughputMeter"
    peak_tflops: Optional[float] = knob(None, "per device, for the MFU estimate; null: from the GPU's name (table)")

    def check(self, cfg=None):
        self.require("peak_tflops", self.peak_tflops is None or self.peak_tflops > 0, "must be > 0 (or null)")

    def __post_init__(self):
        self.model = None
        self.devices = 1
        self._clock = time.perf_counter()
        self.busy_s = 0.0  # training time since the last log
        self.total_s = 0.0  # training time of this session
        self.total_tokens = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model, self.devices = model, args.world_size
        self.peak_tflops = self.peak_tflops or device_peak_tflops()
        if self.peak_tflops is None and args.device.type == "cuda" and state.is_world_process_zero:
            import torch

            log.info("%s", unknown_peak(torch.cuda.get_device_name(args.device)))
        self._clock = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.busy_s += now - self._clock
        self._clock = now

    def on_evaluate(self, args, state, control, **kwargs):
        self._clock = time.perf_counter()  # evaluation time is not training time

    def on_save(self, args, state, control, **kwargs):
        self._clock = time.perf_counter()

    def log_values(self, samples: float, tokens: float, positions: float, trainable_tokens: float) -> dict:
        """Values for a training log from the counts (all ranks) since the previous one."""
        seconds, self.busy_s = self.busy_s, 0.0
        self.total_s += seconds
        self.total_tokens += tokens
        values = {"peak_memory_gb": round(peak_memory_gb(), 3)}
        if positions:
            values["padding_fraction"] = round(1 - tokens / positions, 4)
        if seconds > 0 and tokens:
            values["tokens_per_second"] = round(tokens / seconds, 1)
            values["trainable_tokens_per_second"] = round(trainable_tokens / seconds, 1)
            if self.peak_tflops and self.model is not None and samples:
                flops = flops_per_token(self.model, tokens / samples) * tokens / seconds
                values["mfu"] = round(flops / (self.peak_tflops * 1e12 * self.devices), 4)
        return values

    @property
    def tokens_per_second(self) -> float | None:
        """Input tokens per second over this session's logged training time."""
        return round(self.total_tokens / self.total_s, 1) if self.total_s else None
