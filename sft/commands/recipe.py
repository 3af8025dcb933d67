"""A run as a recipe file: `sft recipe <run dir> [-o recipe.yaml]`.

The recipe is a Hydra primary config that composes exactly the run's config, and holds only what differs from the
defaults: the training config (`train`), the run's choice in each config group where it is not the default one
(`override model: smollm2_135m`, from `.hydra/hydra.yaml`; its controllers where they are not [guard, watchdog],
from the composed config) and the values its command line set (`.hydra/overrides.yaml`), as YAML:

    defaults:
      - train
      - override model: smollm2_135m
      - override lora: default
      - _self_
    trainer:
      max_steps: 30

Train it again, or a variant of it, with Hydra's own options: `sft train --config-dir <dir> --config-name recipe
trainer.max_steps=60` (`--config-dir` adds its dir to the config search path; the built-in groups stay). Where the
run was made is not part of a recipe (`hydra.*` overrides are left out); secrets were masked when the run was saved.
"""

from __future__ import annotations

import argparse
import sys
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sft recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run dir of sft.train (it holds .hydra/)")
    parser.add_argument("-o", "--output", help="write the recipe here (default: print it)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        text = recipe(args.run_dir)
    except RecipeError as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        sys.exit(2)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: sft train --config-dir {Path(args.output).parent} --config-name "
              f"{Path(args.output).stem}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
