"""LoRA through PEFT (`lora=default`, `dora`, `qlora`): its knobs (`LoraConfig`, the fields of `peft.LoraConfig`,
which `instantiate` builds directly) and the adapters put on a model with their targets checked (`apply_lora`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sft.config.schema import ConfigError, Schema, config_schema, knob

log = logging.getLogger("sft")


@config_schema("lora", "lora")
@dataclass
class LoraConfig(Schema):
    """Fields of `peft.LoraConfig`, which `instantiate` builds directly."""

    _target_: str = "peft.LoraConfig"
    r: int = knob(16, "the adapters' rank")
    lora_alpha: int = knob(32, "the adapters' scale: alpha / r")
    # 0, as PEFT's and LLaMA-Factory's own default: PEFT draws a dropout mask over each adapted layer's whole input
    # (7 a decoder layer), which cost a third of a LoRA step on a CPU (docs/performance.md); 0.05 regularises
    lora_dropout: float = knob(0.0, "dropout on the adapters' input (0: none, PEFT's own default and the fastest; "
                               "0.05 regularises; 0 for a mixture of experts' fused weights)")
    target_modules: Any = knob("all-linear", "all-linear (PEFT: every linear layer but the output, whatever the "
                               "architecture names them: q_proj ... on Llama/Qwen, qkv_proj and gate_up_proj on "
                               "Phi-3), or a list of module names")
    bias: str = knob("none", "PEFT's bias: none | all | lora_only")
    use_dora: bool = knob(False, "DoRA: weight-decomposed adapters")
    task_type: str = knob("CAUSAL_LM", "PEFT's task type")

    def check(self, cfg=None):
        self.require("r", self.r >= 1, "must be >= 1")
        self.require("lora_alpha", self.lora_alpha > 0, "must be > 0")
        self.require("lora_dropout", 0 <= self.lora_dropout < 1, "must be in [0, 1)")
        self.require("target_modules", self.target_modules == "all-linear" or (
            not isinstance(self.target_modules, str) and len(self.target_modules) > 0),
            "must be all-linear or a non-empty list of module names")


def apply_lora(model, lora_node):
    """PEFT's LoRA as the `lora` node says, with its targets checked against the model."""
    from hydra.utils import instantiate
    from peft import get_peft_model

    lora = instantiate(lora_node, _convert_="all")
    check_lora_targets(model, lora.target_modules)
    linear = linear_layers(model) if lora.target_modules == "all-linear" else set()
    if linear and (refused := refused_by_peft(lora, model, linear)):
        # what the fused kernels of Mamba-based models bypass (their mixer's out_proj): all-linear is every other one
        log.warning("lora=all-linear: PEFT adapts no %s of the Mamba-based %s (its fused kernels would bypass an "
                    "adapter there): those layers train frozen", ", ".join(sorted(refused)), type(model).__name__)
        linear = {name for name in linear if name.rsplit(".", 1)[-1] not in refused}
        lora.target_modules = sorted({name.rsplit(".", 1)[-1] for name in linear})
    if linear and (fused := fused_expert_weights(model)):  # all-linear: the experts too, not Linear modules
        lora.target_parameters = sorted(set(lora.target_parameters or []) | fused)
    try:
        peft = get_peft_model(model, lora)
    except ValueError as e:
        if "lora_dropout" not in str(e):
            raise
        raise ConfigError("lora.lora_dropout", lora.lora_dropout, "this model's fused expert weights (mixture of "
                          "experts) take LoRA through PEFT's parameter wrappers, which have no dropout: set "
                          "lora.lora_dropout=0") from e
    wrapped = {name.removeprefix("base_model.model.") for name, m in peft.named_modules() if hasattr(m, "lora_A")}
    if missed := sorted(linear - wrapped):
        # PEFT's conversion of mixture-of-experts targets (transformers v4 -> v5) takes every linear layer named
        # gate_proj/up_proj/down_proj for a fused expert weight, so a shared expert's or a dense layer's MLP goes
        # without adapters (huggingface/peft#3711)
        log.warning("lora=all-linear: PEFT %s adapts no %d linear layer(s) of %s: %s%s (PEFT's conversion of mixture-"
                    "of-experts targets takes them for fused expert weights, huggingface/peft#3711); they train "
                    "frozen", peft_version(), len(missed), type(model).__name__, ", ".join(missed[:4]),
                    " ..." if len(missed) > 4 else "")
    return peft


def refused_by_peft(lora, model, linear: set[str]) -> set[str]:
    """The names of linear layers PEFT refuses to adapt on this model (before it starts: it would have wrapped some
    layers when it refuses another)."""
    from peft.tuners.tuners_utils import _check_lora_target_modules_mamba  # PEFT's own rule, by the layer's name

    refused = set()
    for name in {name.rsplit(".", 1)[-1] for name in linear}:
        try:
            _check_lora_target_modules_mamba(lora, model, name)
        except ValueError:
            refused.add(name)
    return refused


def fused_expert_weights(model) -> set[str]:
    """The names of a mixture of experts' fused weights ([experts, in, out] parameters of an `experts` module, as
    transformers 5 holds them: gpt-oss's gate_up_proj and down_proj), which LoRA reaches through PEFT's parameter
    wrappers (`target_parameters`)."""
    return {name for module_name, module in model.named_modules() if module_name.rsplit(".", 1)[-1] == "experts"
            for name, p in module.named_parameters(recurse=False) if p.dim() == 3}


def linear_layers(model) -> set[str]:
    """The names of `model`'s linear layers but its output layer: what `all-linear` means."""
    import torch

    output = model.get_output_embeddings()
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not output}


def peft_version() -> str:
    import peft

    return peft.__version__


def check_lora_targets(model, targets) -> None:
    """Each module name of `lora.target_modules` must name a linear layer of this model (PEFT would wrap
    the others and train a subset without a word)."""
    import torch

    if isinstance(targets, str):  # "all-linear", or a regex PEFT matches itself
        return
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ConfigError("lora.target_modules", list(targets), f"{', '.join(missing)} name no linear layer of "
                          f"{type(model).__name__}; its linear layers: {', '.join(linear)} (or all-linear)")
