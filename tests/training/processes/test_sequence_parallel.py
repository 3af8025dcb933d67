"""Sequence parallelism's parts that need no second process (`sft.training.processes.sequence_parallel`, the loss's
`columns`, the collator's `sequence_parallel`): the slices' loss terms sum to the whole batch's, the ranks of a group
get the same batches, the collator's batches split evenly, and combinations that cannot work are one config error. The
two-process runs are in tests/e2e/test_distributed.py."""

import pytest
import torch
from conftest import composed
from transformers import AutoConfig

from sft.config import ConfigError, check
from sft.data.tokens.collator import WeightedDataCollator
from sft.loss.builtin import HardSampleLoss
from sft.model.loading import check_heads_split
from sft.training.processes.sequence_parallel import RepeatedBatches, SequenceParallel


@pytest.mark.parametrize("normalize", ["weight", "token", "sample"])
@pytest.mark.parametrize("impl", ["naive", "chunked"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_terms_of_each_ranks_positions_sum_to_the_whole_batchs(normalize, impl, packed):
    """Each of 4 ranks holds a quarter of the positions (its hidden states or logits); with the whole batch's labels
    and weights, their loss sums, gradients and per-sample sums add up to the unsplit batch's, also where a sample
    crosses a slice and `normalize=sample` divides by its whole token count."""
    torch.manual_seed(0)
    rows, length, hidden_size, vocab = (1, 40, 16, 97) if packed else (3, 12, 16, 97)
    hidden = torch.randn(rows, length, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size)
    labels = torch.randint(0, vocab, (rows, length))
    labels[:, :2] = -100
    position_ids = torch.arange(length).expand(rows, length)
    if packed:  # three samples of 15, 12 and 13 tokens in one row, each with a prompt
        position_ids = torch.cat([torch.arange(n) for n in (15, 12, 13)])[None]
        labels[position_ids < 3] = -100
    weights = torch.rand(rows, length) * (labels != -100)
    loss = HardSampleLoss(normalize=normalize, chunk_tokens=5)

    def terms(h, columns=None):
        given = {"logits": h @ weight.T} if impl == "naive" else {"hidden": h, "lm_head": weight, "impl": impl}
        return loss.terms(labels, weights, position_ids=position_ids, columns=columns, **given)

    whole = terms(hidden)
    quarter = length // 4
    parts = [terms(hidden[:, k * quarter:(k + 1) * quarter], (k * quarter, (k + 1) * quarter)) for k in range(4)]
    assert sum(p.loss_sum for p in parts).item() == pytest.approx(whole.loss_sum.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(sum(p.loss_sum for p in parts), hidden)[0],
                               torch.autograd.grad(whole.loss_sum, hidden)[0], atol=1e-6, rtol=0)
    for field in ("numerator", "denominator", "ce_sum", "weight_sum", "tokens"):
        torch.testing.assert_close(sum(getattr(p, field) for p in parts), getattr(whole, field), atol=1e-5, rtol=1e-6)


def test_consecutive_ranks_of_a_group_get_the_same_batches_and_a_short_last_batch_is_left_out():
    batches = list(RepeatedBatches([4, 2, 7, 1, 3], batch_size=2, times=2))
    assert batches == [4, 2, 4, 2, 7, 1, 7, 1] and len(RepeatedBatches([4, 2, 7, 1, 3], 2, 2)) == 8
    # accelerate's dealing of batches to 4 ranks (2 groups of 2), batch k of the loader to rank k % 4
    loader = [batches[i:i + 2] for i in range(0, len(batches), 2)]
    ranks = {r: loader[r::4] for r in range(4)}
    assert ranks[0] == ranks[1] == [[4, 2]] and ranks[2] == ranks[3] == [[7, 1]]


def test_a_rank_gets_its_slice_of_the_positions():
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "position_ids": torch.tensor([[0, 1, 0, 1]]),
              "attention_mask": torch.ones(1, 4)}
    shard, columns = SequenceParallel(size=2, rank=1, group=None).shard(inputs)
    assert columns == (2, 4) and set(shard) == {"input_ids", "position_ids"}
    assert shard["input_ids"].tolist() == [[7, 8]] and shard["position_ids"].tolist() == [[0, 1]]


def features():
    return [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "sample_weight": 2.0, "source_line": 1},
            {"input_ids": [8, 9], "labels": [8, 9], "sample_weight": 1.0, "source_line": 2}]


def test_the_collator_pads_a_batch_to_split_evenly_with_positions_per_row(tokenizer):
    batch = WeightedDataCollator(tokenizer, sequence_parallel=4)(features())
    assert batch["input_ids"].shape == (2, 4)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert batch["weights"].tolist() == [[0.0, 2.0, 2.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


def test_the_collator_pads_a_packed_row_at_its_end_continuing_its_last_sample(tokenizer):
    batch = WeightedDataCollator(tokenizer, packing=True, sequence_parallel=4)(features())
    assert not any(k.startswith(("cu_seq_lens", "max_length")) for k in batch)  # they would describe the whole row
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9] + [tokenizer.pad_token_id] * 3]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]  # still two samples
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100]]
    assert batch["weights"].tolist() == [[0.0, 2.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("world, overrides, key, words", [
    ("1", [], "sp.size", "this run has 1: launch a multiple of 2"),
    ("2", ["sp.size=1"], "sp.size", "must be >= 2"),
    ("2", ["model.attn_implementation=eager"], "sp", "model.attn_implementation=eager cannot attend"),
    ("2", ["fsdp=full_shard"], "sp", "not under FSDP2"),
    ("2", ["model.tiled_mlp_tokens=64", "deepspeed=zero2"], "sp", "model.tiled_mlp_tokens"),
])
def test_a_combination_sequence_parallelism_cannot_run_is_one_config_error(monkeypatch, world, overrides, key, words):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ConfigError) as e:
        check(composed("sp=ulysses", *overrides))
    assert e.value.key == key and words in str(e.value)


def test_heads_that_do_not_split_over_the_ranks_are_refused_before_the_weights_are_built():
    config = AutoConfig.for_model("qwen2", num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    check_heads_split(config, 2)
    check_heads_split(config, 4)  # 2 key/value heads, each given to 2 ranks
    with pytest.raises(ConfigError, match="sp.size=3: splits the attention heads over 3 ranks: this model has 4"):
        check_heads_split(config, 3)
