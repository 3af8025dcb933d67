"""A micro-batch that does not fit (`sft.training.step.micro_batches`, `trainer.oom_retry`): cut into pieces at its
rows or a packed row's samples; after an out-of-memory error in a forward or inside a backward the step is trained
again in pieces to the losses and weights of the run that never ran out of memory, the pieces kept on resume; where
it cannot be retried smaller, the error says why."""

import json
import logging

import pytest
import torch
from conftest import composed, fast_loop

from sft.data.collator import WeightedDataCollator
from sft.training.step.micro_batches import MicroBatchPieces, samples_in, split_micro_batch

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]


def features(rows=ROWS) -> list[dict]:
    return [{"input_ids": ids, "labels": ids, "sample_weight": 1.0 + i, "source_line": 10 + i}
            for i, ids in enumerate(rows)]


def test_a_padded_micro_batch_is_cut_at_its_rows_in_order(tokenizer):
    batch = WeightedDataCollator(tokenizer)(features())
    pieces = split_micro_batch(batch, 2)
    assert [p["source_lines"].tolist() for p in pieces] == [[10, 11, 12], [13, 14]]
    for key, value in batch.items():
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


def test_with_oom_retry_off_the_error_stops_the_run_saying_so(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match=r"\(not retried at a smaller micro-batch: "
                                                     r"trainer\.oom_retry=false\)$"):
        trained(tmp_path, "off", "trainer.oom_retry=false", where="forward")
