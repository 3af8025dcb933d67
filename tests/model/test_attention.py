"""Packed rows (`sft.model.attention`): each sample gets the logits it gets alone, on every architecture; an attention
the architecture lacks is a config error."""

import pytest
import torch
from architectures import ARCHITECTURES, EAGER_PACKING_REFUSED, NO_SDPA, tiny

from sft.data.tokens.collator import WeightedDataCollator
from sft.model.attention import register as register_sdpa_varlen
from sft.model.loading import load_model

@pytest.mark.parametrize("arch, attn", [(a, attn) for a in sorted(ARCHITECTURES) for attn in ("eager", "sdpa_varlen")
                                        if not (attn == "sdpa_varlen" and a in NO_SDPA)])
def test_each_sample_of_a_packed_row_gets_its_logits_alone(arch, attn):
    """Attention and every layer that carries state (state-space, delta rule, convolution: sft.model.packing) keep
    the samples of a packed row apart, or packing is refused before any data is read."""
    from sft.config import ConfigError
    from sft.data.tokens.collator import WeightedDataCollator
    from sft.model.packing import check_packing

    register_sdpa_varlen()
    model = tiny(arch, tie=False, attn=attn).eval()
    if attn == "eager" and arch in EAGER_PACKING_REFUSED:  # transformers' eager mask ignores the samples there
        with pytest.raises(ConfigError, match=r"^data.packing=True: \w+ForCausalLM \(attention: eager\) lets the samples "
                                              r"of a packed row see each other: .* train padded rows"):
            check_packing(model)
        return
    assert check_packing(model) < 1e-4
    reference = tiny(arch, tie=False, attn="eager").eval()  # the same weights; transformers' own masks
    torch.manual_seed(2)
    samples = [torch.randint(3, 128, (n,)).tolist() for n in (9, 6, 11)]
    feats = [{"input_ids": s, "labels": s, "sample_weight": 1.0, "source_line": i} for i, s in enumerate(samples)]
    packed = WeightedDataCollator(tokenizer=None, packing=True)(feats)
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    with torch.no_grad():
        logits = model(**{k: packed[k] for k in keys}, use_cache=False).logits[0]
        alone = [reference(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]
        unpacked = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]
    torch.testing.assert_close(logits, torch.cat(alone), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(unpacked), torch.cat(alone), atol=1e-4, rtol=1e-4)


def test_an_attention_the_architecture_lacks_is_a_config_error_naming_the_alternative(tmp_path):
    from sft.config import ConfigError
    from sft.model.loading import load_model

    tiny("gemma2", tie=False).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"model.attn_implementation='sdpa': Gemma2ForCausalLM does not support an "
                                          r"attention implementation .* use eager"):
        load_model(str(tmp_path), attn_implementation="sdpa")


@pytest.mark.parametrize("attn, boundaries", [("sdpa", True), ("eager", True), ("sdpa_varlen", True),
                                              ("sdpa_varlen", False), ("sdpa_slots", True),
                                              pytest.param("flex_attention", False, marks=pytest.mark.slow)])
