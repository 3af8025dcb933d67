"""Generation samples during evaluation: the prompts spread over the buckets, the table in TensorBoard (read back
with TensorBoard's own reader) agrees with the logged metric, and bad settings are one config error."""

import json

import pytest
from conftest import SMALL_EVAL, run_train

from sft.config import ConfigError, check, compose
from sft.eval.samples import exact_match, markdown_table, spread_over_buckets


def test_prompts_are_taken_in_turn_from_every_bucket():
    rows = [{"id": i, "difficulty_score": s} for i, s in enumerate([1, 1, 1, 3, 3, 2.5])] + [{"id": 6}]
    chosen = spread_over_buckets(rows, [2.0, 3.0], 5)
    assert [r["id"] for r in chosen] == [6, 0, 5, 3, 1]  # unscored, <2, [2,3), >=3, then round two
    assert len(spread_over_buckets(rows, [2.0], 50)) == len(rows)
    assert exact_match(" 4 ", "4") == 1.0 and exact_match("4", "5") == 0.0
    assert exact_match("", "") == exact_match(" ", "") == 0.0  # a call-only turn: scored by its calls, not as text
    assert markdown_table(3, [["a|b", "r", "x\ny"]]).splitlines()[-1] == "| 3 | a\\|b | r | x y |"


@pytest.mark.parametrize("overrides, message", [
    (["+eval_generation.metrics.bleu=nowhere.bleu"],
     "eval_generation.metrics.bleu='nowhere.bleu': cannot be imported (ModuleNotFoundError"),
    (["+eval_generation.metrics.pi=math.pi"], "eval_generation.metrics.pi='math.pi': is not a function"),
    (["eval_generation.prompts=0"], "eval_generation.prompts=0: must be >= 1"),
    (["+eval_generation.metrics.rouge_l=sft.eval.samples.rouge_l"],
     "eval_generation.metrics.rouge_l='sft.eval.samples.rouge_l': needs rouge_score: pip install rouge-score"),
    (["trainer.eval_strategy=no"], "eval_generation.prompts=8: generation samples are taken at evaluations"),
])
def test_bad_generation_settings_are_one_config_error(monkeypatch, overrides, message):
    import sft.config.schema

    monkeypatch.setattr(sft.config.schema, "installed", lambda module: module != "rouge_score")  # as on this machine
    with pytest.raises(ConfigError) as e:
        check(compose("train", ["eval_generation=default", *overrides]))
    assert str(e.value).startswith(message)


@pytest.mark.slow
def test_samples_go_to_tensorboard_as_a_table_at_every_kth_evaluation_with_their_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = run_train("eval_generation=default", "eval_generation.prompts=4", "eval_generation.max_new_tokens=6",
                     "eval_generation.every=2", "trainer.max_steps=4", "trainer.eval_steps=1", "trainer.logging_steps=1",
                     "trainer.save_steps=4", f"data.eval_file={SMALL_EVAL}", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (events,) = run.glob("runs/*_*/events.out.tfevents.*")
    reader = EventAccumulator(str(events), size_guidance={"tensors": 0, "scalars": 0})
    reader.Reload()
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in reader.Tensors("eval_gen/samples/text_summary")}
    assert sorted(tables) == [0, 2, 4]  # evaluations at steps 0..4, every second one generates
    logged = {e["step"]: e for e in json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
              if "eval_gen/exact_match" in e}
    assert sorted(logged) == [0, 2, 4]
    scored = {r["messages"][-1]["content"]: r["difficulty_score"] for r in map(json.loads, open(SMALL_EVAL))}
    for step, table in tables.items():
        rows = [line.split(" | ") for line in table.splitlines()[2:]]
        assert len(rows) == 4 and all(r[0] == f"| {step}" for r in rows)
        references = [r[2] for r in rows]
        assert len({min(int(scored[ref]), 3) for ref in references}) >= 3  # spread over the buckets
        answers = [r[3].removesuffix(" |") for r in rows]
        hits = sum(a.strip() == ref.strip() for a, ref in zip(answers, references)) / 4
        assert logged[step]["eval_gen/exact_match"] == hits and logged[step]["eval_gen/seconds"] > 0
    scalars = {e.step for e in reader.Scalars("eval/gen/exact_match")}
    assert scalars == {0, 2, 4}
