"""Muon with AdamW (`sft.training.step.muon`): the layers' matrices go to PyTorch's Muon and the rest to AdamW, the two
stepping as PyTorch's own optimizers step them, through a save and a load of the state; `trainer.optim=muon` trains
and resumes as if uninterrupted; the engines Muon cannot run under are refused naming the field."""

import pytest
import torch
from conftest import composed, run_train, step_losses
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from sft.config.schema import ConfigError
from sft.config.validate import check
from sft.model.loading import load_model
from sft.training.step.muon import MuonWithAdamW


def muon_of(model, tmp_path) -> MuonWithAdamW:
    """The optimizer WeightedLossTrainer.create_optimizer makes of `model` under trainer.optim=muon."""
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.8,
                             adam_beta2=0.95, adam_epsilon=1e-6, use_cpu=True, report_to=[])
    return MuonWithAdamW.of(model, args, Trainer(model=model, args=args).get_decay_parameter_names(model))


def test_the_layers_matrices_go_to_muon_and_embeddings_output_norms_and_biases_to_adamw(tmp_path):
    model = load_model("tiny")
    optimizer = muon_of(model, tmp_path)
    names = {id(p): name for name, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in optimizer.muon.param_groups for p in g["params"])
    adamw = [sorted(names[id(p)] for p in g["params"]) for g in optimizer.adamw.param_groups]
    assert muon and all(name.endswith(("proj.weight",)) for name in muon)
    assert len(muon) == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down
    decayed, undecayed = adamw
    assert "model.embed_tokens.weight" in decayed
    assert all(name.endswith(("norm.weight", "bias")) for name in undecayed) and undecayed
    assert optimizer.adamw.param_groups[1]["weight_decay"] == 0.0
    assert len(optimizer.param_groups) == 3  # one list for the schedule: Muon's group, AdamW's two


def test_it_steps_as_pytorchs_muon_and_adamw_do_through_a_save_and_a_load(tmp_path):
    torch.manual_seed(0)
    ours_model, theirs_model = load_model("tiny"), load_model("tiny")
    ours = muon_of(ours_model, tmp_path)
    by_id = dict(zip(map(id, ours_model.parameters()), theirs_model.parameters()))
    muon = torch.optim.Muon([by_id[id(p)] for p in ours.muon.param_groups[0]["params"]], lr=1e-2, weight_decay=0.1,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in ours.adamw.param_groups],
                              lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for step in range(4):
        gradients = [torch.randn_like(p) for p in ours_model.parameters()]
        for model, grads in ((ours_model, gradients), (theirs_model, gradients)):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
        ours.step()
        muon.step()
        adamw.step()
        if step == 1:  # a checkpoint and a resume: a fresh optimizer given the saved state
            saved = ours.state_dict()
            ours = muon_of(ours_model, tmp_path)
            ours.load_state_dict(saved)
    for mine, theirs in zip(ours_model.parameters(), theirs_model.parameters()):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.optim=muon", "deepspeed=zero2"], "trainer.optim='muon': DeepSpeed builds and shards its own optimizer"),
    (["trainer.optim=muon", "fsdp=full_shard"], "trainer.optim='muon': FSDP2 shards each matrix over the ranks"),
])
def test_muon_under_an_engine_that_shards_its_matrices_is_refused(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check(composed(*overrides))


@pytest.mark.slow  # two short runs
def test_a_muon_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(tmp_path):
    common = ["trainer.optim=muon", "trainer.max_steps=4", "trainer.save_steps=2", "trainer.logging_steps=1",
              "trainer.eval_steps=100", "trainer.save_total_limit=5", "trainer.warmup_steps=0"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_train(*common, f"hydra.run.dir={whole}").returncode == 0
    second = run_train(*common, f"resume={whole / 'checkpoint-2'}", f"hydra.run.dir={resumed}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert step_losses(resumed, 4)[2:] == pytest.approx(step_losses(whole, 4)[2:], abs=1e-6)
    a, b = load_file(whole / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0, msg=key)
