"""Packed rows on models whose layers are not all attention (`sft.model.packing`): a training step on packed rows is
the padded rows' step, on every hybrid; what cannot be kept apart is refused before any data is read; and sequence
parallelism, which splits what such layers must see whole, is refused by name."""

import pytest
import torch
from architectures import HYBRID, MORE_HYBRIDS, tiny
from conftest import ROWS, fast_loop, run_train, train_steps

from sft.loss.builtin import CrossEntropyLoss

VOCAB = 768  # the tiny tokenizer's ids fit


@pytest.mark.parametrize("arch", fast_loop(sorted(HYBRID) + sorted(MORE_HYBRIDS),
                                           {"falcon_h1", "qwen3_next", "lfm2"}))  # Mamba-2, gated delta rule, conv
def test_a_step_on_packed_rows_is_the_step_on_padded_rows(tmp_path, tokenizer, arch):
    """The same 8 rows, one micro-batch, one SGD step: the same loss and the same weights after it, whether the rows
    are padded or packed into one (where transformers' PyTorch kernels would carry one sample's state into the next,
    or refuse)."""
    from sft.model.attention import register

    register()
    steps = {}
    for packing in (False, True):
        model = tiny(arch, tie=False, attn="sdpa_varlen", vocab_size=VOCAB)
        losses, params, _ = train_steps(tmp_path / str(packing), tokenizer, CrossEntropyLoss(), 8, 1, rows=ROWS,
                                        steps=1, packing=packing, model=model)
        steps[packing] = (losses, params)
    assert steps[True][0] == pytest.approx(steps[False][0], rel=1e-5)
    torch.testing.assert_close(steps[True][1], steps[False][1], atol=1e-6, rtol=1e-5)


def test_sequence_parallelism_is_refused_where_a_layer_carries_state(tmp_path):
    from sft.config import ConfigError
    from sft.model.loading import load_model

    tiny("qwen3_5_text", tie=False).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^sp.size=2: Qwen3_5ForCausalLM's Qwen3_5GatedDeltaNet carry state along the "
                                          r"sequence, which sequence parallelism splits over the ranks"):
        load_model(str(tmp_path), sequence_parallel=2)


HYBRID_CLI = ["+model.random_init.model_type=granitemoehybrid", "+model.random_init.layer_types=[mamba,attention]",
              "+model.random_init.num_hidden_layers=2", "+model.random_init.hidden_size=32",
              "+model.random_init.intermediate_size=64", "+model.random_init.vocab_size=768",
              "+model.random_init.num_attention_heads=4", "+model.random_init.num_key_value_heads=2",
              "+model.random_init.mamba_n_heads=4", "+model.random_init.mamba_d_head=16",
              "+model.random_init.mamba_d_state=8", "+model.random_init.mamba_chunk_size=8",
              "+model.random_init.num_local_experts=0", "+model.random_init.shared_intermediate_size=64"]


@pytest.mark.slow
def test_a_hybrid_from_the_command_line_trains_packed_and_eager_gpt_oss_is_refused_before_any_data(tmp_path):
    """A list in model.random_init reaches transformers' config as a list; packed rows train on Granite-4's mamba
    layers; gpt-oss under eager attention, whose mask transformers builds without the samples, is one line."""
    proc = run_train(*HYBRID_CLI, "data.packing=true", "trainer.max_steps=2", "trainer.eval_strategy=no",
                     "trainer.save_strategy=no", f"hydra.run.dir={tmp_path / 'hybrid'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GraniteMoeHybridMambaLayer keep the samples of a packed row apart" in (tmp_path / "hybrid" /
                                                                                  "train.log").read_text()
    gpt_oss = ["+model.random_init.model_type=gpt_oss", "+model.random_init.num_hidden_layers=2",
               "+model.random_init.hidden_size=32", "+model.random_init.intermediate_size=32",
               "+model.random_init.vocab_size=768", "+model.random_init.num_attention_heads=4",
               "+model.random_init.num_key_value_heads=2", "+model.random_init.head_dim=8",
               "+model.random_init.num_local_experts=4", "+model.random_init.num_experts_per_tok=2"]
    proc = run_train(*gpt_oss, "model.attn_implementation=eager", "data.packing=true",
                     f"hydra.run.dir={tmp_path / 'gpt_oss'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: config: data.packing=True: GptOssForCausalLM (attention: eager) lets the "
                                  "samples of a packed row see each other")
    assert "tokenising" not in proc.stderr  # refused before any data was read
