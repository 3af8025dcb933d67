"""`sft export gguf` (`sft.model.gguf_export`): what llama.cpp itself makes of the file, against transformers' own
model; errors in one line. The converter comes from llama-cpp-python's source distribution (fetched once into the
sft cache: the package registry must be reachable, or the test says why it skips), the quantizer and the check from
llama-cpp-python itself (./launch.sh installs it)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from architectures import ARCHITECTURES, SHAPE
from conftest import REPO

from sft.model.gguf_export import ExportError, export, modelfile

# The families llama.cpp's converter writes, each as a tiny random model carrying SmolLM2's real tokenizer (the
# converter knows a tokenizer by a hash of what it makes of a test text: the project's own tiny tokenizer it does not).
# As the published models are: no sliding window on Mistral (v0.2 on); on Gemma-3 no final softcapping, and the
# attention scaled by the head size (llama.cpp reads no query_pre_attn_scalar: Gemma-3's models set it so, but 27B's,
# which llama.cpp scales by its own rule). Qwen2/2.5 is not among them: for a `qwen2` config transformers reads any
# tokenizer as its `Qwen2Tokenizer`, whose pre-tokenizer makes of SmolLM2's vocabulary a tokenizer llama.cpp knows no
# hash of (refused in one line: below); Qwen's own tokenizer, which no package here carries, it knows ("qwen2").
FAMILIES = {"llama": {}, "qwen3": {}, "mistral": {"sliding_window": None},
            "gemma3_text": {"final_logit_softcapping": None, "query_pre_attn_scalar": SHAPE["head_dim"]}}


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'sft[gguf]'; "
                                                   "./launch.sh installs it)")


@pytest.fixture(scope="module")
def converter():
    from sft.model.gguf_export import converter

    try:
        return converter()
    except ExportError as e:
        pytest.skip(str(e))


def tiny_model_dir(model_type: str, tokenizer_dir, out, fields: dict | None = None):
    """A tiny random model of `model_type` with SmolLM2's tokenizer and chat template, saved as a Hugging Face dir;
    its output layer scaled so that its logits spread as a trained model's do (a weak check otherwise)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    fields = FAMILIES[model_type] if fields is None else fields
    config = AutoConfig.for_model(model_type, **{**SHAPE, **ARCHITECTURES[model_type], **fields,
                                                 "vocab_size": len(tokenizer)})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_f32_export_gives_transformers_next_token_logits_in_llama_cpp(tmp_path, model_type, smollm2_dir,
                                                                         converter, llama_cpp):
    model, tokenizer = tiny_model_dir(model_type, smollm2_dir, tmp_path / "model")
    out = export(tmp_path / "model", tmp_path / "model.gguf", "f32")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(out), logits_all=True, n_ctx=64, verbose=False)
    assert llm.tokenize(tokenizer.decode(ids).encode(), add_bos=False, special=True) == ids  # the same tokens
    llm.eval(ids)
    got = np.asarray(llm.scores[:len(ids)])
    scale = float(np.abs(expected).max())
    # f32 both ways, other kernels (llama.cpp's own matmuls and attention): within 1e-3 of the logits' scale
    assert float(np.abs(got - expected).max()) < 1e-3 * scale, (model_type, float(np.abs(got - expected).max()), scale)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.slow
