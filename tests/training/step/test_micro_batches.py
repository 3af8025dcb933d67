"""A micro-batch in pieces (`sft.training.step.micro_batches`): cut at its rows or a packed row's samples, into so
many pieces (`trainer.oom_retry`) or pieces of at most so many tokens (`trainer.micro_batch_tokens`); trained in pieces
of tokens to the losses and weights of the run trained whole; after an out-of-memory error in a forward or inside a
backward the step is trained again in pieces to the losses and weights of the run that never ran out of memory, the
pieces kept on resume; where it cannot be retried smaller, the error says why."""

import json
import logging

import pytest
import torch
from conftest import composed, fast_loop

from sft.data.tokens.collator import WeightedDataCollator
from sft.data.tokens.batch import TARGET_KEYS
from sft.training.step.micro_batches import MicroBatchPieces, samples_in, split_by_tokens, split_micro_batch

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]


def features(rows=ROWS) -> list[dict]:
    return [{"input_ids": ids, "labels": ids, "sample_weight": 1.0 + i, "source_line": 10 + i}
            for i, ids in enumerate(rows)]


def test_a_padded_micro_batch_is_cut_at_its_rows_in_order(tokenizer):
    batch = WeightedDataCollator(tokenizer)(features())
    pieces = split_micro_batch(batch, 2)
    assert [p["source_lines"].tolist() for p in pieces] == [[10, 11, 12], [13, 14]]
    for key, value in batch.items():
        if key in TARGET_KEYS:  # the whole micro-batch's trained positions: each piece's loss finds its own
            assert all(key not in p for p in pieces)
            continue
        assert torch.equal(torch.cat([p[key] for p in pieces]), value), key
    assert [len(p["source_lines"]) for p in split_micro_batch(batch, 8)] == [1] * 5  # no more pieces than rows


def test_a_packed_micro_batch_is_cut_where_a_sample_starts_each_piece_with_its_own_boundaries(tokenizer):
    batch = WeightedDataCollator(tokenizer, packing=True)(features())
    assert samples_in(batch) == 5 and batch["input_ids"].shape == (1, 12)
    pieces = split_micro_batch(batch, 2)
    # tokens 0-2 | 3-4 | 5-8 | 9 | 10-11: the middles 1, 3.5, 6.5, 9, 10.5 fall in halves 0, 0, 1, 1, 1
    assert [p["position_ids"].tolist() for p in pieces] == [[[0, 1, 2, 0, 1]], [[0, 1, 2, 3, 0, 0, 1]]]
    assert [p["source_lines"].tolist() for p in pieces] == [[10, 11], [12, 13, 14]]
    assert [p["cu_seq_lens_q"].tolist() for p in pieces] == [[0, 3, 5], [0, 4, 5, 7]]
    assert [p["max_length_k"] for p in pieces] == [3, 4]
    assert pieces[1]["cu_seq_lens_k"].dtype == batch["cu_seq_lens_k"].dtype
    for key in ("input_ids", "labels", "weights", "position_ids"):
        assert torch.equal(torch.cat([p[key] for p in pieces], 1), batch[key]), key


def test_a_packed_micro_batch_is_cut_into_consecutive_samples_of_at_most_the_budgets_tokens(tokenizer):
    batch = WeightedDataCollator(tokenizer, packing=True)(features())  # samples of 3, 2, 4, 1, 2 tokens
    pieces = split_by_tokens(batch, 5)
    assert [p["position_ids"].tolist() for p in pieces] == [[[0, 1, 2, 0, 1]], [[0, 1, 2, 3, 0]], [[0, 1]]]
    assert [p["source_lines"].tolist() for p in pieces] == [[10, 11], [12, 13], [14]]
    assert [p["cu_seq_lens_q"].tolist() for p in pieces] == [[0, 3, 5], [0, 4, 5], [0, 2]]
    for key in ("input_ids", "labels", "weights", "position_ids"):
        assert torch.equal(torch.cat([p[key] for p in pieces], 1), batch[key]), key
    # a sample longer than the budget is a piece alone; the rest still fill theirs
    assert [p["source_lines"].tolist() for p in split_by_tokens(batch, 3)] == [[10], [11], [12], [13, 14]]
    assert split_by_tokens(batch, 12) == [batch] and split_by_tokens(batch, None) == [batch]
    padded = WeightedDataCollator(tokenizer)(features())
    assert split_by_tokens(padded, 3) == [padded]  # rows of padding: cut by rows (oom_retry), not by tokens


