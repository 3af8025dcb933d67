"""Command-line checks that must run before Hydra, whose own errors would not name the knob to use, or would not
be one line with exit code 2: a `TrainingArguments` field that the recipe sets itself (`trainer.max_grad_norm=0.5`),
a key of an engine that the config leaves off (`fsdp.cpu_offload=true` without `fsdp=full_shard`), and a value the
knob's type or choices refuse (`data.format=csv`)."""

from __future__ import annotations

import re

from sft.config.registry import compose
from sft.config.schema import ConfigError
from sft.training.arguments import TrainerConfig
from sft.training.engines import ENGINE_OPTIONS


def refused_override(overrides: list[str]) -> ConfigError | None:
    """The first command-line override that Hydra would refuse without naming the knob to use, as the error that
    does; None where there is none."""
    return owned_field_override(overrides) or key_of_engine_left_off(overrides) or refused_value(overrides)


def refused_value(overrides: list[str]) -> ConfigError | None:
    """A value that composition refuses for its knob's type or choices, as the one-line error naming the knob:
    `data.format=csv` -> `data.format='csv': must be one of auto, messages, ...`. Only such values: any other
    composition error (an option of your `hydra.searchpath`, a misspelt key) is Hydra's to report as it runs."""
    from omegaconf.errors import ValidationError

    if {"-m", "--multirun"} & set(overrides):
        return None  # a sweep's values are expanded per job: each job reports its own
    plain = [o for o in overrides if "=" in o and not o.startswith(("-", "hydra/")) and
             (not o.startswith("hydra.") or o.startswith("hydra.searchpath="))]
    try:
        compose("train", plain)
    except Exception as e:  # noqa: BLE001 - only a value the schema refuses is ours to report
        cause = e.__cause__
        if not isinstance(cause, ValidationError) or not getattr(cause, "full_key", None):
            return None
        message = str(getattr(cause, "msg", cause)).splitlines()[0]
        if choice := re.match(r"Invalid value '(.*)', expected one of \[(.*)\]$", message):
            return ConfigError(cause.full_key, choice.group(1), f"must be one of {choice.group(2)}")
        return ConfigError(cause.full_key, None, message)
    return None


def owned_field_override(overrides: list[str]) -> ConfigError | None:
    """A command-line override of a `TrainingArguments` field that the recipe sets itself (`trainer.max_grad_norm=0.5`,
    with or without `+`), as the error naming the knob to use; Hydra would only say the key is not in the schema."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("trainer.") and key[len("trainer."):] in TrainerConfig.owned_fields:
            return ConfigError(key, None, TrainerConfig.owned_fields[key[len("trainer."):]])
    return None


def key_of_engine_left_off(overrides: list[str]) -> ConfigError | None:
    """A command-line key of an engine group (`fsdp.cpu_offload=true`) where the config, composed without it,
    leaves that engine off (`fsdp: null`): the error naming the option that turns it on. Hydra would say only
    that the key is not in the struct."""
    keyed = [o for o in overrides if "=" in o and not o.startswith(("-", "~"))
             and o.lstrip("+").split("=", 1)[0].split(".")[0] in ENGINE_OPTIONS and "." in o.split("=", 1)[0]]
    if not keyed:
        return None
    rest = [o for o in overrides if o not in keyed and "=" in o and not o.startswith(("-", "hydra.", "hydra/"))]
    try:
        cfg = compose("train", rest)
    except Exception:  # noqa: BLE001 - an error of the other overrides: Hydra reports it as it runs
        return None
    for override in keyed:
        key = override.lstrip("+").split("=", 1)[0]
        engine = key.split(".")[0]
        if cfg.get(engine) is None:
            return ConfigError(key, None, f"{engine} is off ({engine}=none in this config): turn it on with "
                               f"{ENGINE_OPTIONS[engine]}, then set its keys")
    return None
