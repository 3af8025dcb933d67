"""Merge a LoRA adapter into its base model for deployment.

    sft merge checkpoint=<run dir or checkpoint dir> output=<dir> [dtype=bfloat16]

The base model is the one named in the run's saved config (`.hydra/config.yaml`: `model.name_or_path`,
`tiny` included, or `model.gguf_file`), or `base=<hub id or dir>` (or `gguf_file=<file>`) to override. The output holds safetensors weights, the
tokenizer and its chat template, ready for `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf


@dataclass
class MergeConfig:
    checkpoint: str = "???"
    output: str = "???"
    base: Optional[str] = None  # default: model.name_or_path from the run's saved config
    gguf_file: Optional[str] = None  # default: model.gguf_file from the run's saved config (where base is not given)
    dtype: Optional[str] = None  # default: the run's model.dtype


class MergeError(ValueError):
    """A checkpoint that cannot be merged; the message says why."""


def adapter_dir(checkpoint: Path) -> Path:
    """The directory holding the adapter: the checkpoint itself, or a run dir's `model/`."""
    for candidate in (checkpoint, checkpoint / "model"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    if (checkpoint / "model.safetensors").exists() or (checkpoint / "model" / "model.safetensors").exists():
        raise MergeError(f"{checkpoint} holds a full model, not a LoRA adapter: there is nothing to merge")
    raise MergeError(f"{checkpoint}: no adapter_config.json here or in {checkpoint / 'model'}")


def run_config(adapter: Path):
    """The saved Hydra config of the run the adapter belongs to (looked up from the adapter dir upwards)."""
    for d in (adapter, *adapter.parents):
        saved = d / ".hydra" / "config.yaml"
        if saved.is_file():
            return OmegaConf.load(saved)
    return None


def merge(checkpoint: str, output: str, base: str | None = None, dtype: str | None = None,
          gguf_file: str | None = None) -> Path:
    """Load base + adapter, merge, and save a plain model with tokenizer and chat template."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from sft.model.loading import load_model

    adapter = adapter_dir(Path(checkpoint))
    saved = run_config(adapter)
    if base is None and gguf_file is None:
        if saved is None:
            raise MergeError(f"no .hydra/config.yaml above {adapter} to name the base model: pass base=<model>")
        base, gguf_file = saved.model.name_or_path, saved.model.get("gguf_file")
    dtype = dtype or (saved.model.dtype if saved is not None else "float32")
    if base is not None and gguf_file is None and base.startswith(("/", ".")) and not Path(base).is_dir():
        raise MergeError(f"the base model {base!r} does not exist (pass base=<hub id or dir>)")
    try:  # merging runs no attention
        model = load_model(base or "", dtype=dtype, attn_implementation=None, gguf_file=gguf_file)
    except (OSError, ValueError) as e:
        raise MergeError(f"cannot load the base model {gguf_file or base!r}: {str(e).splitlines()[0]}") from e
    merged = PeftModel.from_pretrained(model, str(adapter), torch_dtype=getattr(torch, dtype)).merge_and_unload()
    if (adapter / "generation_config.json").is_file():  # the stops training set (sft.model.serving)
        from transformers import GenerationConfig

        merged.generation_config = GenerationConfig.from_pretrained(str(adapter))
    out = Path(output)
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(adapter)).save_pretrained(out)
    return out
