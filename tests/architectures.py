"""Tiny random-init models of the architectures users bring (one line of ARCHITECTURES each), and a batch to run them
on."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

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


CASES = [(arch, tie) for arch in ARCHITECTURES for tie in (False, True)]


IDS = [f"{arch}-{'tied' if tie else 'untied'}" for arch, tie in CASES]


def tiny(model_type: str, tie: bool, attn: str = "eager", **config_fields):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SHAPE, **ARCHITECTURES[model_type], **config_fields},
                                  tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
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


MOE = ["qwen3_moe", "mixtral"]
