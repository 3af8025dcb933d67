"""What a model does to its logits and losses beyond the projection (`sft.loss.logits`): softcapping, scales, the
router aux loss of a mixture of experts."""

import pytest
import torch
from architectures import CASES, IDS, ROUTER_AUX, batch, tiny
from transformers import TrainingArguments

from sft.loss.builtin import CrossEntropyLoss
from sft.training.trainer import WeightedLossTrainer


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
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "weights": (labels != -100).float()}
    ours = trainer.compute_loss(model, dict(inputs), num_items_in_batch=(labels[:, 1:] != -100).sum().double())
    assert ours.item() == pytest.approx(own.loss.item(), rel=1e-5)
    for p, a, b in zip(params, own_grads, torch.autograd.grad(ours, params)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def router_weights(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if name.endswith(("mlp.gate.weight", "mlp.router.weight"))]


@pytest.mark.parametrize("arch", ROUTER_AUX)
def test_the_router_aux_loss_is_added_as_the_models_own_loss_adds_it_and_trains_the_router(tmp_path, arch):
    from sft.data.tokens.batch import input_tokens

    model = tiny(arch, tie=False, output_router_logits=True, router_aux_loss_coef=0.5)
    ids, mask, labels = batch()
    own = model(input_ids=ids, attention_mask=mask, labels=labels)  # ce + coef * aux, as the model adds it
    params = [p for p in model.parameters() if p.requires_grad]
    own_grads = torch.autograd.grad(own.loss, params)

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = WeightedLossTrainer(model=model, args=args, loss=CrossEntropyLoss(impl="chunked"))
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "weights": (labels != -100).float()}
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


# Families whose forward transforms the projected logits (Gemma-2/3 softcapping, Cohere's logit_scale,
# Granite's logits_scaling) and one that does not; the lm_head is scaled up so that the logits reach the
# softcap's range, as a trained model's do.
TRANSFORMS = {"gemma2": {"final_logit_softcapping": 5.0}, "cohere": {"logit_scale": 0.5},
              "granite": {"logits_scaling": 4.0}, "qwen2": {}}


@pytest.mark.parametrize("model_type", sorted(TRANSFORMS))
def test_the_lean_loss_applies_the_models_own_logit_transform(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft.loss.logits import LogitTransform

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                  **TRANSFORMS[model_type])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100.0)
    ids = torch.randint(0, 97, (2, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    own = model(input_ids=ids, labels=labels)
    own_grads = torch.autograd.grad(own.loss, [model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight])

    transform = LogitTransform.of(model.config)
    assert transform != LogitTransform() or model_type == "qwen2"
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    projected = hidden @ model.lm_head.weight.T
    assert projected.abs().max() > 10, "the logits never reach a softcap's range: the test would not see it"
    terms = CrossEntropyLoss(chunk_tokens=5).terms(labels, (labels != -100).float(), hidden=hidden,
                                                   lm_head=model.lm_head.weight, impl="chunked", transform=transform)
    ours = terms.loss_sum / terms.denominator.sum()
    assert ours.item() == pytest.approx(own.loss.item(), rel=1e-5)
    for a, b in zip(own_grads, torch.autograd.grad(ours, [model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight])):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    if model_type != "qwen2":  # without the transform the lean loss would be another loss
        plain = CrossEntropyLoss().terms(labels, (labels != -100).float(), hidden=hidden.detach(),
                                         lm_head=model.lm_head.weight.detach(), impl="chunked")
        assert abs((plain.loss_sum / plain.denominator.sum()).item() - own.loss.item()) > 1e-2
