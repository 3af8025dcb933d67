"""`python -m sft.train --help [GROUP]` (`sft.config.help`): the groups and the composed config; a group's knobs with
their type, default and help."""

import pytest


@pytest.mark.slow
def test_help_lists_the_choices_and_the_composed_config_and_falls_back_to_hydra(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    def help_of(*args):
        return subprocess.run([sys.executable, "-m", "sft.train", "--help", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)

    fast = help_of("loss=ce")
    assert fast.returncode == 0, fast.stderr
    # no *_schema entries
    assert "\nloss: asft, ce, dft, distill, eaft, focal, hard_sample, keywords, length, reference_weighted\n" in fast.stdout
    assert "  _target_: sft.loss.builtin.CrossEntropyLoss\n" in fast.stdout  # the config as composed
    (tmp_path / "loss").mkdir()
    (tmp_path / "loss" / "mine.yaml").write_text("defaults:\n  - ce\n")
    own = help_of(f"hydra.searchpath=[file://{tmp_path}]", "loss=mine")  # a config dir of the user's
    assert own.returncode == 0, own.stderr
    assert "\nloss: asft, ce, dft, distill, eaft, focal, hard_sample, keywords, length, mine, reference_weighted\n" in own.stdout
    bad = help_of("loss=nope")
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_help_group_prints_every_knob_of_the_chosen_option_with_type_default_and_help():
    from dataclasses import fields

    from sft.config.help import group_help
    from sft.loss.builtin import FocalLoss

    text = group_help("loss", ["loss=focal", "loss.alpha=0.5"])
    assert text.startswith("loss: options asft, ce, dft, distill, eaft, focal, hard_sample, keywords, length, reference_weighted\n"
                           "loss=focal "
                           "(sft.loss.builtin.FocalLoss):\n")
    knobs = [f for f in fields(FocalLoss) if f.init and not f.name.startswith("_")]
    for f in knobs:
        assert f"\n  {f.name}: " in text and " ".join(f.metadata["help"].split()[:4]) in " ".join(text.split())
    assert "\n  alpha: float = 0.5  (default 0.0)\n" in text  # the composed value, and the schema's default
    assert "\n  normalize: weight | token | sample = weight\n" in text  # a choice: its values
    assert "\n  gamma: float = 2.0\n" in text
    controllers = group_help("controllers", ["+controllers=early_stopping"])
    assert "controllers.early_stopping (sft.training.controllers.EarlyStopping):" in controllers
    assert "\n  mode: min | max = min\n" in controllers and "controllers.guard" in controllers
    assert "\n  score: Optional[str] = null\n" in group_help("data.columns", [])
    assert group_help("lora", []).endswith("lora is off (lora: null): lora=<option> turns it on; its knobs: --help "
                                           "lora lora=<option>\n")


def test_help_of_a_node_that_is_not_there_is_one_line():
    from conftest import run_train

    proc = run_train("--help", "lossy")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: config: --help='lossy': names no node of the config (groups: model, data,")


def test_every_knob_of_every_schema_has_its_help():
    """Each knob's help is field metadata, in one place: a knob without it would print with no help."""
    from dataclasses import fields

    import sft.config.registry  # noqa: F401 - every stage's schemas
    from sft.config.schema import SCHEMAS

    missing = [f"{schema.__name__}.{f.name}" for schema in set(SCHEMAS.values()) for f in fields(schema)
               if f.init and not f.name.startswith("_") and not f.metadata.get("help")]
    assert not missing, missing
