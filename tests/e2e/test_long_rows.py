"""A run with offloaded activation checkpoints (`trainer.activation_offloading`) and one with tiled MLPs
(`model.tiled_mlp_tokens`) train the plain checkpointed run's step losses (docs/long_context.md)."""

import pytest
from conftest import run_patched, run_train, step_losses

QUICK = ["trainer.max_steps=3", "trainer.logging_steps=1", "trainer.save_steps=3", "trainer.eval_strategy=no",
         "trainer.train_sampling_strategy=sequential", "trainer.report_to=[]", "data.max_length=96"]


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
