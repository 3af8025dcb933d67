"""`python -m sft.train --help [GROUP] [overrides]`: without GROUP, the config groups with their options and the
composed config; with GROUP (`--help loss`, `--help controllers`, `--help data.columns`), every knob of the option
chosen there, with its type, its default and its help (the `knob` metadata of the option's schema).

Hydra's own `--help` takes seconds: it lists every group through the config store, copying each stored schema once
per group. This answers from `sft/conf/` and the schemas, without torch, in well under a second.
"""

from __future__ import annotations

import enum
import textwrap
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from sft.config.registry import CONF_DIR, compose
from sft.config.schema import Choice, ConfigError, Schema, import_target

WIDTH = 100


def help_answer(argv: list[str]) -> str | None:
    """`--help [GROUP] [overrides]`: the groups and the composed config, or GROUP's knobs with their help; None for
    Hydra's own `--help`. An override that does not compose is a `ConfigError`."""
    words = [a for a in argv if a not in ("--help", "-h")]
    at = argv.index("--help") if "--help" in argv else argv.index("-h")
    group = argv[at + 1] if at + 1 < len(argv) and "=" not in argv[at + 1] and not argv[at + 1].startswith("-") \
        else None
    if group is None:
        return help_text(words)
    try:
        return group_help(group, [w for w in words if w != group])
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - overrides Hydra refuses: said as Hydra says it
        raise ConfigError(group, None, str(e).splitlines()[0]) from None


def help_text(overrides: list[str]) -> str | None:
    """The config groups with their options (YAML files only: the `*_schema` entries are the options' schemas, not
    choices), those of your `hydra.searchpath` included, and the composed config, in Hydra's layout. None where this
    cannot answer: a `pkg://` search path, or overrides that do not compose (Hydra's `--help` then says why)."""
    try:
        cfg = compose("train", overrides, return_hydra_config=True)
    except Exception:  # noqa: BLE001 - Hydra's own --help reports it
        return None
    options = group_options(cfg)
    if options is None:
        return None
    with open_dict(cfg):
        del cfg["hydra"]
    groups = "\n".join(f"{group}: {', '.join(sorted(names))}" for group, names in sorted(options.items()))
    return ("python -m sft.train [group=option] [key=value ...]: fine-tune a chat model (README.md).\n"
            "python -m sft.train --help GROUP [overrides]: every knob of GROUP's option, with its help.\n\n"
            "== Configuration groups ==\nCompose your configuration from those groups (group=option)\n\n"
            f"{groups}\n\n\n== Config ==\nOverride anything in the config (foo.bar=value)\n\n"
            f"{OmegaConf.to_yaml(cfg)}")


def group_options(cfg: DictConfig) -> dict[str, set[str]] | None:
    """group -> its options, from the YAML files of `sft/conf/` and of the config's `hydra.searchpath` (None where a
    search path is not a folder: `pkg://`)."""
    roots = [CONF_DIR] + [str(p) for p in cfg.hydra.searchpath]
    if any(not root.startswith(("/", "file://")) for root in roots):
        return None
    options: dict[str, set] = {}
    for root in roots:
        root = Path(root.removeprefix("file://"))
        for yaml in [*root.rglob("*.yaml"), *root.rglob("*.yml")]:
            group = yaml.parent.relative_to(root).as_posix()
            if group != ".":  # the primary configs (train, bench) are not choices
                options.setdefault(group, set()).add(yaml.stem)
    return options


def group_help(group: str, overrides: list[str]) -> str:
    """Every knob of the node at `group` (a config group, `controllers`, or any node path: `data.columns`) as the
    overrides compose it: type, default and help. Raises `ConfigError` for a path that names no node."""
    cfg = compose("train", overrides, return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    options = sorted((group_options(cfg) or {}).get(group, ()))
    head = f"{group}: options {', '.join(options)}\n" if options else ""
    with open_dict(cfg):
        del cfg["hydra"]
    if OmegaConf.select(cfg, group, default="absent") == "absent":
        raise ConfigError("--help", group, "names no node of the config (groups: "
                          f"{', '.join(k for k in cfg if not str(k).startswith('_'))})")
    node = OmegaConf.select(cfg, group)
    if node is None:
        return f"{head}{group} is off ({group}: null): {group}=<option> turns it on; its knobs: --help {group} " \
               f"{group}=<option>\n"
    if group == "controllers":
        return head + "\n".join(node_help(f"controllers.{name}", child, f"controllers.{name}")
                                for name, child in node.items() if child is not None)
    chosen = choices.get(group)
    return head + node_help(f"{group}={chosen}" if chosen else group, node, group)


def node_help(title: str, node, path: str) -> str:
    """One node's knobs: `name: type = value` (and the default where the config sets another), then the help."""
    schema = schema_of(node)
    if schema is None:
        return f"{title}: no schema (a free dict)\n{textwrap.indent(OmegaConf.to_yaml(node), '  ')}"
    target = node.get("_target_") if isinstance(node, DictConfig) and "_target_" in node else None
    doc = (schema.__doc__ or "").strip().split("\n\n")[0]
    if doc.startswith(f"{schema.__name__}("):  # the signature a dataclass without a docstring gets
        doc = ""
    lines = [f"{title}" + (f" ({target})" if target else "") + ":"]
    lines += textwrap.wrap(" ".join(doc.split()), WIDTH, initial_indent="  ", subsequent_indent="  ") if doc else []
    lines.append("")
    for f in fields(schema):
        if not f.init or f.name.startswith("_"):
            continue
        default = _default(f)
        value = node[f.name] if f.name in node and not OmegaConf.is_missing(node, f.name) else MISSING
        shown = _show(value if value is not MISSING else default)
        if isinstance(value, DictConfig) and is_dataclass(OmegaConf.get_type(value)):
            shown = f"{{...}} (--help {path}.{f.name})"
        changed = (value is not MISSING and default is not MISSING and not shown.startswith("{...}")
                   and _show(value) != _show(default))
        lines.append(f"  {f.name}: {type_name(schema, f)} = {shown}" + (f"  (default {_show(default)})"
                                                                         if changed else ""))
        help_text = f.metadata.get("help", "")
        lines += textwrap.wrap(help_text, WIDTH, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def schema_of(node) -> type | None:
    """The schema a node is checked by: its `_target_`'s class where that is a schema, else the node's type."""
    if not isinstance(node, DictConfig):
        return None
    if "_target_" in node and not OmegaConf.is_missing(node, "_target_"):
        try:
            built = import_target(node._target_)
        except ConfigError:
            built = None
        if isinstance(built, type) and issubclass(built, Schema) and is_dataclass(built):
            return built
    schema = OmegaConf.get_type(node)
    return schema if is_dataclass(schema) else None


def type_name(schema: type, f) -> str:
    """A field's type as a user reads it: a choice's values (`weight | token | sample`), else its annotation."""
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: shown as written
        return str(f.type)
    tp = hints.get(f.name, f.type)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = len(args) < len(typing.get_args(tp))
    inner = args[0] if optional and len(args) == 1 else tp
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        values = " | ".join(m.value if isinstance(m, Choice) else m.name for m in inner)
        return f"{values}{' | null' if optional else ''}"
    text = str(f.type) if isinstance(f.type, str) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "")


def _default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _show(value) -> str:
    if value is MISSING or (isinstance(value, str) and value == "???"):
        return "??? (required)"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, enum_to_str=True)
    if is_dataclass(value) and not isinstance(value, type):
        return "{...}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if not isinstance(value, str) or value else '""'
