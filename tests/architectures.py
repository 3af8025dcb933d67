"""Tiny random-init models of the architectures users bring (one line of ARCHITECTURES each: the 2024-25 families, the
hybrids of 2026 whose layers are not all attention, and gpt-oss's and DeepSeek-V3's attention), and a batch to run
them on."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sft.model.packing import keep_samples_apart

SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)


ARCHITECTURES = {  # model_type -> what its config needs beyond SHAPE (transforms set where the family has one)
    "llama": {},
    "mistral": {"sliding_window": 4},  # windows shorter than the samples: packing must keep them
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma2": {"final_logit_softcapping": 5.0, "sliding_window": 4},
    "gemma3_text": {"final_logit_softcapping": 5.0, "sliding_window": 4},
    "phi3": {},
    "granite": {"logits_scaling": 4.0},
    "cohere": {"logit_scale": 0.5},
    "olmo2": {},
}


HYBRID = {  # hybrids of 2026: a layer that carries state along the sequence, then an attention layer
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 4,
                     "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
    "lfm2": {"layer_types": ["conv", "full_attention"], "block_ff_dim": 64, "conv_L_cache": 3},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 16,
                         "mamba_d_state": 8, "mamba_chunk_size": 8, "num_local_experts": 0,
                         "shared_intermediate_size": 64},
    "falcon_h1": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 8, "mamba_chunk_size": 8},
    "nemotron_h": {"hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
                   "n_groups": 1, "chunk_size": 8},
}
ATTENTION_2026 = {
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 8, "head_dim": 4, "n_group": 1, "topk_group": 1,
                    "num_key_value_heads": 4},
}
MORE_HYBRIDS = {  # checked for packing only: a step on packed rows is the padded rows' step
    "jamba": {"num_experts": 2, "num_experts_per_tok": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 8},
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
              "mamba_n_groups": 1, "mamba_chunk_size": 8},
    "olmo_hybrid": {},
    "minimax": {"num_local_experts": 2, "num_experts_per_tok": 1, "layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {},
}
ARCHITECTURES.update(HYBRID)
ARCHITECTURES.update(ATTENTION_2026)


CASES = [(arch, tie) for arch in ARCHITECTURES for tie in (False, True)]


IDS = [f"{arch}-{'tied' if tie else 'untied'}" for arch, tie in CASES]


def tiny(model_type: str, tie: bool, attn: str = "eager", **config_fields):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SHAPE, **{**ARCHITECTURES, **MORE_HYBRIDS}[model_type],
                                                 **config_fields},
                                  tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    keep_samples_apart(model)  # as sft.model.loading.load_model gives every model it loads
    if not tie:  # logits in the range where a softcap or a scale matters, as a trained model's are
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(30.0)
    return model


def batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 14))
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt
    labels[1, 11:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    return ids, mask, labels


MOE = ["qwen3_moe", "mixtral", "qwen3_next", "gpt_oss", "deepseek_v3"]  # fused experts: LoRA through parameter wrappers
ROUTER_AUX = ["qwen3_moe", "mixtral", "qwen3_next", "gpt_oss"]  # a load-balancing loss with output_router_logits
# (DeepSeek-V3 balances its experts without one: a bias on the router's scores)

# The decoder layers with a dense MLP that model.tiled_mlp_tokens tiles (sft.model.tiling), where not every layer:
# a mixture of experts' block is none (DeepSeek-V3's first layer is dense), nor Nemotron-H's mamba and attention layers.
DENSE_MLPS = {"qwen3_moe": 0, "mixtral": 0, "qwen3_next": 0, "gpt_oss": 0, "nemotron_h": 0, "deepseek_v3": 1}

NO_SDPA = {"gemma2", "gpt_oss"}  # transformers runs them with eager attention only (softcapping; attention sinks)
# Packing under eager attention that transformers' mask leaves unseparated: refused by the probe (sft.model.packing)
EAGER_PACKING_REFUSED = {"gpt_oss", "granitemoehybrid"}
