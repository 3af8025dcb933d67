"""The checks of a composed config: each node by its schema's `check` (ranges, files, rules that span nodes), an
untyped node with a `_target_` (a class of yours) by that class's signature, and every `_target_` against what its
node may build (`check_target`), so that nothing but the classes meant for a node is ever called. Hydra has already refused unknown keys
and wrong types (choices included) at composition; these run before anything heavy is built, and raise
`ConfigError`, which the entrypoint turns into one line and exit code 2."""

from __future__ import annotations

import inspect
from dataclasses import fields, is_dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from sft.config.schema import TARGET_BASES, ConfigError, Schema, import_target


def check(cfg: DictConfig) -> None:
    """Validate every node of a composed config, parents first; raise `ConfigError` naming the first bad field."""
    for path, node in _nodes(cfg):
        try:
            check_node(node, cfg, path)
        except ConfigError as e:
            raise e.within(path) if path else e


def _nodes(cfg: DictConfig | ListConfig, path: str = ""):
    """(path, node) of the config and every dict node below it, in lists too (instantiate builds a `_target_`
    wherever it is), parents first."""
    if isinstance(cfg, DictConfig):
        yield path, cfg
    keys = range(len(cfg)) if isinstance(cfg, ListConfig) else list(cfg)
    for key in keys:
        child = None if OmegaConf.is_missing(cfg, key) else cfg[key]
        if isinstance(child, (DictConfig, ListConfig)):
            yield from _nodes(child, f"{path}.{key}" if path else str(key))


def check_node(node: DictConfig, cfg: DictConfig | None = None, path: str | None = None) -> None:
    """Check one node against the class it builds where that class has a schema (a built-in, or yours that
    extends one), else against the node's own schema, else (an untyped `_target_`) the target's signature.
    A key that the schema does not have is refused, naming it. With its `path` in the config, the node's
    `_target_` is checked against what may be built there (`check_target`) first."""
    schema = OmegaConf.get_type(node)
    typed = is_dataclass(schema) and issubclass(schema, Schema)
    target = node.get("_target_") if "_target_" in node and not OmegaConf.is_missing(node, "_target_") else None
    if target is not None and path is not None:
        check_target(path, target, schema if typed else None)
    if target is not None and (not typed or target != getattr(schema, "_target_", None)):
        built = import_target(target)
        # A schema of its own: decorated as a dataclass itself (a subclass with its own __init__ is not).
        if not (isinstance(built, type) and issubclass(built, Schema) and "__dataclass_fields__" in vars(built)):
            return check_signature(node, built)
        schema = built
    elif not typed:
        return
    knobs = {f.name: f for f in fields(schema) if f.init}
    values = {}
    for key in node:
        key = str(key)
        if key.startswith("_") and key not in knobs:  # Hydra's own: _convert_, _recursive_, _partial_
            continue
        if key not in knobs:
            owned = getattr(schema, "owned_fields", {}).get(key)
            raise ConfigError(key, None, owned or f"not a knob of {target or schema.__name__} (it takes: "
                              f"{', '.join(k for k in knobs if not k.startswith('_'))})")
        if OmegaConf.is_missing(node, key):
            raise ConfigError(key, None, "missing: set it on the command line or in a config")
        values[key] = node[key]
    schema(**values).check(cfg)


def check_target(path: str, target: str, schema: type | None) -> None:
    """A node's `_target_` must be the class its path is declared to build or one extending it (`target_base`:
    `loss`, `loss.aux.*`, `clip`, `controllers.*`), else its schema's own target (a subclass of it where that is a
    class); a `_target_` anywhere else builds nothing. Raises `ConfigError` naming `_target_` otherwise. The
    schema's own target is taken as it is, unimported (composing imports no torch)."""
    from fnmatch import fnmatchcase

    keys = path.split(".")
    base = next((cls for pattern, cls in TARGET_BASES.items()
                 if len(pattern.split(".")) == len(keys) and all(map(fnmatchcase, keys, pattern.split(".")))), None)
    if schema is not None and target == getattr(schema, "_target_", None) and (base is None or issubclass(schema, base)):
        return
    if base is None and not isinstance(getattr(schema, "_target_", None), str):  # refused unimported: importing runs
        raise ConfigError("_target_", target, "nothing is built from a _target_ here (a node builds only what "
                          "its group builds)")
    built = import_target(target)
    if base is None and schema is not None and isinstance(getattr(schema, "_target_", None), str):
        own = import_target(schema._target_)
        if built is own or (isinstance(own, type) and isinstance(built, type) and issubclass(built, own)):
            return
        base = own
    elif base is not None and isinstance(built, type) and issubclass(built, base):
        return
    if base is None:
        raise ConfigError("_target_", dotted(built), "nothing is built from a _target_ here (a node builds only what "
                          "its group builds)")
    extending = " or a class extending it" if isinstance(base, type) else ""
    raise ConfigError("_target_", dotted(built), f"must be {dotted(base)}{extending}: nothing else is built here")


def dotted(obj) -> str:
    """`module.Name` of a class or function."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def check_signature(node: DictConfig, built=None) -> None:
    """The keys of a node without a schema must be parameters of its `_target_` (a class or function)."""
    target = node._target_
    params = inspect.signature(built if built is not None else import_target(target)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in node:
        if key not in params and not str(key).startswith("_"):
            accepted = ", ".join(p for p in params if p != "self") or "none"
            raise ConfigError(str(key), None, f"not a parameter of {target} (it takes: {accepted})")
