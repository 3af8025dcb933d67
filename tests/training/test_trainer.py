"""The trainer (`sft.training.trainer`): every built-in loss is exact under gradient accumulation, packing and the
lean loss, and reduces to ce with uniform weights; every override of Trainer still overrides a method with the
same parameters."""

import dataclasses
import inspect

import pytest
import torch
from conftest import ROWS, chat, fast_loop, moved_tiny, train_steps, write_jsonl

from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec
from sft.loss.builtin import (ASFTLoss, CrossEntropyLoss, DFTLoss, DistillLoss, EAFTLoss, FocalLoss, HardSampleLoss,
                              KeywordLoss, LengthLoss, ReferenceWeightedLoss)
from sft.training.trainer import WeightedLossTrainer


def test_every_override_of_trainer_still_overrides_a_method_with_the_same_parameters():
    # Eight of them are private hooks of transformers (_clip_grad_norm, _get_grad_norm, _get_train_sampler, _save,
    # _save_checkpoint, _save_optimizer_and_scheduler, _load_optimizer_and_scheduler, _track_num_input_tokens): a rename
    # or a new parameter there would silently bypass sft.training.step.control, the curriculum's sampler, the tied-copy
    # filter, the mark that tells sft's crash debris from others' checkpoints, the sharded checkpoints' background
    # writer, the resume of plain SGD under FSDP, or count the tokens twice.
    from transformers import Trainer

    from sft.training.checkpoints.saving import CheckpointSaving
    from sft.training.evaluation import ExactEvaluation

    overrides = {name: f for cls in (WeightedLossTrainer, ExactEvaluation, CheckpointSaving)
                 for name, f in vars(cls).items()
                 if getattr(f, "__override__", False)}
    assert set(overrides) == {"get_batch_samples", "compute_loss", "_clip_grad_norm", "_get_grad_norm",
                              "_get_train_sampler", "evaluation_loop", "prediction_step", "log",
                              "create_accelerator_and_postprocess", "_save", "_save_checkpoint", "training_step",
                              "save_model", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
                              "get_train_dataloader", "create_optimizer", "_track_num_input_tokens"}
    for name, ours in overrides.items():
        theirs = getattr(Trainer, name, None)
        assert theirs is not None, f"transformers.Trainer has no {name} any more"
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


# Every built-in loss, each with the difficulty weight on where it combines with it. ROWS' answers hold
# "carries"/"carrying" (whole words) and sums after "=" (the regex), so the keyword weights differ by token.
BUILT_IN = {
    "ce": CrossEntropyLoss(),
    "hard_sample": HardSampleLoss(alpha=1.0),
    "hard_sample-sample": HardSampleLoss(alpha=2.0, normalize="sample"),
    "hard_sample-token": HardSampleLoss(alpha=1.0, normalize="token"),
    "keywords": KeywordLoss(phrases=["carries", r"(?<== )\d+"], regex=True, factor=4.0, alpha=1.0),
    "focal": FocalLoss(gamma=2.0, alpha=1.0),
    "dft": DFTLoss(alpha=1.0, normalize="sample"),
    "length": LengthLoss(length_ref=8.0, length_beta=0.5, alpha=1.0),
    "eaft": EAFTLoss(top_k=5, alpha=1.0),
}


@pytest.mark.parametrize("name", fast_loop(list(BUILT_IN), {"hard_sample", "hard_sample-token", "dft"}))
def test_gradient_accumulation_does_not_change_losses_or_parameters(tmp_path, tokenizer, name):
    loss = BUILT_IN[name]
    losses_a, params_a, _ = train_steps(tmp_path, tokenizer, loss, batch_size=4, accumulation=1)
    losses_b, params_b, _ = train_steps(tmp_path, tokenizer, loss, batch_size=1, accumulation=4)
    assert len(losses_a) == len(losses_b) == 2
    assert losses_a == pytest.approx(losses_b, abs=1e-5)
    torch.testing.assert_close(params_a, params_b, atol=1e-5, rtol=0)


def test_hard_sample_with_equal_weights_is_exactly_ce(tmp_path, tokenizer):
    equal = [{**r, "difficulty_score": 2.0} for r in ROWS]
    ce_losses, ce_params, _ = train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 2, 2, rows=equal)
    hs_losses, hs_params, _ = train_steps(tmp_path, tokenizer, HardSampleLoss(alpha=1.0), 2, 2, rows=equal)
    assert hs_losses == pytest.approx(ce_losses, abs=1e-6)
    torch.testing.assert_close(hs_params, ce_params, atol=1e-6, rtol=0)


@pytest.mark.parametrize("uniform", fast_loop([KeywordLoss(phrases=["carries"], factor=1.0), FocalLoss(gamma=0.0),
                                               LengthLoss(length_beta=0.0)], {"focal-gamma-0"},
                                              ids=["keywords-factor-1", "focal-gamma-0", "length-beta-0"]))