def test_after_an_out_of_memory_error_the_token_budget_is_halved_and_kept_on_resume(tokenizer):
    batch = WeightedDataCollator(tokenizer, packing=True)(features())  # the longest sample: 4 tokens
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    pieces = MicroBatchPieces(refusal=None, tokens=10)
    assert pieces.state_dict()["micro_batch_tokens"] is None  # the plan's budget: the plan says it again on resume
    pieces.after_out_of_memory(error, batch, step=3)
    assert (pieces.tokens, pieces.pieces) == (5, 1)
    resumed = MicroBatchPieces(refusal=None, tokens=10)  # what the plan chose again
    resumed.load_state_dict(pieces.state_dict())
    assert resumed.tokens == 5
    pieces.after_out_of_memory(error, batch, step=3)
    assert pieces.tokens == 2
    with pytest.raises(torch.OutOfMemoryError, match=r"\(not retried at a smaller micro-batch: each piece holds one "
                       r"sample \(pieces of at most 2 tokens\)\)$"):
        pieces.after_out_of_memory(error, batch, step=3)


def test_a_micro_batch_of_one_sample_is_not_cut(tokenizer):
    for packing in (False, True):
        batch = WeightedDataCollator(tokenizer, packing=packing)(features([[5, 6, 7]]))
        assert split_micro_batch(batch, 4) == [batch]


def test_where_a_step_cannot_be_retried_smaller_the_error_says_why(tokenizer):
    batch = WeightedDataCollator(tokenizer)(features([[5, 6], [7, 8]]))
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    pieces = MicroBatchPieces(refusal=None)
    pieces.after_out_of_memory(error, batch, step=3)
    assert pieces.pieces == 2
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 2\.00 GiB \(not "
                       r"retried at a smaller micro-batch: each piece of the micro-batch \(2 sample\(s\) in 2 "
                       r"piece\(s\)\) holds one sample\)$"):
        pieces.after_out_of_memory(error, batch, step=3)
    with pytest.raises(torch.OutOfMemoryError, match=r"\(not retried at a smaller micro-batch: 2 processes: the "
                       "other ranks would wait in the step's all-reduce\)$"):
        MicroBatchPieces("2 processes: the other ranks would wait in the step's all-reduce").after_out_of_memory(
            error, batch, step=3)


class OutOfMemoryOnce:
    """CUDA's out-of-memory error in the second micro-batch of step 2 while micro-batches are whole, raised in the
    first decoder layer's forward, or in its backward (the later layers' gradients accumulated by then)."""

    def __init__(self, trainer, where: str):
        self.trainer, self.calls, self.raised = trainer, 0, 0
        layer = trainer.model.get_decoder().layers[0]
        if where == "forward":
            layer.register_forward_pre_hook(lambda module, args: self.maybe_raise())
        else:
            layer.register_full_backward_pre_hook(lambda module, grad_output: self.maybe_raise())

    def maybe_raise(self):
        if self.trainer.state.global_step == 1 and self.trainer.micro_batches.pieces == 1 and self.trainer.model.training:
            self.calls += 1
            if self.calls == 2:
                self.raised += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")


RUN = ["data.eval_file=null", "trainer.max_steps=4", "trainer.logging_steps=1", "trainer.report_to=[]",
       "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2", "loss=hard_sample",
       "trainer.lr_scheduler_type=constant", "trainer.save_steps=2"]


