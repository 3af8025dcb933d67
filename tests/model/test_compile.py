"""Regional compilation (`sft.model.compile`): each family of `COMPILE_CHECKED` gives, with its decoder layers
compiled, the logits and the gradients of its eager layers (padded rows, under sdpa); a run with them compiled
trains to the eager run's losses (packed rows, LoRA); a family not checked is refused in one line."""

import pytest
import torch
from architectures import batch, tiny
from conftest import composed

from sft.config import ConfigError
from sft.model.compile import COMPILE_CHECKED, compile_layers



def logits_and_gradients(model):
    ids, mask, labels = batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.slow  # a compile: 4-13 s of this CPU a family
@pytest.mark.parametrize("model_type", COMPILE_CHECKED)
def test_compiled_layers_give_the_eager_layers_logits_and_gradients(model_type):
    torch._dynamo.reset()
    eager_logits, eager_grads = logits_and_gradients(tiny(model_type, tie=False, attn="sdpa"))
    model = tiny(model_type, tie=False, attn="sdpa")
    assert compile_layers(model) == model.config.num_hidden_layers
    logits, grads = logits_and_gradients(model)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def trained(tmp_path, name, *overrides):
    from sft.run.build import build

    trainer = build(composed("data.eval_file=null", "trainer.max_steps=3", "trainer.logging_steps=1",
                             "trainer.report_to=[]", "trainer.save_strategy=no", "data.packing=true", "lora=default",
                             *overrides), str(tmp_path / name)).trainer
    trainer.train()
    return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_a_run_with_compiled_layers_trains_to_the_eager_runs_losses_packed_with_lora(tmp_path):
    torch._dynamo.reset()
    compiled, losses = trained(tmp_path, "compiled", "trainer.compile_layers=true")
    assert all(hasattr(layer, "_compiled_call_impl") and layer._compiled_call_impl is not None
               for layer in compiled.model.get_base_model().get_decoder().layers)
    _, expected = trained(tmp_path, "eager")
    assert losses == pytest.approx(expected, rel=1e-5)


def test_a_family_whose_compiled_layers_are_not_checked_is_refused_in_one_line(tmp_path):
    from sft.run.build import build

    with pytest.raises(ConfigError, match=r"trainer.compile_layers=True: phi3's compiled layers are not checked "):
        build(composed("trainer.compile_layers=true", "+model.random_init={model_type: phi3, hidden_size: 64, "
                       "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
                       "num_key_value_heads: 2}"), str(tmp_path))
