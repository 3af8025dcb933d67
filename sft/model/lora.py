"""LoRA through PEFT (`lora=default`, `dora`, `qlora`): its knobs (`LoraConfig`, the fields of `peft.LoraConfig`,
which `instantiate` builds directly) and the adapters put on a model with their targets checked (`apply_lora`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sft.config.schema import ConfigError, Schema, config_schema, knob


@config_schema("lora", "lora")
@dataclass
class LoraConfig(Schema):
    """Fields of `peft.LoraConfig`, which `instantiate` builds directly."""

    _target_: str = "peft.LoraConfig"
    r: int = knob(16, "the adapters' rank")
    lora_alpha: int = knob(32, "the adapters' scale: alpha / r")
    lora_dropout: float = knob(0.05, "dropout on the adapters' input (0 for a mixture of experts' fused weights)")
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
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        if "lora_dropout" not in str(e):
            raise
        raise ConfigError("lora.lora_dropout", lora.lora_dropout, "this model's fused expert weights (mixture of "
                          "experts) take LoRA through PEFT's parameter wrappers, which have no dropout: set "
                          "lora.lora_dropout=0") from e


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
