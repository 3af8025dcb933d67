"""bf16 on a CPU (`sft.training.processes.precision`): `trainer.bf16=true` trains under bf16 autocast on a CPU that has
bf16 instructions, with fp32 master weights and optimizer state, and its losses follow fp32's; a CPU without them is
refused in one line naming the knob."""

import pytest
import torch
from conftest import composed

from sft.config import ConfigError, check
from sft.training.processes import precision
from sft.training.processes.precision import bf16_flags, cpu_bf16_instructions

HAS_BF16 = cpu_bf16_instructions() is not None and not torch.cuda.is_available()


def test_the_bf16_flags_are_read_from_x86_and_arm_cpu_flags():
    assert bf16_flags("processor : 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile\n") == \
        "amx_bf16 avx512_bf16"
    assert bf16_flags("Features\t: fp asimd sve bf16 i8mm\n") == "bf16"
    assert bf16_flags("flags\t\t: fpu sse2 avx2 avx512f avx512bw\n") is None  # AVX-512 alone: emulated bf16


def test_a_cpu_without_bf16_instructions_is_refused_naming_the_knob(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU takes bf16 whatever the CPU")
    monkeypatch.setattr(precision, "cpu_bf16_instructions", lambda: None)
    with pytest.raises(ConfigError, match=r"^trainer\.bf16=True: bf16 mixed precision needs bf16 arithmetic, and "
                                          r"there is no GPU here and this CPU has no bf16 instructions .*"
                                          r"set trainer\.bf16=false$"):
        check(composed("trainer.bf16=true"))


@pytest.mark.slow  # two short runs
@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with bf16 instructions and no GPU")
def test_bf16_on_this_cpu_runs_the_products_in_bf16_over_fp32_master_weights(tmp_path):
    from sft.run.build import build

    shared = ["data.eval_file=null", "trainer.max_steps=3", "trainer.logging_steps=1", "trainer.save_strategy=no",
              "trainer.report_to=[]", "trainer.per_device_train_batch_size=8", "loss=ce"]
    losses = {}
    for name, extra in (("fp32", []), ("bf16", ["trainer.bf16=true"])):
        trainer = build(composed(*shared, *extra), str(tmp_path / name)).trainer
        products = []
        layer = trainer.model.model.layers[0].mlp.down_proj
        hook = layer.register_forward_hook(lambda module, args, out: products.append(out.dtype))
        trainer.train()
        hook.remove()
        losses[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        assert set(products) == {torch.bfloat16 if name == "bf16" else torch.float32}
        assert trainer.args.use_cpu == (name == "bf16")  # what transformers needs to take bf16 without a GPU
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights
        state = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    assert len(losses["bf16"]) == 3
    # bf16 products (8 bits of mantissa) over fp32 accumulation: the same losses to bf16's resolution
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