def trained(tmp_path, name, *overrides, where=None, resume=None):
    from sft.run.build import build
    from sft.run.train import track_checkpoints

    cfg = composed(*RUN, *overrides)
    recipe = build(cfg, str(tmp_path / name))
    track_checkpoints(recipe, cfg, resume, [])  # sft_state.json in each checkpoint; on resume, its state back
    trainer = recipe.trainer
    injected = OutOfMemoryOnce(trainer, where) if where else None
    trainer.train(resume_from_checkpoint=resume)
    logged = [e[key] for e in trainer.state.log_history if "loss" in e for key in ("loss", "ce")]
    return trainer, logged, injected


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that never ran out of memory, padded and packed: its trainer and logged losses."""
    runs = {}

    def run(packing: bool):
        if packing not in runs:
            whole, expected, _ = trained(tmp_path_factory.mktemp("whole"), "whole",
                                         *(["data.packing=true"] if packing else []))
            runs[packing] = whole, expected
        return runs[packing]
    return run


@pytest.mark.parametrize("packing, where", fast_loop([(False, "forward"), (False, "backward"), (True, "forward"),
                                                      (True, "backward")], {"padded-backward"},
                                                     ids=["padded-forward", "padded-backward", "packed-forward",
                                                          "packed-backward"]))
def test_after_an_out_of_memory_error_the_step_trains_again_in_pieces_to_the_same_losses_and_weights(
        tmp_path, caplog, uninterrupted, packing, where):
    extra = ["data.packing=true"] if packing else []
    whole, expected = uninterrupted(packing)
    with caplog.at_level(logging.WARNING, logger="sft"):
        cut, logged, injected = trained(tmp_path, "cut", *extra, where=where)
    assert injected.raised == 1 and cut.micro_batches.pieces == 2
    assert "step 2: out of memory in a micro-batch of 4 sample(s) (CUDA out of memory. Tried to allocate 20.00 MiB " \
           "(simulated)): training the step again from its first micro-batch with each micro-batch in 2 pieces" \
        in caplog.text
    assert len(logged) == 2 * 4
    assert logged == pytest.approx(expected, rel=1e-6)  # the step's loss and ce: nothing counted twice, none lost
    for ours, theirs in zip(cut.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # no gradient kept from the failed backward
    # kept in the checkpoint: a resume from step 2 trains in pieces, to the same losses
    saved = json.loads((tmp_path / "cut" / "checkpoint-2" / "sft_state.json").read_text())
    assert saved["controllers"]["trainer"]["micro_batch_pieces"] == 2
    resumed, after, _ = trained(tmp_path, "cut", *extra, resume=str(tmp_path / "cut" / "checkpoint-2"))
    assert resumed.micro_batches.pieces == 2
    assert after[-4:] == pytest.approx(expected[-4:], rel=1e-6)


def test_packed_micro_batches_trained_in_pieces_of_tokens_give_the_whole_ones_losses_and_weights(tmp_path,
                                                                                                 uninterrupted):
    whole, expected = uninterrupted(True)
    cut, logged, _ = trained(tmp_path, "tokens", "data.packing=true", "trainer.micro_batch_tokens=64")
    assert cut.micro_batches.tokens == 64
    batch = next(iter(cut.get_train_dataloader()))
    assert batch["input_ids"].shape[1] > 64 and len(cut.micro_batches.split(batch)) > 1  # cut, not whole
    assert logged == pytest.approx(expected, rel=1e-6)
    # Adam divides by the root of a gradient's square: an embedding row whose gradient is near 0 turns the sums'
    # other order (more pieces) into a few 1e-6 of an update of up to 2e-3 a step
    for ours, theirs in zip(cut.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_a_token_budget_is_refused_in_one_line_where_pieces_are_not_exact_or_rows_not_packed(tmp_path):
    from architectures import tiny
    from transformers import TrainingArguments

    from sft.config import ConfigError, check
    from sft.loss.builtin import CrossEntropyLoss
    from sft.training.parts import StepParts
    from sft.training.trainer import WeightedLossTrainer

    with pytest.raises(ConfigError, match=r"^trainer\.micro_batch_tokens=64: cuts packed micro-batches only: set "
                                          r"data\.packing=true too \(or null\)$"):
        check(composed("trainer.micro_batch_tokens=64"))
    with pytest.raises(ConfigError, match=r"^trainer\.micro_batch_tokens=0: must be >= 1"):
        check(composed("data.packing=true", "trainer.micro_batch_tokens=0"))
    # a mixture of experts' balance loss of a micro-batch is not the sum of its pieces'
    moe = tiny("qwen3_moe", tie=True, vocab_size=768, output_router_logits=True, router_aux_loss_coef=0.5)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match=r"^trainer\.micro_batch_tokens=64: trains a packed micro-batch in pieces, "
                                          r"which this run cannot: the router aux loss of a micro-batch is not the "
                                          r"sum of its pieces' \(model\.router_aux_loss_coef\); set it to null$"):
        WeightedLossTrainer(model=moe, args=args, loss=CrossEntropyLoss(), step=StepParts(micro_batch_tokens=64))


def test_with_oom_retry_off_the_error_stops_the_run_saying_so(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match=r"\(not retried at a smaller micro-batch: "
                                                     r"trainer\.oom_retry=false\)$"):
        trained(tmp_path, "off", "trainer.oom_retry=false", where="forward")
