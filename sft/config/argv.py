"""Command-line checks that must run before Hydra, whose own errors would not name the knob to use, or would not
be one line with exit code 2: a `TrainingArguments` field that the recipe sets itself (`trainer.max_grad_norm=0.5`),
a key of an engine that the config leaves off (`fsdp.cpu_offload=true` without `fsdp=full_shard`), a value the
knob's type or choices refuse (`data.format=csv`), and an override that does not compose: a misspelt key (with the
nearest name), an option or group that does not exist, a key of a group left off, a new key of a free-form dict
without `+`, a value the override grammar cannot read (a non-ASCII path to quote), and a `_target_` under `hydra.`."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from sft.config.registry import CONF_DIR, compose
from sft.config.schema import ConfigError
from sft.training.arguments import TrainerConfig
from sft.training.processes.engines import ENGINE_OPTIONS


def refused_override(overrides: list[str]) -> ConfigError | None:
    """The first command-line override that Hydra would refuse without naming the knob to use, as the error that
    does; None where there is none. Composes the config to find out (`refused_value`): where the config is composed
    next anyway, `refused_before_composing` and `composition_error` on its failure say the same, composing once."""
    return refused_before_composing(overrides) or refused_value(overrides)


def refused_before_composing(overrides: list[str]) -> ConfigError | None:
    """The refusals that composing would not make, or not name: a field the recipe owns, a `_target_` under `hydra.`,
    a key of an engine the config leaves off."""
    return owned_field_override(overrides) or hydra_target_override(overrides) or key_of_engine_left_off(overrides)


def refused_value(overrides: list[str]) -> ConfigError | None:
    """An override that composition refuses, as the one-line error naming the knob: a value its knob's type or
    choices refuse (`data.format=csv` -> `data.format='csv': must be one of auto, messages, ...`), or one of the
    mistakes `composition_error` reads. Any other composition error (an option of your `hydra.searchpath`, say)
    is Hydra's to report as it runs."""
    if {"-m", "--multirun"} & set(overrides):
        return None  # a sweep's values are expanded per job: each job reports its own
    if any(o.split("=", 1)[0] in ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")
           for o in overrides):
        return None  # another config dir or primary config: Hydra reads them, and reports what does not compose
    plain = [o for o in overrides if "=" in o and not o.startswith(("-", "hydra/")) and
             (not o.startswith("hydra.") or o.startswith("hydra.searchpath="))]
    try:
        compose("train", plain)
    except Exception as e:  # noqa: BLE001 - only the errors read below are ours to report
        return composition_error(e, plain)
    return None