def test_the_f16_export_trains_again_from_the_same_first_eval_loss(tmp_path, smollm2_dir, converter):
    """The exported file read back by sft (`model.gguf_file=`): its first evaluation equals the model it came from,
    within f16's rounding of the weights."""
    from conftest import run_train

    tiny_model_dir("llama", smollm2_dir, tmp_path / "model")
    out = export(tmp_path / "model", tmp_path / "model-f16.gguf", "f16")
    losses = {}
    for name, model in (("hf", [f"model.name_or_path={tmp_path / 'model'}", "model.gguf_file=null"]),
                        ("gguf", [f"model.gguf_file={out}"])):
        run_dir = tmp_path / name
        proc = run_train("model=smollm2_135m", *model, "trainer.max_steps=1", "trainer.eval_steps=100",
                         "trainer.save_strategy=no", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = json.loads((run_dir / "results.json").read_text())["eval_loss_initial"]
    assert losses["gguf"] == pytest.approx(losses["hf"], rel=1e-3), losses


@pytest.mark.slow
def test_a_tokenizer_the_converter_does_not_know_is_refused_in_one_line(tmp_path, smollm2_dir, converter):
    tiny_model_dir("qwen2", smollm2_dir, tmp_path / "model", {})
    proc = subprocess.run([sys.executable, "-m", "sft", "export", "gguf", str(tmp_path / "model"), "--outtype", "f16"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: llama.cpp's converter cannot write this model (Qwen2ForCausalLM): NotImplementedError: BPE "
        "pre-tokenizer was not recognized - update get_vocab_base_pre()")
    assert not list(tmp_path.glob("model/*.gguf")) and not list(tmp_path.glob("model/.sft-export-*"))  # nothing left


def test_the_modelfile_names_the_file_beside_it_and_every_stop_once(tmp_path):
    from pathlib import Path

    assert modelfile(Path("/x/identity.gguf"), ["<|im_end|>", "<|endoftext|>", "<|im_end|>"]) == (
        'FROM ./identity.gguf\nPARAMETER stop "<|im_end|>"\nPARAMETER stop "<|endoftext|>"\n')


@pytest.mark.parametrize("args, message", [
    (["gguf", "nowhere", "--outtype", "f16"], "error: nowhere does not exist (a run dir, a checkpoint or a model dir)"),
    (["gguf", ".", "--llama-cpp", "sft", "--outtype", "f16"],
     "error: --llama-cpp sft: no convert_hf_to_gguf.py there (a llama.cpp checkout)"),
])
def test_export_errors_are_one_line(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "sft", "export", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"SFT_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr


def test_a_quantized_type_without_llama_cpp_python_names_the_extra(monkeypatch, tmp_path):
    import builtins

    from sft.model import gguf_export

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(
        "No module named 'llama_cpp'")) if name == "llama_cpp" else real_import(name, *a, **k))
    monkeypatch.setattr(gguf_export, "converter", lambda llama_cpp=None: tmp_path / "convert_hf_to_gguf.py")
    with pytest.raises(ExportError, match=r"quantized types need llama.cpp's quantizer through llama-cpp-python .*"
                                          r"pip install llama-cpp-python==0.3.36 \(or pip install 'sft\[gguf\]'\), or "
                                          r"--outtype one of f32, f16, bf16, q8_0"):
        export(tmp_path, tmp_path / "m.gguf", "q4_k_m")


def test_without_the_converter_and_no_index_to_fetch_it_the_error_names_the_way_out(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sft", "export", "gguf", ".", "--outtype", "f16"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={"SFT_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1",
                               "PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: cannot fetch llama.cpp's converter (pip download llama-cpp-python==0.3.36: ")
    assert proc.stderr.strip().endswith("): pass --llama-cpp <a llama.cpp checkout>")
    assert not list(tmp_path.glob("llama.cpp-*"))  # nothing half-extracted left in the cache


def test_the_metadata_names_the_run_and_carries_a_gguf_bases_license_and_source_over(tmp_path):
    """What the converter's `--metadata` gets: the run's name, sft as the fine-tuner, the base model; from a base
    read from a GGUF file (model=smollm2_135m's kind), its name, license and source."""
    import gguf
    from omegaconf import OmegaConf

    from sft.model.gguf_export import metadata

    writer = gguf.GGUFWriter(str(tmp_path / "base.gguf"), "llama")
    writer.add_name("Base Model 1B")
    writer.add_license("apache-2.0")
    writer.add_repo_url("https://example.org/base")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    run = tmp_path / "quill"
    (run / ".hydra").mkdir(parents=True)
    (run / "model").mkdir()
    OmegaConf.save({"model": {"name_or_path": "org/base", "gguf_file": str(tmp_path / "base.gguf")}},
                   run / ".hydra" / "config.yaml")
    assert metadata(run / "model", run / "model") == {
        "general.name": "quill", "general.finetune": "sft", "general.license": "apache-2.0",
        "general.repo_url": "https://example.org/base",
        "general.base_models": [{"name": "Base Model 1B", "repo_url": "https://example.org/base"}]}
    OmegaConf.save({"model": {"name_or_path": "Qwen/Qwen2.5-7B-Instruct", "gguf_file": None}},
                   run / ".hydra" / "config.yaml")
    assert metadata(run, run / "model") == {"general.name": "quill", "general.finetune": "sft",
                                            "general.base_models": [{"name": "Qwen2.5-7B-Instruct"}]}
    # the license reaches the converter through a model card in a dir of links; the model's own dir stays untouched
    from sft.model.gguf_export import staged_dir

    (run / "model" / "config.json").write_text("{}")
    staged = staged_dir(run / "model", tmp_path / "staged", "apache-2.0")
    assert (staged / "README.md").read_text() == "---\nlicense: apache-2.0\n---\n"
    assert (staged / "config.json").resolve() == (run / "model" / "config.json").resolve()
    assert sorted(p.name for p in (run / "model").iterdir()) == ["config.json"]
