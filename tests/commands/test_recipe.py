"""`sft recipe`: a run as a recipe file holding what differs from the defaults, which composes the run's config
again and trains a variant of it."""

import pytest
import yaml
from conftest import SMALL_EVAL, run_train, sft


@pytest.mark.slow
def test_a_runs_recipe_composes_its_config_again_and_trains_a_variant(tmp_path):
    run = tmp_path / "run"
    made = ["loss=ce", "lora=default", "+controllers=curriculum", "controllers.curriculum.chunk_size=8",
            "~controllers.watchdog", "trainer.max_steps=2", "trainer.eval_steps=2", f"data.eval_file={SMALL_EVAL}",
            "trainer.save_strategy=no",
            "+model.config_overrides.attention_dropout=0.0", "eval_buckets=[1.5,3]", f"hydra.run.dir={run}"]
    proc = run_train(*made)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = sft("recipe", str(run), "-o", str(tmp_path / "mine.yaml"))
    assert proc.returncode == 0, proc.stderr
    # what differs from the defaults, and nothing else: the groups left at their default are not written
    defaults = yaml.safe_load((tmp_path / "mine.yaml").read_text())["defaults"]
    assert defaults[0] == "train" and defaults[-1] == "_self_"
    assert sorted(map(str, defaults[1:-1])) == sorted(map(str, [{"override loss": "ce"}, {"override lora": "default"},
                                                                 {"override controllers": ["guard", "curriculum"]}]))
    composed = sft("train", "--config-dir", str(tmp_path), "--config-name", "mine", "--cfg", "job")
    assert composed.returncode == 0, composed.stderr
    assert yaml.safe_load(composed.stdout) == yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    proc = sft("train", "--config-dir", str(tmp_path), "--config-name", "mine", "trainer.max_steps=3",
               f"hydra.run.dir={tmp_path / 'again'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "again" / ".hydra" / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 3 and list(saved["controllers"]) == ["guard", "curriculum"]
