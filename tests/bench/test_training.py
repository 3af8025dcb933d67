"""The bench's training cases (`sft.bench.training`): TRL's trainer, a plain Trainer and the hand-written loop, given
sft's rows, train on the same tokens with the same loss, so the speed comparison is like for like."""

import pytest


@pytest.mark.slow  # TRL's import alone is 3.5 s of the fast loop
@pytest.mark.parametrize("ours, theirs, overrides", [
    ("ce", "trl", ["trainer.gradient_accumulation_steps=2"]),
    ("packing", "trl_padding_free", []),
    ("packing", "trl_padding_free_mask", []),
    ("packing", "trl_best", ["trainer.gradient_accumulation_steps=2"]),
    ("packing", "hf_padding_free", ["trainer.gradient_accumulation_steps=2"]),
])
def test_trl_case_trains_on_the_same_tokens_with_the_same_loss_as_sft(tmp_path, ours, theirs, overrides):
    """The bench's speed comparison is like for like: TRL's SFTTrainer, or a plain Trainer on transformers'
    padding-free batches, given `sft`'s rows, logs the same loss at every step (same model, rows, order, labels,
    optimizer, accumulation) as `sft` with `loss=ce`; at their fastest settings too (`trl_best`, `hf_padding_free`:
    on a CPU, no Liger or flash attention, so the same step)."""
    if theirs.startswith("trl"):
        pytest.importorskip("trl", reason="the TRL cases need pip install -e '.[bench]'")
    from sft.bench.cases import CASES
    from sft.bench.config import compose
    from sft.bench.training import case_trainer

    shared = ["trainer.per_device_train_batch_size=4", "trainer.max_steps=3", "trainer.logging_steps=1",
              "trainer.eval_strategy=no", "trainer.save_strategy=no", "trainer.report_to=[]",
              "trainer.disable_tqdm=true", "data.eval_file=null", *overrides]
    losses = {}
    for case, extra in ((ours, []), (theirs, [])):
        cfg = compose(shared + list(CASES[case].overrides) + extra)
        trainer = case_trainer(case, cfg, str(tmp_path / case))
        trainer.train()
        losses[case] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses[ours]) == 3
    assert losses[ours] == pytest.approx(losses[theirs], rel=1e-5, abs=1e-6)


@pytest.mark.slow  # two short runs
def test_the_raw_loop_trains_sfts_batches_to_the_same_step_losses_as_sft_with_the_same_loss(tmp_path):
    """`sft_vs_raw` is like for like: the hand-written loop, on the batches `ce_naive` trains on, logs the same loss
    at every step (same model, rows, order, accumulation, clipping, optimizer and schedule)."""
    from sft.bench.cases import CASES
    from sft.bench.config import compose
    from sft.bench.training import case_trainer, raw_loop, step_clock

    shared = ["trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2", "trainer.max_steps=4",
              "trainer.logging_steps=1", "trainer.eval_strategy=no", "trainer.save_strategy=no",
              "trainer.report_to=[]", "trainer.disable_tqdm=true", "data.eval_file=null", "clip.max_norm=0.05"]
    sft = case_trainer("ce_naive", compose(shared + list(CASES["ce_naive"].overrides)), str(tmp_path / "sft"))
    sft.train()
    expected = [entry["loss"] for entry in sft.state.log_history if "loss" in entry]
    raw = case_trainer("raw", compose(shared + list(CASES["raw"].overrides)), str(tmp_path / "raw"))
    clock = step_clock()
    losses = raw_loop(raw, clock)
    assert len(losses) == len(clock.times) == 4 and len(expected) == 4
    assert losses == pytest.approx(expected, rel=1e-5)  # steps 2-4 follow clipping, AdamW and the schedule too


def test_a_case_in_several_processes_shares_the_cores_out(monkeypatch):
    """torchrun's processes of one case (long_rows' split rows) take the cores between them: two processes with a
    thread per core each ran 8x slower on 2 cores."""
    from sft.bench.config import compose
    from sft.bench.device import threads

    cfg = compose(["bench.threads=4"])
    assert threads(cfg) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads(cfg) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert threads(cfg) == 1
