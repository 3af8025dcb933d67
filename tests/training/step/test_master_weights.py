"""fp32 master weights for a bf16 model (`sft.training.step.master_weights`, `trainer.precision=pure`): updates below
bf16's resolution accumulate and show, gradient accumulation sums in fp32, a saved optimizer brings the fp32 values
back; and a training run on it follows bf16 autocast's losses and resumes exactly."""

import pytest
import torch
from conftest import composed, run_train, step_losses

from sft.config import ConfigError, check
from sft.training.processes.precision import cpu_bf16_instructions
from sft.training.step.master_weights import STATE_KEY, MasterWeights

HAS_BF16 = cpu_bf16_instructions() is not None and not torch.cuda.is_available()

WEIGHT = 0.03  # bf16 holds 0.03 as 0.030029296875, its neighbours 1.2e-4 away
STEP = 2e-5  # each SGD update: a sixth of that spacing


def constant_gradient_step(weight: torch.nn.Parameter, optimizer) -> None:
    (weight * torch.ones_like(weight)).sum().backward()  # d/dw = 1 for every element
    optimizer.step()
    optimizer.zero_grad()


def test_updates_below_bf16_resolution_accumulate_in_the_fp32_copy_and_show_in_the_weight():
    plain = torch.nn.Parameter(torch.full((4,), WEIGHT, dtype=torch.bfloat16))
    sgd = torch.optim.SGD([plain], lr=STEP)
    weight = torch.nn.Parameter(torch.full((4,), WEIGHT, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([weight], lr=STEP)
    master = MasterWeights.attach(optimizer)
    reference = torch.full((4,), WEIGHT, dtype=torch.bfloat16).float()  # fp32 SGD from the same start
    for _ in range(10):
        constant_gradient_step(plain, sgd)
        constant_gradient_step(weight, optimizer)
        reference -= STEP
        assert torch.equal(master.pairs[0][1], reference)
        assert torch.equal(weight.detach(), reference.bfloat16())  # the fp32 value, rounded to nearest
    assert torch.equal(plain.detach(), torch.full((4,), WEIGHT, dtype=torch.bfloat16))  # bf16 SGD never moved
    assert weight[0] < plain[0]  # 2e-4 down: the weight moved by one bf16 step


def test_gradient_accumulation_sums_the_micro_batches_in_fp32():
    weight = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    master = MasterWeights.attach(optimizer)
    for scale in (1.0, 2.0**-9):  # bf16 has 8 bits of mantissa: 1 + 2**-9 is 1 there
        (weight * scale).sum().backward()
        assert weight.grad is None  # handed over at once
    copy = master.pairs[0][1]
    assert torch.equal(copy.grad, torch.full((2,), 1 + 2.0**-9))
    assert master.holding_gradients([weight]) == [copy] and master.trained() == [copy]


def test_a_saved_optimizer_brings_back_the_fp32_values_not_the_bf16_weights():
    def run(steps: int, state=None):
        weight = torch.nn.Parameter(torch.full((3,), WEIGHT, dtype=torch.bfloat16))
        optimizer = torch.optim.AdamW([weight], lr=STEP, weight_decay=0.0)
        master = MasterWeights.attach(optimizer)
        if state is not None:
            weight.data.copy_(state["weight"])  # the checkpoint's model: bf16
            optimizer.load_state_dict(state["optimizer"])
        for _ in range(steps):
            constant_gradient_step(weight, optimizer)
        return {"weight": weight.detach().clone(), "optimizer": optimizer.state_dict(), "copy": master.pairs[0][1]}

    straight = run(8)
    first = run(4)
    saved = torch.load(_saved(first), weights_only=True)
    resumed = run(4, saved)
    assert torch.equal(resumed["copy"], straight["copy"])
    assert torch.equal(resumed["weight"], straight["weight"])
    assert not torch.equal(first["copy"], first["weight"].float())  # the fp32 value was not the weight's


def _saved(result) -> "io.BytesIO":
    import io

    buffer = io.BytesIO()
    torch.save({"weight": result["weight"], "optimizer": result["optimizer"]}, buffer)
    buffer.seek(0)
    return buffer


def test_the_copies_start_from_the_fp32_weights_unless_a_checkpoint_set_the_parameter_since():
    from sft.training.step.master_weights import hold_linear_weights_in_bf16

    def model_and_optimizer(loaded=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        fp32 = model[0].weight.detach().clone()
        assert hold_linear_weights_in_bf16(model) == 4 * 4 + 4 + 4 * 2 + 2
        if loaded is not None:
            model[0].weight.data.copy_(loaded)  # what Trainer does with a checkpoint's weights
        master = MasterWeights.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        return fp32, master.holding_gradients([model[0].weight])[0]

    fp32, copy = model_and_optimizer()
    assert torch.equal(copy, fp32) and not torch.equal(copy, fp32.bfloat16().float())  # not the rounded value
    _, copy = model_and_optimizer(loaded=torch.full((4, 4), 0.5))
    assert torch.equal(copy, torch.full((4, 4), 0.5))


def test_an_fp32_optimizer_is_left_as_it_is():
    assert MasterWeights.attach(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)) is None


@pytest.mark.parametrize("overrides, message", [
    (["trainer.precision=pure"], r"^trainer\.precision='pure': holds the linear layers' weights in bf16 .*set "
                                r"trainer\.bf16=true"),
    (["trainer.precision=pure", "trainer.bf16=true", "model.dtype=float16"],
     r"^model\.dtype='float16': trainer\.precision=pure holds the linear layers' weights in bf16"),
    (["trainer.precision=pure", "trainer.bf16=true", "deepspeed=zero2"],
     r"^trainer\.precision='pure': DeepSpeed's bf16 keeps fp32 master weights of its own"),
])
def test_what_pure_bf16_cannot_do_is_refused_naming_the_knob(overrides, message):
    if not HAS_BF16 and not torch.cuda.is_available():
        overrides = [o for o in overrides if o != "trainer.bf16=true"]
        if len(overrides) > 1:
            pytest.skip("needs bf16 arithmetic (a GPU or a CPU with bf16 instructions)")
    with pytest.raises(ConfigError, match=message):
        check(composed(*overrides))


SHARED = ["data.eval_file=null", "trainer.max_steps=6", "trainer.logging_steps=1", "trainer.report_to=[]",
          "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2", "loss=ce",
          "trainer.bf16=true", "trainer.lr_scheduler_type=constant"]


@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with bf16 instructions and no GPU")
def test_pure_bf16_computes_the_steps_of_autocast_with_the_linear_weights_in_bf16(tmp_path):
    from sft.run.build import build

    def losses_of(trainer) -> list[float]:
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    mixed = build(composed(*SHARED, "trainer.save_strategy=no"), str(tmp_path / "mixed")).trainer
    mixed.train()
    pure = build(composed(*SHARED, "trainer.save_strategy=no", "trainer.precision=pure"), str(tmp_path)).trainer
    pure.train()
    linear = {p for m in pure.model.modules() if isinstance(m, torch.nn.Linear) and m is not pure.model.lm_head
              for p in m.parameters()}  # weights and biases
    assert linear and all(p.dtype == (torch.bfloat16 if p in linear else torch.float32)
                          for p in pure.model.parameters())
    copies = {c for c in pure.master_weights.trained() if c.dtype == torch.float32}
    assert len(copies) == len(pure.master_weights.trained()) == len(list(pure.model.parameters()))
    assert pure.optimizer.state[next(iter(copies))]["exp_avg"].dtype == torch.float32
    assert len(losses_of(pure)) == 6
    # autocast casts each linear weight to the bf16 value pure holds, and each bf16 weight gradient back to fp32 as
    # pure's copies take it: the same steps (six, two micro-batches each)
    assert losses_of(pure) == losses_of(mixed)
    for ours, theirs in zip(pure.master_weights.trained(), mixed.optimizer.param_groups[0]["params"]
                            + mixed.optimizer.param_groups[1]["params"]):
        assert torch.equal(ours, theirs)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with bf16 instructions and no GPU")
def test_pure_bf16_resumes_from_the_fp32_copies_exactly(tmp_path):
    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run = [*SHARED, "trainer.precision=pure", "trainer.save_steps=3", "trainer.save_total_limit=null"]
    assert run_train(*run, f"hydra.run.dir={straight}").returncode == 0
    proc = run_train(*run, f"hydra.run.dir={resumed}", f"resume={straight / 'checkpoint-3'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_losses(resumed, 6)[-3:] == step_losses(straight, 6)[-3:]
    ours, theirs = (torch.load(run_dir / "checkpoint-6" / "optimizer.pt", weights_only=True)["state"]
                    for run_dir in (resumed, straight))
    copies = [key for key, state in ours.items() if STATE_KEY in state]  # the linear layers' (the rest is fp32)
    assert ours.keys() == theirs.keys() and copies
    for key in copies:
        assert ours[key][STATE_KEY].dtype == torch.float32
        assert torch.equal(ours[key][STATE_KEY], theirs[key][STATE_KEY])
    a, b = (load_file(run_dir / "model" / "model.safetensors") for run_dir in (resumed, straight))
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.slow  # two short runs
@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with bf16 instructions and no GPU")
def test_pure_bf16_with_lora_holds_the_frozen_base_in_bf16_without_fp32_copies(tmp_path):
    from sft.run.build import build

    runs = {}
    for name, extra in (("mixed", []), ("pure", ["trainer.precision=pure"])):
        runs[name] = build(composed(*SHARED, "trainer.max_steps=3", "lora=default", "trainer.save_strategy=no",
                                    *extra), str(tmp_path / name)).trainer
        runs[name].train()
    pure = runs["pure"]
    base = [m.base_layer.weight for m in pure.model.modules() if hasattr(m, "base_layer")]
    assert base and all(w.dtype == torch.bfloat16 and not w.requires_grad for w in base)
    adapters = [p for p in pure.model.parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.bfloat16 for p in adapters)
    copies = pure.master_weights.holding_gradients(adapters)
    assert all(c.dtype == torch.float32 for c in copies)  # for the adapters only: the frozen base has none
    assert sum(c.numel() for c in pure.master_weights.trained()) == sum(p.numel() for p in adapters)
    losses = {name: [e["loss"] for e in t.state.log_history if "loss" in e] for name, t in runs.items()}
    assert len(losses["pure"]) == 3 and losses["pure"] == losses["mixed"]
