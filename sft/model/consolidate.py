"""Sharded model state (DCP, as FSDP2's sharded checkpoints hold it) as a model transformers and every server load:
safetensors files of at most `max_file_bytes` each, with their index, beside the config and tokenizer.

One process, no GPU and no process group: the shards are read a file's worth of tensors at a time (DCP loads just the
tensors asked for, from every rank's file), so memory stays near one output file whatever the model's size:

    checkpoint-8/pytorch_model_fsdp_0/{.metadata, __0_0.distcp, __1_0.distcp}   {"model": {fqn: shard}}
        -> out/model.safetensors (or model-00001-of-00003.safetensors ... + model.safetensors.index.json)

A tied weight (an output layer that is the input embedding) is written once, as `save_pretrained` does.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

FILE_BYTES = 5 * 2**30  # transformers' own default shard size for save_pretrained
PREFIX = "model."  # the shards' keys: accelerate saves {"model": state_dict}, flattened by DCP


class ConsolidateError(Exception):
    pass


def tensors_of(shards: Path) -> dict:
    """fqn -> (shape, dtype) of every tensor in a DCP dir."""
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(shards)).read_metadata()
    except (OSError, ValueError, RuntimeError) as e:
        raise ConsolidateError(f"{shards}: no readable DCP metadata ({type(e).__name__}: {e})") from None
    return {key: (tuple(m.size), m.properties.dtype) for key, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def tied_copies(model, names) -> set[str]:
    """Of the tensor `names` (a state dict's), those that are copies of another of them by `model`'s tied weights (a
    tied output layer): what `save_pretrained` leaves out, as a gathered state dict carries both.

        model ties lm_head.weight to embed_tokens.weight, names {"...embed_tokens.weight", "lm_head.weight"}
          -> {"lm_head.weight"}
    """
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {name for name, source in tied.items() if name in names and source in names}


def tied_copies_by_config(config_dir: Path, names: set[str]) -> set[str]:
    """`tied_copies` of the model a config dir describes (built on the meta device); none without a config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (config_dir / "config.json").is_file():
        return set()
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return tied_copies(model, names)


def file_groups(sizes: dict[str, int], max_file_bytes: int) -> list[list[str]]:
    """Names in order, cut into groups of at most `max_file_bytes` (a larger tensor alone in its group).

        {"a": 3, "b": 3, "c": 5}, 6  ->  [["a", "b"], ["c"]]
    """
    groups, total = [[]], 0
    for name, size in sizes.items():
        if groups[-1] and total + size > max_file_bytes:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size
    return groups


def consolidate(shards: str | os.PathLike, out: str | os.PathLike, config_dir: str | os.PathLike | None = None,
                max_file_bytes: int = FILE_BYTES) -> list[Path]:
    """Write the model in the DCP dir `shards` as safetensors into `out`; copy the config, generation config and
    tokenizer files from `config_dir` (a checkpoint dir). Returns the safetensors files written."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    shards, out = Path(shards), Path(out)
    config_dir = Path(config_dir) if config_dir is not None else shards.parent
    tensors = {key[len(PREFIX):]: spec for key, spec in tensors_of(shards).items() if key.startswith(PREFIX)}
    if not tensors:
        raise ConsolidateError(f"{shards}: no model tensors (keys under '{PREFIX}')")
    for name in tied_copies_by_config(config_dir, set(tensors)):
        del tensors[name]
    sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, (shape, dtype) in tensors.items()}
    groups = file_groups(sizes, max_file_bytes)
    out.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    written = []
    for group, file_name in zip(groups, names):
        state = {PREFIX + name: torch.empty(tensors[name][0], dtype=tensors[name][1]) for name in group}
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process reads, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(shards)), no_dist=True)
        save_file({name: state[PREFIX + name].contiguous() for name in group}, out / file_name,
                  metadata={"format": "pt"})
        written.append(out / file_name)
        del state
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: file_name for group, file_name in zip(groups, names) for name in group}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    copy_model_files(config_dir, out)
    return written


# What a model dir holds beside its weights: the config, generation config, tokenizer and chat template.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
               "added_tokens.json")


def copy_model_files(source: Path, out: Path) -> None:
    if source.resolve() == out.resolve():
        return
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
