"""Memory for long rows (issue 30): tiled MLPs (`model.tiled_mlp_tokens`, DeepSpeed ALST's TiledMLP) and offloaded
activation checkpoints (`trainer.activation_offloading`, transformers' offload) train exactly as the plain path."""

import pytest
import torch
from conftest import composed, run_patched, run_train, step_losses

from sft.config import ConfigError, check
from sft.model.loading import load_model

QUICK = ["trainer.max_steps=3", "trainer.logging_steps=1", "trainer.save_steps=3", "trainer.eval_strategy=no",
         "trainer.train_sampling_strategy=sequential", "trainer.report_to=[]", "data.max_length=96"]


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
    assert tiled_loss == pytest.approx(loss, abs=1e-6)
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
    assert tiled_loss == pytest.approx(loss, abs=1e-6) and tiled_after == after
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
    (["trainer.activation_offloading=true"], "trainer.activation_offloading", "activation_checkpointing=true too"),
    (["trainer.activation_offloading=true", "trainer.activation_checkpointing=true"], "trainer.activation_offloading",
     "on a CPU they are in host memory already"),
])
def test_settings_that_cannot_work_are_one_config_error(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        check(composed(*overrides))
    assert e.value.key == key and words in str(e.value)


def test_tiled_mlp_with_several_processes_needs_deepspeed(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        check(composed("model.tiled_mlp_tokens=64"))
    assert "needs DeepSpeed" in str(e.value)
    check(composed("model.tiled_mlp_tokens=64", "deepspeed=zero2"))


# On a GPU transformers pins the offloaded activations; this machine has nothing to pin with, so the run's copy to
# host memory is made unpinned, and the GPU check is passed as on a GPU. Each offloaded checkpoint is counted.
OFFLOAD_ON_A_CPU = """
import os, torch, transformers.modeling_utils as modeling, sft.training.arguments as arguments
arguments.cuda_available = lambda: True
real = torch.autograd.graph.save_on_cpu
def on_host(pin_memory, device_type):
    assert pin_memory
    with open(os.environ["OFFLOADS"], "a") as f:
        f.write("x")
    return real(pin_memory=False, device_type=device_type)
modeling.save_on_cpu = on_host
"""


@pytest.mark.slow
def test_offloaded_checkpoints_and_tiled_mlps_train_the_plain_runs_losses(tmp_path, monkeypatch):
    plain, offloaded, tiled = tmp_path / "plain", tmp_path / "offloaded", tmp_path / "tiled"
    # SGD: the tiles sum a gradient in another order (1e-7 apart), which Adam's first steps would magnify; no dropout:
    # tiles draw their masks tile by tile (test_dropout_in_a_tiled_mlp_...)
    checkpointing = [*QUICK, "lora=default", "lora.lora_dropout=0", "trainer.activation_checkpointing=true",
                     "trainer.optim=sgd",
                     "trainer.learning_rate=0.5", "trainer.lr_scheduler_type=constant", "trainer.warmup_steps=0"]
    assert run_train(*checkpointing, f"hydra.run.dir={plain}").returncode == 0
    monkeypatch.setenv("OFFLOADS", str(tmp_path / "offloads"))
    proc = run_patched(OFFLOAD_ON_A_CPU, *checkpointing, "trainer.activation_offloading=true",
                       f"hydra.run.dir={offloaded}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train(*checkpointing, "model.tiled_mlp_tokens=32", f"hydra.run.dir={tiled}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 MLPs tiled" in (tiled / "train.log").read_text()
    # every decoder layer's checkpoint, in each of the 3 steps (and no evaluation: under no_grad none is saved)
    assert len((tmp_path / "offloads").read_text()) == 4 * 3
    assert step_losses(offloaded, 3) == pytest.approx(step_losses(plain, 3), abs=1e-6)
    assert step_losses(tiled, 3) == pytest.approx(step_losses(plain, 3), abs=1e-5)