def test_each_loss_with_uniform_weights_is_exactly_ce(tmp_path, tokenizer, uniform):
    ce_losses, ce_params, _ = train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 2, 2)
    losses, params, _ = train_steps(tmp_path, tokenizer, uniform, 2, 2)
    assert losses == pytest.approx(ce_losses, abs=1e-6)
    torch.testing.assert_close(params, ce_params, atol=1e-6, rtol=0)


def test_unequal_weights_do_change_the_update(tmp_path, tokenizer):
    _, ce_params, _ = train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 4, 1)
    _, hs_params, _ = train_steps(tmp_path, tokenizer, HardSampleLoss(alpha=1.0), 4, 1)
    assert (ce_params - hs_params).abs().max() > 1e-4


def test_logged_ce_and_weight_mean_describe_the_step(tmp_path, tokenizer):
    losses, _, trainer = train_steps(tmp_path, tokenizer, HardSampleLoss(alpha=1.0), 4, 1, steps=1)
    log = next(e for e in trainer.state.log_history if "loss" in e)
    # With one step on the first 4 rows the weight mean is the token-weighted mean of their scores.
    rows = trainer.train_dataset.select(range(4))
    tokens = [sum(label != -100 for label in r["labels"][1:]) for r in rows]
    expected = sum(t * r["difficulty_score"] for t, r in zip(tokens, rows)) / sum(tokens)
    assert log["weight_mean"] == pytest.approx(expected, rel=1e-5)
    assert log["ce"] > 0 and log["ce"] != pytest.approx(log["loss"], abs=1e-4)


@pytest.mark.parametrize("name", fast_loop(["hard_sample", "hard_sample-sample", "hard_sample-token", "keywords",
                                            "focal", "dft", "eaft"], {"hard_sample", "focal"}))
def test_chunked_loss_trains_exactly_as_the_naive_one(tmp_path, tokenizer, name):
    naive = dataclasses.replace(BUILT_IN[name], impl="naive")
    chunked = dataclasses.replace(BUILT_IN[name], impl="chunked", chunk_tokens=7)
    losses_n, params_n, trainer_n = train_steps(tmp_path, tokenizer, naive, 2, 2)
    losses_c, params_c, trainer_c = train_steps(tmp_path, tokenizer, chunked, 2, 2)
    assert (trainer_n.loss_impl, trainer_c.loss_impl) == ("naive", "chunked")
    assert losses_c == pytest.approx(losses_n, abs=1e-5)
    torch.testing.assert_close(params_c, params_n, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", fast_loop(["hard_sample", "hard_sample-sample", "keywords", "length"],
                                           {"hard_sample-sample"}))
def test_packing_trains_exactly_as_padding(tmp_path, tokenizer, name):
    loss = BUILT_IN[name]
    losses_pad, params_pad, _ = train_steps(tmp_path, tokenizer, loss, 4, 1)
    losses_pack, params_pack, trainer = train_steps(tmp_path, tokenizer, loss, 4, 1, packing=True)
    assert losses_pack == pytest.approx(losses_pad, abs=1e-5)
    torch.testing.assert_close(params_pack, params_pad, atol=1e-5, rtol=0)
    log = next(e for e in trainer.state.log_history if "loss" in e)
    assert log["padding_fraction"] == 0


@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_a_model_whose_logits_the_lean_loss_cannot_reproduce_gets_naive_or_a_clear_error(tmp_path, impl, caplog):
    from transformers import TrainingArguments

    from sft.config import ConfigError
    from sft.model.loading import load_model
    from sft.training.trainer import WeightedLossTrainer

    model = load_model("tiny")
    model.lm_head.register_forward_hook(lambda module, args, output: output * 2)  # a transform no table knows
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    build = lambda: WeightedLossTrainer(model=model, args=args, loss=CrossEntropyLoss(impl=impl))  # noqa: E731
    if impl == "chunked":
        with pytest.raises(ConfigError, match="loss.impl='chunked': this Qwen2ForCausalLM's logits are not"):
            build()
        return
    with caplog.at_level("WARNING", logger="sft"):
        assert build().loss_impl == "naive"
    assert "loss.impl=auto: this Qwen2ForCausalLM's logits are not" in caplog.text
    assert WeightedLossTrainer(model=load_model("tiny"), args=args, loss=CrossEntropyLoss()).loss_impl == "chunked"


