"""A run as a recipe file (`sft recipe`, and the run's page): a Hydra primary config that composes exactly the run's
config and holds only what differs from the defaults. See `sft.commands.recipe` for the form."""

from __future__ import annotations

from pathlib import Path

import yaml


class RecipeError(ValueError):
    """A dir that holds no run of `sft.train`, or one whose saved config cannot be read."""


def recipe(run_dir: str | Path) -> str:
    """The recipe file's text for the run in `run_dir` (see the module docstring)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from sft.config.registry import compose

    saved = Path(run_dir) / ".hydra"
    try:
        hydra = yaml.safe_load((saved / "hydra.yaml").read_text())["hydra"]
        overrides = yaml.safe_load((saved / "overrides.yaml").read_text()) or []
        config = yaml.safe_load((saved / "config.yaml").read_text())
    except (OSError, KeyError, TypeError, yaml.YAMLError) as e:
        raise RecipeError(f"{run_dir}: no run of sft.train here (.hydra/hydra.yaml, overrides.yaml and config.yaml "
                          f"are its record): {e}") from None
    choices = {group: choice for group, choice in hydra["runtime"]["choices"].items()
               if not group.startswith("hydra/") and group != "controllers"}  # (a list group: from the config)
    default = compose("train", return_hydra_config=True)  # what `- train` alone composes: left out of the recipe
    default_choices = default.hydra.runtime.choices
    defaults: list = ["train"]
    for group, choice in choices.items():
        if group not in default_choices:  # a group train does not choose (+experiment=...): added, not overridden
            defaults.append({group: choice})
        elif choice != default_choices[group]:
            defaults.append({f"override {group}": choice})
    controllers = list(config.get("controllers") or {})
    if controllers != list(default.controllers):
        defaults.append({"override controllers": controllers})
    defaults.append("_self_")
    values: dict = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key.startswith("hydra.") or key in choices or key == "controllers" or override.is_delete():
            continue  # where the run went; a group's choice (above); a deletion (the composed choices have it)
        if key.startswith("controllers.") and key.split(".")[1] not in (config.get("controllers") or {}):
            continue
        node = values
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = override.value()
    text = yaml.safe_dump({"defaults": defaults, **values}, sort_keys=False, width=120)
    return (f"# The recipe of the run in {run_dir} (sft recipe): sft train --config-dir <this file's dir> "
            f"--config-name <its name, without .yaml> [overrides]\n{text}")


def recipe_or_none(run_dir: str | Path) -> str | None:
    """`recipe`, or None where the dir holds no readable record of a run (a page then says there is none)."""
    try:
        return recipe(run_dir)
    except RecipeError:
        return None
