"""`sft merge`: the merged model gives the adapter model's logits; bad inputs get clear errors."""

import json
import subprocess
import sys

import pytest
import torch
from architectures import ARCHITECTURES, MOE, batch, tiny
from conftest import REPO, fast_loop, run_train
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize("arch", fast_loop(sorted(ARCHITECTURES), {"qwen2", "phi3", "qwen3_next", "gpt_oss"}))
def test_sft_merge_gives_the_logits_of_base_plus_adapter(tmp_path, arch, tokenizer):
    from sft.config import compose
    from sft.model.lora import apply_lora
    from sft.model.merge import merge

    tiny(arch, tie=False).save_pretrained(tmp_path / "base")
    overrides = ["lora=default"] + (["lora.lora_dropout=0"] if arch in MOE else [])
    peft = apply_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager"),
                      compose("train", overrides).lora)
    with torch.no_grad():  # lora_B starts at zero: give the adapter something to merge
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    merge(str(tmp_path / "adapter"), str(tmp_path / "merged"), base=str(tmp_path / "base"), dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        expected = peft.eval()(input_ids=ids, attention_mask=mask).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
        assert not torch.allclose(base(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-3)
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_lora_run_saves_an_adapter_that_merges_to_the_logits_of_base_plus_adapter(tmp_path):
    run = tmp_path / "run"
    proc = run_train("lora=default", "loss=hard_sample", "loss.alpha=2", "trainer.max_steps=3",
                     "trainer.learning_rate=5e-2", "trainer.eval_steps=100", "trainer.save_steps=100",
                     f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "model" / "adapter_model.safetensors").exists() and not (run / "model" / "model.safetensors").exists()
    assert json.loads((run / "results.json").read_text())["global_step"] == 3
    merged = subprocess.run([sys.executable, "-m", "sft", "merge", f"checkpoint={run}", f"output={tmp_path / 'merged'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr[-3000:]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft.model.loading import load_model

    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    peft = PeftModel.from_pretrained(load_model("tiny"), run / "model").eval()
    with torch.no_grad():
        a, b = plain(ids).logits, peft(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    with torch.no_grad():
        base = load_model("tiny").eval()(ids).logits
    assert (a - base).abs().max() > 1e-3, "the adapter changed nothing: the test would not see a failed merge"
    assert_server_layouts(run / "model", tmp_path / "merged", tok)


def assert_server_layouts(adapter, merged, tok):
    """The adapter and the merged model as vLLM, SGLang and TGI read them (issue 31): the adapter's config names the
    decoder's linear layers and carries no modules_to_save; both stop where answers were trained to end; the merged
    model's safetensors hold the dtype its config states, PyTorch format metadata, and its tokenizer the template."""
    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig

    from sft.model.serving import eos_ids

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["modules_to_save"] is None and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}  # all-linear, as PEFT names them in the file
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    for folder in (adapter, merged):
        assert stop in eos_ids(GenerationConfig.from_pretrained(folder)), folder
    with safe_open(merged / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"F32"} and AutoConfig.from_pretrained(merged).dtype == torch.float32
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("args, message", [
    (["checkpoint={full}", "output={out}"], "holds a full model, not a LoRA adapter"),
    (["checkpoint={lora}", "output={out}", "base=/no/such/model"], "does not exist"),
    (["checkpoint={lora}"], "Missing mandatory value: output"),
])
def test_merge_errors_are_clear(tmp_path, capsys, args, message):
    from sft.commands.merge import main

    full, lora = tmp_path / "full", tmp_path / "lora"
    (full / "model").mkdir(parents=True)
    (full / "model" / "model.safetensors").write_bytes(b"")
    lora.mkdir()
    (lora / "adapter_config.json").write_text("{}")
    argv = [a.format(full=full, lora=lora, out=tmp_path / "out") for a in args]
    with pytest.raises(SystemExit) as e:  # sft merge's main, in this process
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
