"""Secrets in a config are never written in clear.

A secret is a knob whose name says so: `trainer.hub_token`, or a key of your own named `token`, `api_key`,
`secret`, `password` ... (`is_secret`; a tokenizer's `pad_token` and the like are not). Where a config is written
or logged (`sft_state.json`, MLflow params, TensorBoard's HParams, `.hydra/config.yaml`), its secrets read
`<secret>` (`masked`). A secret given on the command line is moved into this process's environment before Hydra
reads the command line (`secrets_to_environment`): the override becomes `key=${oc.env:SFT_SECRET_<KEY>}`, so that
Hydra's `overrides.yaml`, the run's name and the argv W&B records never hold it, and the config still resolves to it.
Better still, keep secrets in the environment yourself (`HF_TOKEN`, `WANDB_API_KEY`): nothing then reaches a config.

    masked({"trainer": {"hub_token": "hf_abc", "learning_rate": 1e-4}})
    # -> {"trainer": {"hub_token": "<secret>", "learning_rate": 1e-4}}
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MASK = "<secret>"
_SECRET = re.compile(r"(?:^|_)(?:token|api_?key|secret|secret_key|password|passwd|credentials?|access_key)$", re.I)
_SPECIAL_TOKEN = re.compile(r"^(?:bos|eos|pad|unk|sep|cls|mask|im_start|im_end)_token$", re.I)


def is_secret(key: str) -> bool:
    """Whether a config key names a secret (`hub_token`, `api_key`, `password`; not `pad_token`)."""
    key = str(key)
    return bool(_SECRET.search(key)) and not _SPECIAL_TOKEN.match(key)


def masked(config):
    """A copy of a config (nested dicts and lists) with the value of every secret key that is set replaced by
    `MASK`."""
    if isinstance(config, dict):
        return {k: (MASK if is_secret(k) and v not in (None, "") else masked(v)) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(masked(v) for v in config)
    return config


def environment_name(key: str) -> str:
    """The environment variable a command-line secret moves to: `trainer.hub_token` -> `SFT_SECRET_TRAINER__HUB_TOKEN`."""
    return "SFT_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", key.replace(".", "__")).upper()


def secrets_to_environment(argv: list[str]) -> list[str]:
    """`argv` with each secret override's value moved into `os.environ` (inherited by the run's processes and a
    sweep's jobs): `trainer.hub_token=hf_abc` -> `trainer.hub_token=${oc.env:SFT_SECRET_TRAINER__HUB_TOKEN}`."""
    moved = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        name = key.lstrip("+~")
        if eq and not arg.startswith("-") and is_secret(name.rsplit(".", 1)[-1]) and value not in ("", "null") \
                and not value.startswith("${"):
            os.environ[environment_name(name)] = value.strip("'\"")
            arg = f"{key}=${{oc.env:{environment_name(name)}}}"
        moved.append(arg)
    return moved


def mask_saved_config(run_dir: str | os.PathLike) -> None:
    """Rewrite Hydra's `.hydra/config.yaml` of a run dir with its secrets masked (a secret from a config file
    reaches it in clear: Hydra writes the composed config before any code of the run runs)."""
    import yaml

    path = Path(run_dir, ".hydra", "config.yaml")
    if not path.is_file():
        return
    saved = yaml.safe_load(path.read_text())
    hidden = masked(saved)
    if hidden != saved:
        from sft.files import write_text

        write_text(path, yaml.safe_dump(hidden, sort_keys=False))