def composition_error(error: Exception, overrides: list[str], composer=None) -> ConfigError | None:
    """The one-line error for a composition failure that Hydra would report in several lines (or as a traceback),
    or None where it is not one of those read here. `composer(overrides)` composes the config the overrides are
    of (default: the training config)."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = error.__cause__
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        message = str(getattr(cause, "msg", cause)).splitlines()[0]
        if choice := re.match(r"Invalid value '(.*)', expected one of \[(.*)\]$", message):
            return ConfigError(cause.full_key, choice.group(1), f"must be one of {choice.group(2)}")
        return ConfigError(cause.full_key, None, message)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and getattr(cause, "full_key", None):
        return unknown_key(str(cause.full_key), overrides, composer)
    if isinstance(error, MissingConfigException):
        missing = re.search(r"Could not find '(.+)/([^/']+)'", str(error))
        if missing:
            group, option = missing.groups()
            options = [o for o in re.findall(r"^\t(\S+)$", str(error), re.M) if not o.endswith("_schema")]
            return ConfigError(group, option, f"no such option (options: {', '.join(options)}){nearest(option, options)}")
    if isinstance(error, OverrideParseException):
        from sft.config.overrides import quoted

        override = next((o for o in overrides if o in str(error)), None)
        if override is None:
            return ConfigError("command line", None, str(error).splitlines()[0])
        key, _, value = override.partition("=")
        why = ("Hydra's grammar reads unquoted values as ASCII only" if not override.isascii() else
               "Hydra cannot parse it (values with characters such as < > | ' \" , [ ] { } need quotes)")
        form = quoted(override)
        return ConfigError(key.lstrip("+~"), value, f"{why}: write it {form}" if form else why)
    return None


def unknown_key(key: str, overrides: list[str], composer=None) -> ConfigError:
    """A key that is not in the config: of a group left off (`exact_match.max_rows` while `exact_match: null`), new
    in a free-form dict (needs `+`), or misspelt (the nearest knob named)."""
    parent_key, _, name = key.rpartition(".")
    def about(override: str) -> bool:  # sets this key, or a node above it (model.random_init={model_type: ...}),
        name = override.lstrip("+~").split("=", 1)[0]  # not a group's choice (lora=default: its keys come with it)
        return name.startswith(key) or (key.startswith(name + ".") and not Path(CONF_DIR, name).is_dir())

    others = [o for o in overrides if not about(o)]
    try:
        cfg = composer(others) if composer is not None else compose("train", others)
    except Exception:  # noqa: BLE001 - the other overrides fail too: say what is known of this one
        return ConfigError(key, None, "not a knob of this config")
    parent = OmegaConf.select(cfg, parent_key, default="absent") if parent_key else cfg
    if parent is None:  # the group (or node) is off: its keys come with an option
        group = parent_key.split(".")[0]
        options = sorted(p.stem for p in Path(CONF_DIR, group).glob("*.yaml") if p.stem != "none")
        turn_on = " or ".join(f"{group}={o}" for o in options) if options else f"{group}=<option>"
        return ConfigError(key, None, f"{parent_key} is off ({parent_key}: null in this config): turn it on with "
                           f"{turn_on}, then set its keys")
    if isinstance(parent, DictConfig):
        schema = OmegaConf.get_type(parent)
        if schema is dict:  # a free-form dict (model.random_init): Hydra adds keys with +
            return ConfigError(key, None, f"a new key of {parent_key} (a free-form dict): add it with +{key}=...")
        names = [str(k) for k in parent]
        where = f"a knob of {parent_key}" if parent_key else "a group or knob of the config"
        return ConfigError(key, None, f"not {where}{nearest(name, names, parent_key)}")
    return ConfigError(key, None, f"{parent_key} is a value, not a node with keys")


def nearest(name: str, names: list[str], prefix: str = "") -> str:
    """`; did you mean X?` for the closest of `names`, or nothing."""
    import difflib

    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""


def hydra_target_override(overrides: list[str]) -> ConfigError | None:
    """A `_target_` given under `hydra.` on the command line (`+hydra.callbacks.x._target_=...`): Hydra builds it
    before any check could see it, so it is refused here; Hydra callbacks belong in a config file."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("hydra.") and ("_target_" in key.split(".") or "_target_" in override.split("=", 1)[-1]):
            return ConfigError(key, None, "a Hydra callback or plugin is built before any check: set it in a config "
                               "file, not on the command line")
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


def check_only(overrides: list[str]) -> int:
    """`python -m sft.train --check [overrides]`: compose and check the config as a run would, print the error in one
    line (exit code 2) or `config: ok` (0), and train nothing. `./launch.sh` runs it once before it starts several
    processes, each of which would print the same error, then the launcher's own traceback."""
    import sys

    from sft.config.validate import check

    refused = refused_before_composing(overrides)
    if refused is None:
        try:
            check(compose("train", overrides))
        except ConfigError as e:
            refused = e
        except Exception as e:  # noqa: BLE001 - a composition error read by composition_error, else Hydra's text
            refused = composition_error(e, overrides) or ConfigError("command line", None, str(e).splitlines()[0])
    if refused is not None:
        print(f"error: config: {refused}", file=sys.stderr)
        return 2
    print("config: ok")
    return 0

