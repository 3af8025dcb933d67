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

from sft.run.recipe import RecipeError, recipe


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
