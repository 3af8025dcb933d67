"""Padding-free packing: the samples of a packed row do not see each other."""

import pytest
import torch

from sft.data.collator import WeightedDataCollator
from sft.model.loading import load_model


@pytest.mark.parametrize("attn, boundaries", [("sdpa", True), ("eager", True), ("sdpa_varlen", True),
                                              ("sdpa_varlen", False)])
def test_no_attention_leaks_across_packed_samples(tokenizer, attn, boundaries):
    model = load_model("tiny", attn_implementation=attn).eval()
    torch.manual_seed(0)
    a, b, c = (torch.randint(10, 300, (n,)).tolist() for n in (9, 6, 11))
    feats = [{"input_ids": s, "labels": s, "loss_weight": 1.0, "source_line": i} for i, s in enumerate((a, b, c))]
    collate = WeightedDataCollator(tokenizer, packing=True)
    packed = collate(feats)
    changed = collate([{**feats[0], "input_ids": [7] * 9}, *feats[1:]])  # another first sample
    keys = ("input_ids", "position_ids") + (
        ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k") if boundaries else ())
    with torch.no_grad():  # no KV cache: as in training, where transformers then reads the packing from position_ids
        logits = model(**{k: packed[k] for k in keys}, use_cache=False).logits[0]
        logits_changed = model(**{k: changed[k] for k in keys}, use_cache=False).logits[0]
        alone = [model(input_ids=torch.tensor([s])).logits[0] for s in (a, b, c)]
    # Each sample's logits are those it gets alone, so nothing flows in from the samples packed before it.
    torch.testing.assert_close(logits[:9], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[9:15], alone[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[15:], alone[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_changed[9:], logits[9:], atol=1e-6, rtol=0)
    assert (logits_changed[:9] - logits[:9]).abs().max() > 1e-2  # the test can see a difference
