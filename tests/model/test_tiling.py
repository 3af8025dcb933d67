"""Tiled MLPs for long rows (`model.tiled_mlp_tokens`, `sft.model.tiling`): the untiled model's losses and
gradients, the forward's dropout masks in the backward; refused where they cannot work. A run with them, and with
offloaded checkpoints: tests/e2e/test_long_rows.py."""

import pytest
import torch
from architectures import ARCHITECTURES
from conftest import composed

from sft.config import ConfigError, check
from sft.model.loading import load_model

def loss_and_grads(model, ids: torch.Tensor) -> tuple[float, dict]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora, checkpointing", [(False, False), (True, False), (True, True)])
def test_a_tiled_mlp_gives_the_untiled_loss_and_gradients(lora, checkpointing):
    ids = torch.randint(5, 300, (2, 70), generator=torch.Generator().manual_seed(0))
    results = []
    for tokens in (None, 16):  # 70 tokens: 5 tiles, the last one short
        model = load_model("tiny", tiled_mlp_tokens=tokens)
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(0)
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        results.append(loss_and_grads(model, ids))
    (loss, grads), (tiled_loss, tiled_grads) = results
    # a mean of 140 fp32 terms, summed in another order by the tiles and by torch's threads: a few ulps apart
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == tiled_grads.keys() and any("mlp" in name for name in grads)
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_dropout_in_a_tiled_mlp_has_the_forwards_masks_in_the_backward():
    # The backward recomputes each tile: with the forward's random numbers, or LoRA's dropout would train gradients
    # of masks the loss never saw. The reference: the same tiles computed once, kept for autograd (no recompute).
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(5, 300, (3, 40), generator=torch.Generator().manual_seed(0))  # 120 tokens: 8 tiles of 15
    results = []
    for tokens in (None, 16):
        model = load_model("tiny", tiled_mlp_tokens=tokens)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.3,
                                                 init_lora_weights=False)).train()
        if tokens is None:
            for layer in model.base_model.model.model.layers:
                layer.mlp.forward = lambda h, f=layer.mlp.forward: torch.cat(
                    [f(tile) for tile in torch.chunk(h.reshape(-1, h.shape[-1]), 8)]).view_as(h)
        torch.manual_seed(1)
        results.append(loss_and_grads(model, ids))
        results[-1] += (torch.rand(1).item(),)  # the RNG after the step: the recompute leaves it as it found it
    (loss, grads, after), (tiled_loss, tiled_grads, tiled_after) = results
    assert tiled_loss == pytest.approx(loss, rel=1e-6) and tiled_after == after
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_the_tiles_run_in_the_forward_and_again_in_the_backward(monkeypatch):
    # what makes it save memory: no tile's activations kept from the forward, each recomputed in the backward
    model = load_model("tiny", tiled_mlp_tokens=16).train()
    mlp = model.model.layers[0].mlp
    calls = []
    monkeypatch.setattr(mlp.gate_proj, "forward", lambda x, real=mlp.gate_proj.forward: (calls.append(
        (x.shape[-2], torch.is_grad_enabled())), real(x))[1])
    loss_and_grads(model, torch.randint(5, 300, (1, 40)))
    # 40 tokens in tiles of at most 16: 3 tiles, as even as torch.chunk makes them
    assert calls == [(14, False), (14, False), (12, False), (14, True), (14, True), (12, True)]
    with torch.no_grad():  # evaluation: untiled
        calls.clear()
        model(input_ids=torch.randint(5, 300, (1, 40)))
    assert calls == [(40, False)]


def test_a_model_with_no_dense_mlp_is_refused_by_name():
    config = {"model_type": "mixtral", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4}
    with pytest.raises(ConfigError) as e:
        load_model("tiny", random_init=config, tiled_mlp_tokens=16)
    assert e.value.key == "model.tiled_mlp_tokens" and "MixtralForCausalLM has no dense MLP" in str(e.value)


@pytest.mark.parametrize("overrides, key, words", [
    (["model.tiled_mlp_tokens=0"], "model.tiled_mlp_tokens", "must be >= 1"),
    (["model.tiled_mlp_tokens=64", "fsdp=full_shard"], "model.tiled_mlp_tokens", "not supported under FSDP2"),
    (["model.tiled_mlp_tokens=64", "deepspeed=zero3"], "model.tiled_mlp_tokens", "not supported under ZeRO-3"),
])
def test_tiling_where_it_cannot_work_is_one_config_error(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        check(composed(*overrides))
    assert e.value.key == key and words in str(e.value)


def test_tiled_mlp_with_several_processes_needs_deepspeed(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        check(composed("model.tiled_mlp_tokens=64"))
    assert "needs DeepSpeed" in str(e.value)
    check(composed("model.tiled_mlp_tokens=64", "deepspeed=zero2"))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_architectures_dense_mlps_are_tiled_with_the_models_own_loss_and_gradients(arch):
    # The rule is by name (a layer's `mlp` of a class named *MLP): every dense family's MLPs (Phi-3's fused
    # gate_up_proj, Gemma's GELU ones) tiled, no mixture of experts' block; the model's own loss, unchanged.
    from architectures import DENSE_MLPS, SHAPE, batch, tiny

    from sft.model.tiling import tile_mlps

    ids, mask, labels = batch()  # 2 rows of 14 tokens: 4 tiles of at most 8
    results = []
    for tokens in (None, 8):
        model = tiny(arch, tie=False).train()
        tiled = tile_mlps(model, tokens) if tokens else None
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert tiled == DENSE_MLPS.get(arch, SHAPE["num_hidden_layers"])
    (loss, grads), (tiled_loss, tiled_grads) = results
    # the tiles' sums in another order, through the layers after them: float32's rounding, relative to the loss (2e-7
    # measured on Gemma-2 with 2 threads, 0 with 1); 1e-5 leaves room for other thread counts and CPUs
    assert tiled_loss == pytest.approx(loss, rel=1e-5) and grads.keys() == tiled_grads.keys()
    for name in grads:  # gradients of up to ~6 here (the scaled output layer): float32's summation order, 1e-6
        torch.testing.assert_close(tiled_grads[name], grads[name], atol=1e-5, rtol=1e-5, msg=name)