def test_evaluation_makes_no_collective_per_batch_and_keeps_the_exact_metrics(tmp_path, tokenizer):
    """Trainer would count `num_items_in_batch` over the ranks and gather each batch's loss (two collectives
    per eval batch); `sft` reads neither, and its metrics are the exact ratios over the rows, batch size
    notwithstanding."""
    from transformers import TrainingArguments

    from sft.data.tokens.collator import WeightedDataCollator
    from sft.loss.builtin import HardSampleLoss
    from sft.model.loading import load_model
    from sft.training.trainer import WeightedLossTrainer

    path = write_jsonl(tmp_path / "eval.jsonl", [chat(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}", 1.0 + i % 4)
                                                 for i in range(7)])
    loss = HardSampleLoss(alpha=1.0)
    data = load_sft_datasets(DataSpec(train_file=str(path), eval_file=str(path), max_length=256), tokenizer, loss)
    model = load_model("tiny")
    metrics = {}
    for batch_size in (2, 7):
        args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=batch_size,
                                 use_cpu=True, report_to=[], remove_unused_columns=False)
        trainer = WeightedLossTrainer(model=model, args=args, eval_dataset=data.eval, loss=loss,
                                      data_collator=WeightedDataCollator(tokenizer))
        collectives = []
        for name in ("gather", "gather_for_metrics", "reduce"):
            original = getattr(trainer.accelerator, name)
            setattr(trainer.accelerator, name,
                    lambda *a, _name=name, _f=original, **k: collectives.append(_name) or _f(*a, **k))
        counted = trainer._get_num_items_in_batch
        trainer._get_num_items_in_batch = lambda *a, **k: collectives.append("num_items") or counted(*a, **k)
        metrics[batch_size] = trainer.evaluate()
        assert collectives == [], batch_size
    for key in ("eval_loss", "eval_ce", "eval_token_accuracy", "eval_loss_bucket_1"):
        assert metrics[2][key] == pytest.approx(metrics[7][key], rel=1e-6), key
    assert metrics[7]["eval_loss"] != pytest.approx(metrics[7]["eval_ce"], rel=1e-3)  # the weights count


