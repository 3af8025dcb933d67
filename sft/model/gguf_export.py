"""A fine-tuned model as one GGUF file that llama.cpp, Ollama and LM Studio load (`sft export gguf`), written by
llama.cpp's own converter and quantizer, never by code of this project, with an Ollama `Modelfile` beside it.

    export("outputs/examples/identity", "identity.gguf", "q4_k_m")
        -> identity.gguf: the weights, the tokenizer, the chat template saved with the run (its kwargs as the
           template's defaults, `sft.model.serving`), the stop tokens the model ends its answers with;
           Modelfile: FROM ./identity.gguf, one PARAMETER stop per stop token

1. The model as a Hugging Face dir (`model_dir`): a full model as it was saved; a LoRA adapter merged into its base
   first (`sft.model.merge`, whose merged dir carries the generation config's stops and the tokenizer).
2. llama.cpp's `convert_hf_to_gguf.py` (`converter`) writes f32, f16, bf16 or q8_0: from `--llama-cpp <checkout>`,
   else from the source distribution of the pinned llama-cpp-python (its `vendor/llama.cpp`), fetched with pip once
   into the sft cache. It refuses what it cannot write (an architecture, a tokenizer it does not know): one line.
3. Any other type (q4_k_m, q5_k_m, q6_k, ...) is quantized from an f16 file by llama.cpp's quantizer through
   llama-cpp-python, installed the first time a quantized type is asked for (`sft.model.packages`; or
   `pip install 'sft[gguf]'`).

The file appears complete or not at all: it is written beside its place and renamed into it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from sft.model.packages import LLAMA_CPP_PYTHON, ON_DEMAND, ensure

CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes itself
QUANTIZED_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s",
                   "q5_k_m", "q6_k")  # llama.cpp's quantizer, from f16 (LLAMA_FTYPE_MOSTLY_<TYPE>)
OUTTYPES = CONVERTER_TYPES + QUANTIZED_TYPES


class ExportError(ValueError):
    """A model that cannot be exported, or a tool that is missing; the message says why and what to do."""


def export(source: str | Path, out: str | Path, outtype: str = "q8_0", llama_cpp: str | None = None,
           base: str | None = None) -> Path:
    """Write `source` (a run dir, a checkpoint, a merged or full model dir) as the GGUF file `out` of `outtype`, and
    a `Modelfile` beside it; return the file."""
    if outtype not in OUTTYPES:
        raise ExportError(f"--outtype {outtype!r}: must be one of {', '.join(OUTTYPES)}")
    if not Path(source).exists():
        raise ExportError(f"{source} does not exist (a run dir, a checkpoint or a model dir)")
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    script = converter(llama_cpp)
    if outtype in QUANTIZED_TYPES:
        quantizer()  # before any work: a missing quantizer is said at once
    with tempfile.TemporaryDirectory(prefix=".sft-export-", dir=out.parent) as work:
        hf = model_dir(Path(source), Path(work), base)
        written, described = Path(work, out.name), Path(work, "metadata.json")
        fields = metadata(Path(source), hf)
        staged = staged_dir(hf, Path(work, "staged"), fields.pop("general.license", None))
        described.write_text(json.dumps(fields))
        if outtype in CONVERTER_TYPES:
            convert(script, staged, written, outtype, described)
        else:
            convert(script, staged, Path(work, "f16.gguf"), "f16", described)
            quantize(Path(work, "f16.gguf"), written, outtype)
        stops = stop_tokens(hf)
        os.replace(written, out)
    (out.parent / "Modelfile").write_text(modelfile(out, stops))
    return out


def model_dir(source: Path, work: Path, base: str | None = None) -> Path:
    """`source` as a Hugging Face model dir: its full model (a run dir's `model/`, a checkpoint, a merged dir), or its
    LoRA adapter merged into the base model into `work`."""
    from sft.model.merge import MergeError, adapter_dir, merge

    for candidate in (source, source / "model"):
        if (candidate / "adapter_config.json").is_file():
            try:
                return merge(str(adapter_dir(candidate)), str(work / "merged"), base)
            except MergeError as e:
                raise ExportError(f"merging the LoRA adapter first: {e}") from None
        if (candidate / "config.json").is_file() and any(candidate.glob("*.safetensors")):
            return candidate
    raise ExportError(f"{source}: no model here or in {source / 'model'} (config.json and safetensors weights, or a "
                      "LoRA adapter)")


def metadata(source: Path, hf: Path) -> dict:
    """The GGUF's general metadata (llama.cpp's `--metadata` keys): the run's name, fine-tuned by sft, its base model;
    the license and source of a base read from a GGUF file carried over (the license goes to the model card the
    converter reads: `staged_dir`)."""
    from sft.model.merge import run_config

    run = source if source.name not in ("model", "merged") else source.parent
    described = {"general.name": run.resolve().name, "general.finetune": "sft"}
    saved = run_config(source if source.is_dir() else source.parent)
    base = (saved.model.get("gguf_file") or saved.model.name_or_path) if saved is not None else None
    if base:
        described["general.base_models"] = [{"name": Path(str(base)).name}]
    if saved is not None and saved.model.get("gguf_file"):
        from sft.model.gguf import find_gguf

        try:
            fields = gguf_fields(find_gguf(saved.model.gguf_file, saved.model.name_or_path))
        except (OSError, ValueError):
            fields = {}
        for key in ("general.license", "general.license.name", "general.license.link", "general.source.url",
                    "general.source.repo_url", "general.url", "general.repo_url"):
            if key in fields:
                described[key] = fields[key]
        if "general.name" in fields:
            described["general.base_models"] = [{"name": fields["general.name"],
                                                 **({"repo_url": fields["general.repo_url"]}
                                                    if "general.repo_url" in fields else {})}]
    return described


def staged_dir(hf: Path, staged: Path, license: str | None) -> Path:
    """`hf` as the converter reads it: its files linked into `staged`, with a model card carrying `license` where `hf`
    has none (llama.cpp takes a license from the card only, not from `--metadata`); `hf` itself is left as it is."""
    staged.mkdir()
    for path in hf.iterdir():
        (staged / path.name).symlink_to(path.resolve())
    if license and not (hf / "README.md").exists():
        (staged / "README.md").write_text(f"---\nlicense: {license}\n---\n")
    return staged


def gguf_fields(path: Path) -> dict:
    """A GGUF file's string metadata (`gguf`'s reader)."""
    from gguf import GGUFReader, GGUFValueType

    fields = {}
    for key, field in GGUFReader(str(path)).fields.items():
        if field.types == [GGUFValueType.STRING]:
            fields[key] = field.contents()
    return fields


def stop_tokens(hf: Path) -> list[str]:
    """The texts of the tokens the model at `hf` ends its answers with: its generation config's eos ids, which
    training set (`sft.model.serving`), else the tokenizer's eos."""
    from transformers import AutoTokenizer, GenerationConfig

    from sft.model.serving import eos_ids

    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    ids = eos_ids(GenerationConfig.from_pretrained(str(hf))) if (hf / "generation_config.json").is_file() else []
    return [tokenizer.convert_ids_to_tokens(i) for i in ids or [tokenizer.eos_token_id] if i is not None]


