"""The two sharding engines, one per run: DeepSpeed ZeRO (the `deepspeed` group: DeepSpeed's own JSON as a dict,
checked here since it has no schema) and FSDP2 (the `fsdp` group, `FsdpConfig`, through accelerate's plugin).
Both are off (null) by default; `key_of_engine_left_off` names the option that turns one on when the command
line sets a key of an engine that is off."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from sft.config.schema import ConfigError, Schema, config_schema, cuda_available, knob
from sft.ranks import is_local_rank_zero

log = logging.getLogger("sft")

# The engine groups (and sequence parallelism), which are off (null) by default, and the options that turn each on
ENGINE_OPTIONS = {"fsdp": "fsdp=full_shard or fsdp=full_shard_offload",
                  "deepspeed": "deepspeed=zero2, zero3, zero3_offload or file",
                  "sp": "sp=ulysses"}


@config_schema("fsdp", "fsdp")
@dataclass
class FsdpConfig(Schema):
    """FSDP2 (torch's `fully_shard`) through accelerate's plugin: parameters, gradients and optimizer states
    sharded over the processes, one unit per decoder layer plus one for the rest (embeddings, norm, output
    layer). The second engine beside DeepSpeed (`deepspeed=...`); one of the two per run."""

    reshard_after_forward: bool = knob(True, "true: a layer's full weights are freed after its forward and "
                                       "gathered again for its backward (ZeRO-3's memory); false: kept from "
                                       "forward to backward (less communication, ZeRO-2-like memory)")
    cpu_offload: bool = knob(False, "parameters, gradients and optimizer states in CPU memory between uses (GPU)")
    layers: Optional[List[str]] = knob(None, "the module classes sharded as one unit each; null: the model's own "
                                       "`_no_split_modules` (its decoder layer)")

    def check(self, cfg=None):
        self.require("layers", self.layers is None or len(self.layers) > 0, "must be null or a non-empty list")
        self.require("cpu_offload", not self.cpu_offload or cuda_available(),
                     "moves GPU memory to the CPU, and needs a CUDA GPU (torch pins the offloaded memory); this "
                     "machine has none: use fsdp=full_shard")
        if cfg is None:
            return
        self.require("", cfg.deepspeed is None, "FSDP and DeepSpeed are two engines for the same job: choose one "
                     "(fsdp=none, or deepspeed=none)")
        self.require("", cfg.model.quantization is None, "sft does not shard a 4-bit base model with FSDP (QLoRA "
                     "trains on one GPU: lora=qlora without fsdp)")


def check_fsdp_layers(fsdp, model) -> None:
    """`fsdp.layers` must name module classes of the model (accelerate would fail on the first step without saying
    which knob); the error lists its decoder layers."""
    if fsdp is None or fsdp.layers is None:
        return
    classes = {type(m).__name__ for m in model.modules()}
    if missing := [name for name in fsdp.layers if name not in classes]:
        layers = sorted(name for name in classes if name.endswith(("DecoderLayer", "Block", "Layer")))
        raise ConfigError("fsdp.layers", list(fsdp.layers), f"{', '.join(missing)} is no module class of "
                          f"{type(model).__name__} (its layers: {', '.join(layers) or 'none'}; null: its own "
                          "_no_split_modules)")


def fsdp_fields(fsdp, activation_checkpointing: bool, sharded: bool = False) -> dict:
    """TrainingArguments' FSDP2 fields for the `fsdp` node. Activation checkpointing becomes FSDP's own
    (each layer wrapped before sharding): Trainer's would gather every layer's weights once more in backward.
    `sharded`: checkpoints as every rank's own shards (`sft.training.checkpoints.sharded`), else gathered to rank 0."""
    config = {"version": 2, "reshard_after_forward": fsdp.reshard_after_forward, "cpu_offload": fsdp.cpu_offload,
              "activation_checkpointing": activation_checkpointing,
              "state_dict_type": "SHARDED_STATE_DICT" if sharded else "FULL_STATE_DICT"}
    if fsdp.layers is not None:
        config["transformer_layer_cls_to_wrap"] = list(fsdp.layers)
    return {"fsdp": True, "fsdp_config": config, "activation_checkpointing": False}


def load_deepspeed_file(cfg) -> None:
    """`deepspeed=file deepspeed.path=ds.json`: replace the node by the file's JSON object, with the keys set
    beside `path` on top, so that everything after the check (and the resume comparison) sees one dict."""
    from omegaconf import OmegaConf, open_dict

    if "path" not in cfg.deepspeed.keys():  # (`in` on the node itself is False for a missing value)
        return
    if OmegaConf.is_missing(cfg.deepspeed, "path"):
        raise ConfigError("deepspeed.path", None, "missing: deepspeed=file takes deepspeed.path=<your DeepSpeed JSON>")
    path = Path(str(cfg.deepspeed.path)).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError("deepspeed.path", str(path), f"cannot be read ({e.strerror or e})") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("deepspeed.path", str(path),
                          f"not JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(loaded, dict):
        raise ConfigError("deepspeed.path", str(path), f"must hold a JSON object, not {type(loaded).__name__}")
    beside = {k: v for k, v in OmegaConf.to_container(cfg.deepspeed, resolve=True).items() if k != "path"}
    with open_dict(cfg):
        cfg.deepspeed = OmegaConf.merge(OmegaConf.create(loaded), OmegaConf.create(beside))


def check_deepspeed(cfg) -> None:
    """The DeepSpeed dict mirrors DeepSpeed's own JSON: no schema, so its rules are checked here (after
    `load_deepspeed_file`)."""
    from omegaconf import OmegaConf

    zero = cfg.deepspeed.get("zero_optimization") or {}
    stage = zero.get("stage", 0)

    def require(key: str, ok: bool, reason: str) -> None:
        if not ok:
            raise ConfigError(key, OmegaConf.select(cfg, key), reason)

    require("deepspeed.zero_optimization.stage", stage in (0, 1, 2, 3), "must be 0, 1, 2 or 3")
    if stage == 3:
        require("deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save",
                zero.get("stage3_gather_16bit_weights_on_model_save") is True,
                "must be true with ZeRO-3, else the saved model or LoRA adapter is empty")
    require("deepspeed.zero_optimization.offload_param", stage == 3 or "offload_param" not in zero,
            "parameter offload needs ZeRO stage 3")
    require("deepspeed", cfg.model.quantization is None, "DeepSpeed ZeRO does not shard a 4-bit base model")


# DeepSpeed's collectives on a CPU (`deepspeed.comm`: ZeRO, and sp=ulysses' all-to-all) build this C++ op on first use
SHM_COMM_OP = "deepspeed_shm_comm"


def announce_deepspeed_comm_build() -> None:
    """Say before it starts what DeepSpeed does in silence: on a machine without a GPU, starting `deepspeed.comm`
    JIT-compiles its shared-memory all-reduce (`deepspeed_shm_comm`, torch.utils.cpp_extension) into torch's
    extensions dir (37 s on this project's 2-core machine, minutes on a loaded one), once; later runs load it."""
    import glob
    import os

    import torch

    if torch.cuda.is_available() or not is_local_rank_zero():  # one line a machine: one rank builds it
        return
    import deepspeed.ops
    from deepspeed.git_version_info import installed_ops

    if not deepspeed.ops.__compatible_ops__.get(SHM_COMM_OP) or installed_ops.get(SHM_COMM_OP):
        return  # not built at all here, or built when DeepSpeed was installed
    try:  # the dir torch's `load` builds it in, and looks for it in: $TORCH_EXTENSIONS_DIR/<name> or the user's cache
        from torch.utils.cpp_extension import _get_build_directory

        build = _get_build_directory(SHM_COMM_OP, verbose=False)
    except (ImportError, OSError):
        return
    if not glob.glob(os.path.join(glob.escape(build), "*.so")):
        log.warning("DeepSpeed compiles its CPU collectives (the C++ op %s) before the run starts, into %s: under a "
                    "minute to a few on a small machine, once (later runs load it; TORCH_EXTENSIONS_DIR moves it)",
                    SHM_COMM_OP, build)