def device_reads_per_step(tmp_path, *overrides: str) -> dict:
    """Each place a training step reads a tensor's value on the host (`.item()`, `.tolist()`, `bool()`, `int()`,
    `float()`, `nonzero`, ...: on a GPU each waits for the device), counted over steps 3 and 4 of a run built as a user's
    is (`sft.run.build`): {(method, where in sft or the stack): count}. Left out: the optimizer's step counters (CPU
    tensors on a GPU too) and the collator's work (on the CPU, before the batch moves)."""
    import collections
    import traceback

    from transformers import TrainerCallback

    from conftest import composed
    from sft.run.build import build

    reads, counting = collections.Counter(), [False]
    methods = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu")
    originals = {name: getattr(torch.Tensor, name) for name in methods}

    def counted(name):
        def read(*args, **kwargs):
            if counting[0]:
                stack = traceback.extract_stack()[:-1]
                files = [frame.filename for frame in stack]
                if not any(f.endswith(("torch/optim/optimizer.py", "sft/data/tokens/batch.py",
                                       "sft/data/tokens/collator.py")) for f in files[-4:]):
                    frame = stack[-1]
                    reads[(name, f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}")] += 1
            return originals[name](*args, **kwargs)
        return read

    class Window(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counting[0] = state.global_step in (2, 3)

        def on_step_end(self, args, state, control, **kwargs):
            counting[0] = False

    cfg = composed("trainer.max_steps=5", "trainer.logging_steps=100", "trainer.eval_strategy=no",
                   "trainer.save_strategy=no", "trainer.report_to=[]", "data.eval_file=null",
                   "trainer.gradient_accumulation_steps=2", *overrides)
    trainer = build(cfg, str(tmp_path)).trainer
    trainer.add_callback(Window())
    try:
        for name in methods:
            setattr(torch.Tensor, name, counted(name))
        trainer.train()
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    return dict(reads)


@pytest.mark.slow  # two short runs (about 10 s)
def test_a_packed_step_reads_the_device_once_whatever_its_accumulation(tmp_path):
    """A GPU waits each time the host reads a device tensor: a packed step of two micro-batches reads the device once
    (its norm, loss and the ranks' stop requests together); the trained positions, the samples' boundaries and count
    come from the collator, the model builds no mask (it used to read each micro-batch's packing twice, and Trainer
    its token count). A padded step adds transformers' own check of each forward's padding (2 reads a forward)."""
    packed = device_reads_per_step(tmp_path / "packed", "data.packing=true")
    assert sum(packed.values()) <= 2 * 2, packed  # two steps counted: at most two reads a step
    assert all("sft/training/step/control.py" in where for _, where in packed), packed
    padded = device_reads_per_step(tmp_path / "padded")
    from_the_model = {k: v for k, v in padded.items() if "masking_utils" in k[1]}
    assert sum(padded.values()) - sum(from_the_model.values()) <= 2 * 2, padded


@pytest.mark.parametrize("divergence", ["forward", "reverse", "jsd"])
@pytest.mark.slow  # three short runs each (the fast loop has the step's loss computed apart, below)
def test_distillation_is_exact_under_accumulation_the_lean_loss_and_packing(tmp_path, tokenizer, divergence):
    loss = DistillLoss(divergence=divergence, kd_ratio=0.7, temperature=2.0, alpha=1.0, impl="naive")
    lean = dataclasses.replace(loss, impl="chunked", chunk_tokens=7)
    losses_a, params_a, _ = train_steps(tmp_path / "a", tokenizer, loss, 4, 1, second_model=moved_tiny())
    losses_b, params_b, trainer = train_steps(tmp_path / "b", tokenizer, lean, 1, 4, second_model=moved_tiny())
    losses_c, params_c, _ = train_steps(tmp_path / "c", tokenizer, lean, 4, 1, packing=True,
                                        second_model=moved_tiny())
    assert trainer.loss_impl == "chunked"
    assert losses_b == pytest.approx(losses_a, abs=1e-5) and losses_c == pytest.approx(losses_a, abs=1e-5)
    torch.testing.assert_close(params_b, params_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(params_c, params_a, atol=1e-5, rtol=0)
    assert not any(p.requires_grad for p in trainer.second_model.parameters())


def test_a_distillation_steps_loss_is_the_per_token_mix_computed_apart(tmp_path, tokenizer):
    # The first logged loss is the step's, before any update: recomputed from both models' own logits on the collated
    # rows, with PyTorch's kl_div, hard-sample weighted.
    import torch.nn.functional as F

    from sft.data.tokens.collator import WeightedDataCollator
    from sft.model.loading import load_model

    teacher = moved_tiny(scale=0.2)
    losses, _, trainer = train_steps(tmp_path, tokenizer, DistillLoss(kd_ratio=0.4, alpha=1.0), 4, 1, steps=1,
                                     second_model=teacher)
    batch = WeightedDataCollator(tokenizer)([trainer.train_dataset[i] for i in range(4)])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        student_logits = load_model("tiny")(**inputs).logits[:, :-1]
        teacher_logits = teacher(**inputs).logits[:, :-1]
    labels, weights = batch["labels"][:, 1:], batch["weights"][:, 1:]
    trained = labels != -100
    ce = F.cross_entropy(student_logits[trained], labels[trained], reduction="none")
    kl = F.kl_div(student_logits[trained].log_softmax(-1), teacher_logits[trained].log_softmax(-1),
                  reduction="none", log_target=True).sum(-1)
    expected = ((0.6 * ce + 0.4 * kl) * weights[trained]).sum() / weights[trained].sum()
    assert losses[0] == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.slow  # three short runs
def test_asft_is_exact_under_accumulation_the_lean_loss_and_packing(tmp_path, tokenizer):
    loss = ASFTLoss(kl_weight=0.3, alpha=1.0, impl="naive")
    lean = dataclasses.replace(loss, impl="chunked", chunk_tokens=7)
    losses_a, params_a, _ = train_steps(tmp_path / "a", tokenizer, loss, 4, 1, second_model=moved_tiny())
    losses_b, params_b, _ = train_steps(tmp_path / "b", tokenizer, lean, 1, 4, second_model=moved_tiny())
    losses_c, params_c, _ = train_steps(tmp_path / "c", tokenizer, lean, 4, 1, packing=True,
                                        second_model=moved_tiny())
    assert losses_b == pytest.approx(losses_a, abs=1e-5) and losses_c == pytest.approx(losses_a, abs=1e-5)
    torch.testing.assert_close(params_b, params_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(params_c, params_a, atol=1e-5, rtol=0)


@pytest.mark.slow  # two runs (about 3 s)
def test_a_teacher_that_is_the_student_teaches_nothing(tmp_path, tokenizer):
    from sft.model.loading import load_model

    losses, params, _ = train_steps(tmp_path, tokenizer, DistillLoss(kd_ratio=1.0), 4, 1,
                                    second_model=load_model("tiny"))
    start = torch.cat([p.detach().flatten() for p in load_model("tiny").parameters()])
    assert losses == pytest.approx([0.0, 0.0], abs=1e-6)
    torch.testing.assert_close(params, start, atol=1e-6, rtol=0)


def test_a_loss_and_a_teacher_go_together(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="DistillLoss reads teacher at each step, and the trainer was given none"):
        train_steps(tmp_path, tokenizer, DistillLoss(), 4, 1)
    with pytest.raises(ValueError, match="reads no second model at each step, and the trainer was given one"):
        train_steps(tmp_path, tokenizer, CrossEntropyLoss(), 4, 1, second_model=moved_tiny())
    # its reference scored the data before training: the trainer holds none
    with pytest.raises(ValueError, match="ReferenceWeightedLoss reads no second model at each step, and the trainer"):
        train_steps(tmp_path, tokenizer, ReferenceWeightedLoss(), 4, 1, second_model=moved_tiny())
