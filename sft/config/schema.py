"""What every config schema is built from: `Schema` (a dataclass that checks its own values), `knob` (a field with
its help), `Choice` (a knob's choices, checked when the config is composed) and `ConfigError` (one line naming
the field). Each stage's schemas live beside the classes they configure (a built-in loss is its class and its
YAML); `sft.config.registry` gathers them. This module imports nothing of sft, nor torch or transformers.

    @config_schema("loss", "focal")
    @dataclass(eq=False, kw_only=True)
    class FocalLoss(WeightedTokenLoss):
        gamma: float = knob(2.0, "the focusing exponent: each token's loss times (1 - p) ** gamma")
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any

# (group, name) -> the schema of `sft/conf/<group>/<name>.yaml` (its `defaults` name `<name>_schema`)
SCHEMAS: dict[tuple[str | None, str], type] = {}
# config path ("loss", "controllers.*") -> the class that a `_target_` there must be or extend (`target_base`)
TARGET_BASES: dict[str, type] = {}


class ConfigError(ValueError):
    """A config value that cannot work; `str()` names the field and the bad value."""

    def __init__(self, key: str, value: Any, reason: str):
        super().__init__(f"{key}={value!r}: {reason}" if value is not None else f"{key}: {reason}")
        self.key, self.value, self.reason = key, value, reason

    def within(self, path: str) -> ConfigError:
        """The same error with its key placed under the node at `path` (`clip` + `max_norm`)."""
        return ConfigError(f"{path}.{self.key}" if self.key else path, self.value, self.reason)


class Schema:
    """Base of every schema: `check` validates the node's values; `require` names the failing field."""

    def check(self, cfg=None) -> None:
        """Raise `ConfigError` for the first bad value. `cfg` is the whole config, for rules that span
        nodes; None where the class is built directly in Python (those rules are then skipped)."""

    def require(self, key: str, ok: bool, reason: str) -> None:
        if not ok:
            raise ConfigError(key, getattr(self, key) if key else None, reason)


class Choice(str, enum.Enum):
    """A knob's choices: OmegaConf refuses any other value when the config is composed, naming them. A member is
    its string (`Overlong.truncate == "truncate"`, and prints as `truncate`)."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # as errors quote a value: checkpoint.format='sharded'
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]


def knob(default: Any = MISSING, help: str = "", *, factory=None) -> Any:  # noqa: A002 - the field's help text
    """A schema field with its help (`python -m sft.train --help <group>` shows it); `factory` for a list or dict."""
    metadata = {"help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def config_schema(group: str | None, name: str):
    """Register a schema as `<name>_schema` of config group `group` (`sft.config.registry` stores them all)."""
    def register(cls: type) -> type:
        SCHEMAS[(group, f"{name}_schema")] = cls
        return cls
    return register


def target_base(*paths: str):
    """Declare the class the `_target_` of the config nodes at `paths` must be or extend (`*`: any one key, as in
    `controllers.*`). `sft.config.validate` checks every `_target_` against it before anything is built: the
    command line is trusted input, but a typo or a pasted override must not call an arbitrary function
    (`+controllers.x._target_=shutil.copyfile`)."""
    def register(cls: type) -> type:
        for path in paths:
            TARGET_BASES[path] = cls
        return cls
    return register


def help_of(schema: type, name: str) -> str:
    """A field's help, as its `knob` gives it ("" where it has none)."""
    return next((f.metadata.get("help", "") for f in fields(schema) if f.name == name), "")


def learned_state(obj) -> dict:
    """What a stateful part (clip policy, controller) carries into a checkpoint: its public attributes
    that are not the knobs of its schema (the dataclass fields). On resume the knobs come from the run's
    config, so that a changed setting is applied, never overwritten by the checkpoint's."""
    knobs = _knobs(obj)
    return {k: v for k, v in vars(obj).items() if not k.startswith("_") and k not in knobs}


def restore_learned_state(obj, state: dict) -> None:
    """Set what `learned_state` saved; knob values in `state` (checkpoints of older versions) are ignored."""
    knobs = _knobs(obj)
    vars(obj).update({k: v for k, v in state.items() if k not in knobs})


def _knobs(obj) -> set[str]:
    """The knobs of a stateful part: its schema's fields (none for a class without a schema)."""
    return {f.name for f in fields(obj)} if is_dataclass(obj) else set()


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (torch imported only when a check asks)."""
    import torch

    return torch.cuda.is_available()


def missing(requirement: str) -> tuple[str, str] | None:
    """For a requirement "module" or "module pip-name": None if the module is installed, else (module, pip name)."""
    module, pip_name = requirement.split()[0], requirement.split()[-1]
    return None if installed(module) else (module, pip_name)


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def import_target(target: str):
    """The object a `_target_` names (`package.module.Class`), or a one-line `ConfigError` saying why not."""
    import importlib

    parts = target.split(".")
    try:
        for i in range(len(parts) - 1, 0, -1):  # the longest importable module path, then attributes
            module = ".".join(parts[:i])
            try:
                obj = importlib.import_module(module)
                break
            except ModuleNotFoundError as e:
                if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                    raise  # a module that the target's own module imports is missing
        else:
            raise ModuleNotFoundError(f"No module named {parts[0]!r}")
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    except Exception as e:  # ImportError, AttributeError, or whatever the module raised when imported
        raise ConfigError("_target_", target, f"cannot be imported ({type(e).__name__}: {e})") from None
