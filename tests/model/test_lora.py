"""LoRA through PEFT (`sft.model.lora`): all-linear wraps every linear layer but the output on each architecture, and
names that match no linear layer are refused naming the model's."""

import pytest
import torch
from architectures import CASES, IDS, batch, tiny
from conftest import fast_loop

# Families whose shared expert's or dense layers' MLP PEFT's v4 -> v5 conversion of expert targets leaves without
# adapters (a gate_proj/up_proj/down_proj taken for a fused expert weight: huggingface/peft#3711); sft warns by name.
PEFT_MISSES = {"qwen3_next", "deepseek_v3"}
MAMBA_OUT_PROJ = {"falcon_h1", "nemotron_h"}  # PEFT refuses LoRA on their mixers' out_proj (peft's mamba check)


@pytest.mark.parametrize("arch, tie", fast_loop(CASES, {"qwen2-untied", "phi3-untied", "qwen3_next-tied",
                                                       "falcon_h1-untied", "gpt_oss-untied", "deepseek_v3-untied",
                                                       "mixtral-tied"}, IDS))
def test_lora_default_wraps_every_linear_layer_but_the_output_and_one_step_moves_only_adapters(arch, tie, caplog):
    from sft.config import ConfigError, compose
    from sft.model.lora import apply_lora

    model = tiny(arch, tie)
    linear = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    output = {name for name, m in model.named_modules() if m is model.get_output_embeddings()}
    experts = {name for name, m in model.named_modules() if name.endswith(".experts")}  # fused weights, no Linear
    overrides = ["lora=default", "lora.lora_dropout=0.05"]
    if experts:
        with pytest.raises(ConfigError, match="lora.lora_dropout=0.05: this model's fused expert weights"):
            apply_lora(tiny(arch, tie), compose("train", overrides).lora)
        overrides.append("lora.lora_dropout=0")
    with caplog.at_level("WARNING", logger="sft"):
        peft = apply_lora(model, compose("train", overrides).lora)
    wrapped = {name.removeprefix("base_model.model.") for name, m in peft.named_modules() if hasattr(m, "lora_A")}
    if arch in MAMBA_OUT_PROJ:  # what PEFT refuses there (fused kernels bypass it): named, and left out
        assert "lora=all-linear: PEFT adapts no out_proj of the Mamba-based" in caplog.text
        linear = {name for name in linear if not name.endswith(".out_proj")}
    if missed := sorted(linear - output - wrapped):  # PEFT's MoE conversion (peft#3711): said, by name, not silent
        assert arch in PEFT_MISSES and all(name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")
                                           for name in missed)
        assert f"adapts no {len(missed)} linear layer(s) of {type(model).__name__}: {missed[0]}" in caplog.text
    assert linear - output - set(missed) <= wrapped and not wrapped & output  # Phi-3's qkv_proj too; never lm_head
    if experts:
        assert experts <= wrapped  # the experts' fused weights, through PEFT's parameter wrappers
    else:
        assert wrapped == linear - output - set(missed)
    before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    ids, mask, labels = batch()
    peft(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    torch.optim.SGD([p for p in peft.parameters() if p.requires_grad], lr=0.1).step()
    moved = {n for n, p in peft.named_parameters() if not torch.equal(p, before[n])}
    assert any("lora_B" in n for n in moved) and all("lora_" in n for n in moved)


def test_lora_targets_that_name_no_linear_layer_are_refused_naming_the_models():
    from sft.config import ConfigError
    from sft.model.lora import check_lora_targets

    with pytest.raises(ConfigError, match=r"lora.target_modules=\['q_proj', 'o_proj'\]: q_proj name no linear "
                                          r"layer of Phi3ForCausalLM; its linear layers: down_proj, gate_up_proj, "
                                          r"lm_head, o_proj, qkv_proj"):
        check_lora_targets(tiny("phi3", tie=False), ["q_proj", "o_proj"])
