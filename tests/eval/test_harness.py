"""lm-evaluation-harness in a run (`sft.eval.harness`): its scores in results.json equal the harness's own evaluation
of the saved model, loaded from disk by the harness itself; bad settings are one config error."""

import json

import pytest
from conftest import REPO, composed, run_train

from sft.config import ConfigError, check

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness (pip install -e '.[eval]')")


@pytest.mark.slow
def test_the_runs_benchmark_scores_are_the_harness_own_on_the_saved_model(tmp_path, monkeypatch):
    run = tmp_path / "run"
    proc = run_train("eval_harness=sample", "eval_harness.limit=16", "eval_harness.every=1", "trainer.max_steps=20",
                     "trainer.eval_steps=10", "trainer.save_steps=20", "trainer.report_to=[tensorboard]",
                     f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    ppl, exact = (results[f"eval_harness/{task}"] for task in ("sft_sample_addition_ppl/byte_perplexity",
                                                               "sft_sample_addition/exact_match"))
    assert ppl > 1 and 0 <= exact <= 1 and "eval_harness/seconds" not in results

    import lm_eval
    from lm_eval.tasks import TaskManager

    from sft.eval.harness import TASKS_DIR

    # the bundled tasks as a user runs them with lm-eval: its own loading of their YAML files, from the repo root
    monkeypatch.chdir(REPO)
    own = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(run / "model"), "dtype": "float32", "device": "cpu"},
        tasks=["sft_sample_addition_ppl", "sft_sample_addition"], task_manager=TaskManager(include_path=str(TASKS_DIR)),
        limit=16, apply_chat_template=True, system_instruction="You add numbers.", log_samples=False)["results"]
    assert ppl == pytest.approx(own["sft_sample_addition_ppl"]["byte_perplexity,none"], rel=1e-4)
    assert exact == own["sft_sample_addition"]["exact_match,none"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(d for d in (run / "runs").iterdir() if d.name != "hparams")))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("eval/harness/sft_sample_addition_ppl/byte_perplexity")]
    assert [step for step, _ in logged] == [0, 10, 20]  # every evaluation (every=1), the last one the final model's
    assert logged[-1][1] == pytest.approx(ppl, rel=1e-6) and logged[0][1] > ppl  # it learned


@pytest.mark.parametrize("overrides, key", [
    (["eval_harness=sample", "eval_harness.tasks=[]"], "eval_harness.tasks"),
    (["eval_harness=sample", "eval_harness.tasks=[/no/such/task.yaml]"], "eval_harness.tasks"),
    (["eval_harness=sample", "eval_harness.limit=0"], "eval_harness.limit"),
    (["eval_harness=sample", "eval_harness.every=2", "fsdp=full_shard"], "eval_harness.every"),
])
def test_bad_harness_settings_are_one_config_error(overrides, key):
    with pytest.raises(ConfigError) as e:
        check(composed(*overrides))
    assert e.value.key == key


@pytest.mark.slow
def test_the_harness_starts_no_subprocess(monkeypatch):
    # lm-eval records the machine by running `pip list` and others with no timeout (pip asks PyPI for a newer pip):
    # on a node with no route out that hung a run after training. sft keeps only the metrics, so nothing is run.
    import subprocess

    from sft.eval.harness import EvalHarness
    from sft.model.loading import load_model, load_tokenizer

    started = []
    real_popen_init = subprocess.Popen.__init__

    def record(self, args, *a, **kw):
        started.append(args)
        return real_popen_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", record)
    metrics = EvalHarness(tasks=["sft_sample_addition_ppl"], limit=2).run(load_model("tiny").eval(),
                                                                          load_tokenizer("tiny"))
    assert metrics["eval_harness/sft_sample_addition_ppl/byte_perplexity"] > 1
    assert not [args for args in started if "pip" in str(args)], started
