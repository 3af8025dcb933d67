"""The structured config: one dataclass schema per config group, each beside the classes it configures and
checking its own values (`sft.config.schema`); gathered and composed by `sft.config.registry`; validated by
`sft.config.validate`; explained by `sft.config.help` (`python -m sft.train --help GROUP`).

Hydra rejects an unknown key, a wrongly typed value or a value outside a knob's choices at composition, naming
it. `check` then walks the composed config and lets every node's schema validate its values (ranges, files,
rules that span nodes) before anything heavy is built, raising `ConfigError`, which the entrypoint turns into a
one-line message and exit code 2. A node built from a class with no schema (your own controller, loss or clip
policy without `knob`s) is checked against that class's signature instead.

`from sft.config import compose, check` works as a shortcut; the stages import `sft.config.schema` only.
"""

from sft.config.schema import Choice, ConfigError, Schema, config_schema, knob

_LAZY = {"compose": "sft.config.registry", "register": "sft.config.registry", "CONF_DIR": "sft.config.registry",
         "TrainConfig": "sft.config.registry", "check": "sft.config.validate", "check_node": "sft.config.validate",
         "help_text": "sft.config.help", "group_help": "sft.config.help"}

__all__ = ["Choice", "ConfigError", "Schema", "config_schema", "knob", *_LAZY]


def __getattr__(name: str):
    """The composition's names, imported on first use: the stages' schemas import `sft.config.schema`, and the
    registry imports every stage's schemas, so importing it here at once would go round in a circle."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sft.config' has no attribute {name!r}")