def modelfile(gguf: Path, stops: list[str]) -> str:
    """An Ollama Modelfile for `gguf` (it sits beside it): `ollama create <name> -f Modelfile`. Ollama reads the chat
    template from the file; the stops are said again, as Ollama stops only at those it is given.

        modelfile(Path("identity.gguf"), ["<|endoftext|>", "<|im_end|>"])
            -> 'FROM ./identity.gguf\nPARAMETER stop "<|endoftext|>"\nPARAMETER stop "<|im_end|>"\n'
    """
    return "\n".join([f"FROM ./{gguf.name}", *(f"PARAMETER stop {json.dumps(s)}" for s in dict.fromkeys(stops))]) + "\n"


def converter(llama_cpp: str | None = None) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`: in the checkout `llama_cpp`, else in the sft cache, fetched there once
    from llama-cpp-python's source distribution (pip download, then only the converter, its `conversion` package and
    its `gguf-py` taken out of it)."""
    from sft.cache import cache_dir

    if llama_cpp is not None:
        script = Path(llama_cpp) / "convert_hf_to_gguf.py"
        if not script.is_file():
            raise ExportError(f"--llama-cpp {llama_cpp}: no convert_hf_to_gguf.py there (a llama.cpp checkout)")
        return script
    cached = cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (cached / "convert_hf_to_gguf.py").is_file():
        return cached / "convert_hf_to_gguf.py"
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                               f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode or not sdists:
            reason = (proc.stderr.strip().splitlines() or ["no source distribution"])[-1]
            raise ExportError(f"cannot fetch llama.cpp's converter (pip download llama-cpp-python=={LLAMA_CPP_PYTHON}: "
                              f"{reason}): pass --llama-cpp <a llama.cpp checkout>")
        prefix = f"{sdists[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
        with tarfile.open(sdists[0]) as sdist:
            members = [m for m in sdist.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(wanted) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            sdist.extractall(Path(tmp, "llama.cpp"), members=members, filter="data")
        os.replace(Path(tmp, "llama.cpp"), cached)  # whole or absent
    return cached / "convert_hf_to_gguf.py"


def convert(script: Path, hf: Path, out: Path, outtype: str, described: Path) -> None:
    """llama.cpp's converter, `hf` -> `out` in `outtype`, with the metadata file `described` (its `--metadata`); its
    refusal (an architecture or tokenizer it does not know) as one line."""
    proc = subprocess.run([sys.executable, str(script), str(hf), "--outfile", str(out), "--outtype", outtype,
                           "--metadata", str(described)], capture_output=True, text=True)
    if proc.returncode or not out.is_file():
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        cause = next((line for line in reversed(lines) if "Error" in line or "not supported" in line),
                     lines[-1] if lines else f"exit {proc.returncode}")
        architecture = json.loads((hf / "config.json").read_text()).get("architectures", ["?"])[0]
        raise ExportError(f"llama.cpp's converter cannot write this model ({architecture}): "
                          f"{cause.split('ERROR:', 1)[-1].strip()[:300]}")


def quantizer():
    """llama-cpp-python's bindings of llama.cpp (the quantizer), installed the first time they are needed
    (`sft.model.packages`: it builds llama.cpp), or the error naming the extra that installs them."""
    why = ensure(ON_DEMAND["llama_cpp"])
    try:
        import llama_cpp
    except ImportError as e:
        raise ExportError(f"quantized types need llama.cpp's quantizer through llama-cpp-python ({why or e}): "
                          f"{ON_DEMAND['llama_cpp'].command} (or pip install 'sft[gguf]'), or --outtype one of "
                          f"{', '.join(CONVERTER_TYPES)}") from None
    return llama_cpp


def quantize(source: Path, out: Path, outtype: str) -> None:
    """llama.cpp's `llama_model_quantize`: `source` (f16) -> `out` in `outtype`."""
    import ctypes

    llama_cpp = quantizer()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{outtype.upper()}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise ExportError(f"llama.cpp's quantizer failed on {source.name} to {outtype}")
