"""The causal LMs users bring, each as a tiny random-init model built from its transformers config:
the training loss equals the model's own loss (values and gradients, every `loss.impl`), and packed rows
give each sample the logits it gets alone under transformers' own (eager) attention, sliding windows
shorter than the samples included. A new family is one line of ARCHITECTURES.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

from sft.model.attention import register as register_sdpa_varlen
from sft.loss.builtin import CrossEntropyLoss
from sft.training.trainer import WeightedLossTrainer

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


@pytest.mark.parametrize("arch, tie", CASES, ids=IDS)
@pytest.mark.parametrize("impl", ["naive", "chunked", "auto"])
def test_the_training_loss_is_the_models_own_loss(tmp_path, arch, tie, impl):
    model = tiny(arch, tie)
    ids, mask, labels = batch()
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    params = [p for p in model.parameters() if p.requires_grad]
    own_grads = torch.autograd.grad(own.loss, params)

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = WeightedLossTrainer(model=model, args=args, loss=CrossEntropyLoss(impl=impl, chunk_tokens=7))
    assert trainer.loss_impl == ("naive" if impl == "naive" else "chunked")  # auto: chunked on CPU, nothing refused
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "loss_weights": (labels != -100).float()}
    ours = trainer.compute_loss(model, dict(inputs), num_items_in_batch=(labels[:, 1:] != -100).sum().double())
    assert ours.item() == pytest.approx(own.loss.item(), rel=1e-5)
    for p, a, b in zip(params, own_grads, torch.autograd.grad(ours, params)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch, tie", CASES, ids=IDS)
def test_lora_default_wraps_every_linear_layer_but_the_output_and_one_step_moves_only_adapters(arch, tie):
    from sft.config import ConfigError, compose
    from sft.train import apply_lora

    model = tiny(arch, tie)
    linear = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    output = {name for name, m in model.named_modules() if m is model.get_output_embeddings()}
    experts = {name for name, m in model.named_modules() if name.endswith(".experts")}  # fused weights, no Linear
    overrides = ["lora=default"]
    if experts:
        with pytest.raises(ConfigError, match="lora.lora_dropout=0.05: this model's fused expert weights"):
            apply_lora(tiny(arch, tie), compose("train", overrides).lora)
        overrides.append("lora.lora_dropout=0")
    peft = apply_lora(model, compose("train", overrides).lora)
    wrapped = {name.removeprefix("base_model.model.") for name, m in peft.named_modules() if hasattr(m, "lora_A")}
    assert linear - output <= wrapped and not wrapped & output  # Phi-3's qkv_proj too; never the lm_head
    if experts:
        assert experts <= wrapped  # the experts' fused weights, through PEFT's parameter wrappers
    else:
        assert wrapped == linear - output
    before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    ids, mask, labels = batch()
    peft(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    torch.optim.SGD([p for p in peft.parameters() if p.requires_grad], lr=0.1).step()
    moved = {n for n, p in peft.named_parameters() if not torch.equal(p, before[n])}
    assert any("lora_B" in n for n in moved) and all("lora_" in n for n in moved)


def test_lora_targets_that_name_no_linear_layer_are_refused_naming_the_models():
    from sft.config import ConfigError
    from sft.train import check_lora_targets

    with pytest.raises(ConfigError, match=r"lora.target_modules=\['q_proj', 'o_proj'\]: q_proj name no linear "
                                          r"layer of Phi3ForCausalLM; its linear layers: down_proj, gate_up_proj, "
                                          r"lm_head, o_proj, qkv_proj"):
        check_lora_targets(tiny("phi3", tie=False), ["q_proj", "o_proj"])


NO_SDPA = {"gemma2"}  # transformers runs it with eager attention only (attention softcapping)


@pytest.mark.parametrize("arch, attn", [(a, attn) for a in sorted(ARCHITECTURES) for attn in ("eager", "sdpa_varlen")
                                        if not (attn == "sdpa_varlen" and a in NO_SDPA)])
def test_each_sample_of_a_packed_row_gets_its_logits_alone(arch, attn):
    from sft.data.collator import WeightedDataCollator

    register_sdpa_varlen()
    model = tiny(arch, tie=False, attn=attn).eval()
    reference = tiny(arch, tie=False, attn="eager").eval()  # the same weights; transformers' own masks
    torch.manual_seed(2)
    samples = [torch.randint(3, 128, (n,)).tolist() for n in (9, 6, 11)]
    feats = [{"input_ids": s, "labels": s, "loss_weight": 1.0, "source_line": i} for i, s in enumerate(samples)]
    packed = WeightedDataCollator(tokenizer=None, packing=True)(feats)
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    with torch.no_grad():
        logits = model(**{k: packed[k] for k in keys}, use_cache=False).logits[0]
        alone = [reference(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]
        unpacked = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]
    torch.testing.assert_close(logits, torch.cat(alone), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(unpacked), torch.cat(alone), atol=1e-4, rtol=1e-4)


MOE = ["qwen3_moe", "mixtral"]


def router_weights(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]


@pytest.mark.parametrize("arch", MOE)
def test_the_router_aux_loss_is_added_as_the_models_own_loss_adds_it_and_trains_the_router(tmp_path, arch):
    from sft.training.trainer import input_tokens

    model = tiny(arch, tie=False, output_router_logits=True, router_aux_loss_coef=0.5)
    ids, mask, labels = batch()
    own = model(input_ids=ids, attention_mask=mask, labels=labels)  # ce + coef * aux, as the model adds it
    params = [p for p in model.parameters() if p.requires_grad]
    own_grads = torch.autograd.grad(own.loss, params)

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = WeightedLossTrainer(model=model, args=args, loss=CrossEntropyLoss(impl="chunked"))
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "loss_weights": (labels != -100).float()}
    trainer._step_tokens = input_tokens(inputs)
    ours = trainer.compute_loss(model, dict(inputs), num_items_in_batch=(labels[:, 1:] != -100).sum().double())
    assert ours.item() == pytest.approx(own.loss.item(), rel=1e-5)
    ours_grads = torch.autograd.grad(ours, params)
    for a, b in zip(own_grads, ours_grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)

    aux_grads = torch.autograd.grad(model(input_ids=ids, attention_mask=mask).aux_loss, router_weights(model))
    assert all(g.abs().sum() > 0 for g in aux_grads)  # the load-balancing loss reaches every router
    model.config.output_router_logits = False
    trainer = WeightedLossTrainer(model=model, args=args, loss=CrossEntropyLoss(impl="chunked"))
    ce_only = trainer.compute_loss(model, dict(inputs), num_items_in_batch=(labels[:, 1:] != -100).sum().double())
    ce_grads = torch.autograd.grad(ce_only, router_weights(model))
    with_aux = [g for p, g in zip(params, ours_grads) if any(p is r for r in router_weights(model))]
    for total, ce, aux in zip(with_aux, ce_grads, aux_grads):
        torch.testing.assert_close(total - ce, 0.5 * aux, atol=1e-6, rtol=1e-4)


def test_under_accumulation_the_router_aux_loss_is_the_steps_token_weighted_mean_and_is_logged(tmp_path, tokenizer):
    """A step of the same micro-batch twice is that micro-batch's step: the stock objective would count
    the aux loss twice (each micro-batch's model loss carries it in full)."""
    from conftest import ROWS, train_steps

    def moe():
        return tiny("qwen3_moe", tie=True, vocab_size=768, output_router_logits=True, router_aux_loss_coef=0.5)

    row = ROWS[1]
    once = train_steps(tmp_path / "once", tokenizer, CrossEntropyLoss(), 1, 1, rows=[row], steps=1, model=moe())
    twice = train_steps(tmp_path / "twice", tokenizer, CrossEntropyLoss(), 1, 2, rows=[row, row], steps=1,
                        model=moe())
    torch.testing.assert_close(twice[1], once[1], atol=1e-6, rtol=1e-5)
    logged = [e["aux_loss"] for e in once[2].state.log_history if "aux_loss" in e]
    assert logged == [pytest.approx(e["aux_loss"]) for e in twice[2].state.log_history if "aux_loss" in e]
    assert len(logged) == 1 and logged[0] >= 1.0  # num_experts * sum(f_i * P_i) >= 1, 1 when balanced


def test_a_config_override_the_model_does_not_have_is_refused():
    from sft.config import ConfigError
    from sft.model.loading import load_model

    with pytest.raises(ConfigError, match="model.config_overrides.output_router_logits=True: Qwen2Config has no "
                                          "field 'output_router_logits'"):
        load_model("tiny", config_overrides={"output_router_logits": True})
    with pytest.raises(ConfigError, match=r"model.config_overrides=\{'intermediate_size': 96\}: changes the shape of "
                                          "tiny's weights, which then cannot load"):
        load_model("tiny", config_overrides={"intermediate_size": 96})


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_sft_merge_gives_the_logits_of_base_plus_adapter(tmp_path, arch, tokenizer):
    from sft.config import compose
    from sft.model.merge import merge
    from sft.train import apply_lora

    tiny(arch, tie=False).save_pretrained(tmp_path / "base")
    overrides = ["lora=default"] + (["lora.lora_dropout=0"] if arch in MOE else [])
    peft = apply_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager"),
                      compose("train", overrides).lora)
    with torch.no_grad():  # lora_B starts at zero: give the adapter something to merge
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    merge(str(tmp_path / "adapter"), str(tmp_path / "merged"), base=str(tmp_path / "base"), dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        expected = peft.eval()(input_ids=ids, attention_mask=mask).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
        assert not torch.allclose(base(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-3)
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-4, rtol=1e-4)


def test_an_attention_the_architecture_lacks_is_a_config_error_naming_the_alternative(tmp_path):
    from sft.config import ConfigError
    from sft.model.loading import load_model

    tiny("gemma2", tie=False).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"model.attn_implementation='sdpa': Gemma2ForCausalLM does not support an "
                                          r"attention implementation .* use eager"):
        load_model(str(tmp_path), attn_implementation="sdpa")