def test_no_attention_leaks_across_packed_samples(tokenizer, attn, boundaries):
    """flex_attention: transformers' document mask, from the samples' positions (a lever for GPUs, issue 60; its
    forward runs on a CPU, its backward does not: test_flex_attention_trains_only_on_a_gpu)."""
    model = load_model("tiny", attn_implementation=attn).eval()
    # each sample alone through sdpa (the same weights): another kernel as the reference, and one shape for
    # flex_attention's compiled kernels on a CPU instead of four
    reference = load_model("tiny", attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    a, b, c = (torch.randint(10, 300, (n,)).tolist() for n in (9, 6, 11))
    feats = [{"input_ids": s, "labels": s, "sample_weight": 1.0, "source_line": i} for i, s in enumerate((a, b, c))]
    collate = WeightedDataCollator(tokenizer, packing=True)
    packed = collate(feats)
    changed = collate([{**feats[0], "input_ids": [7] * 9}, *feats[1:]])  # another first sample
    keys = ("input_ids", "position_ids") + (
        ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k") if boundaries else ())
    with torch.no_grad():  # no KV cache: as in training, where transformers then reads the packing from position_ids
        logits = model(**{k: packed[k] for k in keys}, use_cache=False).logits[0]
        logits_changed = model(**{k: changed[k] for k in keys}, use_cache=False).logits[0]
        alone = [reference(input_ids=torch.tensor([s])).logits[0] for s in (a, b, c)]
    # Each sample's logits are those it gets alone, so nothing flows in from the samples packed before it.
    torch.testing.assert_close(logits[:9], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[9:15], alone[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[15:], alone[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_changed[9:], logits[9:], atol=1e-6, rtol=0)
    assert (logits_changed[:9] - logits[:9]).abs().max() > 1e-2  # the test can see a difference


@pytest.mark.parametrize("arch, attn, leaks", [("llama", "sdpa_varlen", False), ("gpt_oss", "eager", True)])
def test_the_packing_probe_tells_a_leak_from_the_rounding_of_half_precision_kernels(arch, attn, leaks):
    """On a GPU in bf16 a deep model's padded and packed logits differ by the kernels' rounding (another GEMM tiling
    for another shape) far above 1e-3 of their scale, for every sample alike: 0.22 on Qwen2.5-7B's shape, which
    once refused packing on an H200. The rounding is imitated here by noise that depends on the batch's shape; a
    model that keeps the samples apart is accepted under it, and one that lets them see each other still refused."""
    from sft.config import ConfigError
    from sft.model.packing import check_packing

    register_sdpa_varlen()
    model = tiny(arch, tie=False, attn=attn).eval()

    def shape_rounding(module, inputs, output):  # what another kernel's rounding does: the same for every sample
        g = torch.Generator().manual_seed(output.shape[0])
        return output + 0.005 * output.abs().max() * torch.randn(output.shape, generator=g)

    model.get_output_embeddings().register_forward_hook(shape_rounding)
    if leaks:
        with pytest.raises(ConfigError, match=r"see each other: .* \(the first sample's, rounding alone: "):
            check_packing(model)
    else:
        assert check_packing(model) > 1e-3  # the rounding is there, and it is not taken for a leak


def test_flex_attention_trains_only_on_a_gpu(monkeypatch):
    """Without CUDA its backward is PyTorch's NotImplementedError at the first step: one config error before."""
    import sft.model.loading
    from conftest import composed

    from sft.config import ConfigError, check

    monkeypatch.setattr(sft.model.loading, "cuda_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check(composed("model.attn_implementation=flex_attention", "data.packing=true"))
    assert str(e.value) == ("model.attn_implementation='flex_attention': trains only on a CUDA GPU: PyTorch's "
                            "FlexAttention has no backward on a CPU (torch 2.13); use sdpa (with data.packing=true: "
                            "sdpa_varlen)")
    monkeypatch.setattr(sft.model.loading, "cuda_available", lambda: True)
    check(composed("model.attn_implementation=flex_attention", "data.packing=true"))


def test_a_packed_rows_slots_are_built_once_a_forward_for_every_layer(tokenizer, monkeypatch):
    """The samples' boundaries come once a micro-batch from the collator, and the slots' index is built by the first
    layer and reused by the others (it was rebuilt in each of a 7B's 28 layers); another micro-batch gets its own."""
    import sft.model.attention

    built = []
    real = sft.model.attention.packed_slots
    monkeypatch.setattr(sft.model.attention, "packed_slots", lambda *a: built.append(a) or real(*a))
    model = load_model("tiny", attn_implementation="sdpa_varlen").eval()
    collate = WeightedDataCollator(tokenizer, packing=True)
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    with torch.no_grad():
        for lengths in ((9, 6, 11), (4, 12)):
            feats = [{"input_ids": list(range(10, 10 + n)), "labels": list(range(10, 10 + n)), "sample_weight": 1.0,
                      "source_line": i} for i, n in enumerate(lengths)]
            batch = collate(feats)
            model(**{k: batch[k] for k in keys}, use_cache=False)
    assert model.config.num_hidden_layers > 1 and len(built) == 2  # one a forward, not one a layer
