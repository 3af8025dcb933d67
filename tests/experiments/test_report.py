"""The sweep report's statistics on sweep dirs written by hand: settings grouped over seeds, t intervals,
paired differences by seed, bootstraps over eval rows for a single seed, failed seeds counted, a baseline
that names no setting refused."""

import csv
import json

import numpy as np
import pytest
import yaml
from scipy import stats

from sft.experiments.report import ReportError, write_report
from sft.experiments.results import RunResults, write_eval_rows
from sft.commands.report import main


def job(sweep, number, overrides, eval_ce=None, status="ok", rows=None):
    d = sweep / str(number)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"eval_buckets": [1.0, 2.0, 3.0]}))
    if status == "ok":
        RunResults(eval_ce=eval_ce, eval_loss=eval_ce, eval_exact_match_hardest=0.1 * number).write(d)
    elif status == "failed":
        RunResults.failed("ValueError: boom", 1.0).write(d)
    if rows is not None:
        write_eval_rows(d, rows, {(0, line): line % 4 for (_, line, _) in rows})


def settings(sweep):
    with open(sweep / "sweep_summary.csv") as f:
        return list(csv.DictReader(f))


CE = {("0", "1"): 0.84, ("0", "2"): 0.80, ("0", "3"): 0.86, ("0.5", "1"): 0.43, ("0.5", "2"): 0.47, ("0.5", "3"): 0.41}


def test_seeds_are_grouped_with_t_intervals_and_paired_differences_to_the_baseline(tmp_path):
    for n, ((alpha, seed), ce) in enumerate(CE.items()):
        job(tmp_path, n, [f"loss.alpha={alpha}", f"trainer.seed={seed}"], ce)
    write_report(tmp_path, baseline="loss.alpha=0")
    base, other = settings(tmp_path)
    assert (base["loss.alpha"], base["seeds"], other["seeds"]) == ("0", "3/3", "3/3") and "trainer.seed" not in base
    values = [CE["0.5", s] for s in "123"]
    low, high = stats.t.interval(0.95, 2, loc=np.mean(values), scale=stats.sem(values))
    assert float(other["eval_ce"]) == pytest.approx(np.mean(values))
    assert float(other["eval_ce_std"]) == pytest.approx(np.std(values, ddof=1))
    assert (float(other["eval_ce_low"]), float(other["eval_ce_high"])) == (pytest.approx(low), pytest.approx(high))
    diffs = [CE["0.5", s] - CE["0", s] for s in "123"]  # paired by seed
    low, high = stats.t.interval(0.95, 2, loc=np.mean(diffs), scale=stats.sem(diffs))
    assert float(other["diff_eval_ce"]) == pytest.approx(np.mean(diffs))
    assert (float(other["diff_eval_ce_low"]), float(other["diff_eval_ce_high"])) == (pytest.approx(low),
                                                                                    pytest.approx(high))
    assert base["diff_eval_ce"] == ""  # the baseline is not compared with itself
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "| loss.alpha | seeds | eval_ce | diff_eval_ce |" in md and " *" in md.split("## Jobs")[0]
    with open(tmp_path / "sweep_jobs.csv") as f:
        assert len(list(csv.DictReader(f))) == 6


def test_a_failed_seed_is_counted_never_averaged(tmp_path):
    job(tmp_path, 0, ["loss.alpha=0", "trainer.seed=1"], 0.8)
    job(tmp_path, 1, ["loss.alpha=0", "trainer.seed=2"], status="failed")
    job(tmp_path, 2, ["loss.alpha=0", "trainer.seed=3"], status="interrupted")
    job(tmp_path, 3, ["loss.alpha=0", "trainer.seed=4"], 0.9)
    write_report(tmp_path)
    (row,) = settings(tmp_path)
    assert row["seeds"] == "2/4" and float(row["eval_ce"]) == pytest.approx(0.85)


def rows_of(ce_per_token: list[float], tokens: int = 10) -> dict:
    """Eval rows: (source, line, view) -> [numerator, denominator, ce sum, tokens, correct]."""
    return {(0, line, 0): [c * tokens, tokens, c * tokens, tokens, tokens // 2]
            for line, c in enumerate(ce_per_token, 1)}


def test_one_seed_gets_a_bootstrap_over_its_eval_rows_and_a_paired_one_against_the_baseline(tmp_path):
    rng = np.random.default_rng(5)
    base = rng.uniform(0.5, 1.5, 200)
    better = base * 0.9  # every row 10% lower: a real, paired difference
    job(tmp_path, 0, ["loss.alpha=0"], float(base.mean()), rows=rows_of(base.tolist()))
    job(tmp_path, 1, ["loss.alpha=0.5"], float(better.mean()), rows=rows_of(better.tolist()))
    write_report(tmp_path)
    first, second = settings(tmp_path)
    assert first["seeds"] == "1/1" and float(first["eval_ce"]) == pytest.approx(base.mean())
    spread = base.std(ddof=1) / np.sqrt(len(base))  # the interval is about mean +- 2 standard errors
    assert float(first["eval_ce_low"]) == pytest.approx(base.mean() - 1.96 * spread, abs=spread / 2)
    assert float(first["eval_ce_high"]) == pytest.approx(base.mean() + 1.96 * spread, abs=spread / 2)
    assert float(second["diff_eval_ce"]) == pytest.approx(better.mean() - base.mean())
    assert float(second["diff_eval_ce_high"]) < 0  # paired by row: clearly below 0
    unpaired = np.sqrt(2) * spread  # what comparing the two intervals alone would give: overlap
    assert float(second["diff_eval_ce_high"]) - float(second["diff_eval_ce_low"]) < unpaired
    write_report(tmp_path)
    assert settings(tmp_path) == [first, second]  # a fixed bootstrap seed: the same report every time


def test_a_baseline_that_names_no_setting_is_refused_naming_the_settings(tmp_path, capsys):
    job(tmp_path, 0, ["loss.alpha=0"], 0.8)
    job(tmp_path, 1, ["loss.alpha=1"], 0.7)
    with pytest.raises(ReportError, match=r"sweep.baseline='loss.alpha=3' names no setting of this sweep; its "
                                          r"settings: loss.alpha=0; loss.alpha=1"):
        write_report(tmp_path, baseline="loss.alpha=3")
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "--baseline", "loss.alpha=3"])
    assert stop.value.code == 2 and "names no setting" in capsys.readouterr().err
    main([str(tmp_path), "--baseline", "loss.alpha=1"])
    assert json.dumps(settings(tmp_path)[1]["baseline"]) == '"True"'


def test_eval_rows_give_each_metric_as_the_trainer_computes_it():
    from sft.experiments.stats import EvalRows

    rows = [{"line": 1, "view": 0, "ce_sum": 2.0, "tokens": 4, "loss_num": 6.0, "loss_den": 8.0, "correct": 1,
             "difficulty_score": 0.5},
            {"line": 2, "view": 0, "ce_sum": 9.0, "tokens": 3, "loss_num": 9.0, "loss_den": 3.0, "correct": 3,
             "difficulty_score": 2.5},
            {"line": 2, "view": 1, "ce_sum": 1.0, "tokens": 2, "loss_num": 1.0, "loss_den": 2.0, "correct": 0,
             "difficulty_score": 2.5}]
    ev = EvalRows(rows, edges=[1.0, 2.0, 3.0])
    assert ev.metric("eval_ce")[0] == pytest.approx(12 / 9)
    assert ev.metric("eval_loss")[0] == pytest.approx(16 / 13)
    assert ev.metric("eval_token_accuracy")[0] == pytest.approx(4 / 9)
    assert ev.metric("eval_loss_bucket_0")[0] == pytest.approx(2 / 4)  # score < 1
    assert ev.metric("eval_loss_bucket_2")[0] == pytest.approx(10 / 5)  # 2 <= score < 3: both of line 2
    assert ev.metric("exact_match_hardest") is None  # not a ratio of row sums: no bootstrap


def test_benchmark_and_tool_call_scores_get_intervals_and_differences_like_every_metric(tmp_path):
    # eval_harness/... and eval_gen/... of results.json (issue 31) are report columns with t intervals over seeds.
    scores = {("0", "1"): 0.50, ("0", "2"): 0.55, ("0", "3"): 0.45, ("1", "1"): 0.70, ("1", "2"): 0.75,
              ("1", "3"): 0.60}
    for n, ((alpha, seed), score) in enumerate(scores.items()):
        d = tmp_path / str(n)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"loss.alpha={alpha}", f"trainer.seed={seed}"]))
        RunResults(eval_ce=1.0, eval_extra={"eval_harness/gsm8k/exact_match": score,
                                            "eval_gen/tool_call_accuracy": score / 2}).write(d)
        assert RunResults.read(d).eval_extra == {"eval_harness/gsm8k/exact_match": score,
                                                 "eval_gen/tool_call_accuracy": score / 2}
    write_report(tmp_path, baseline="loss.alpha=0")
    base, other = settings(tmp_path)
    values = [scores["1", s] for s in "123"]
    low, high = stats.t.interval(0.95, 2, loc=np.mean(values), scale=stats.sem(values))
    assert float(other["eval_harness/gsm8k/exact_match"]) == pytest.approx(np.mean(values))
    assert float(other["eval_harness/gsm8k/exact_match_low"]) == pytest.approx(low)
    assert float(other["diff_eval_gen/tool_call_accuracy"]) == pytest.approx(np.mean(values) / 2 - 0.25)
    markdown = (tmp_path / "sweep_summary.md").read_text()
    assert "eval_harness/gsm8k/exact_match" in markdown and "eval_gen/tool_call_accuracy" in markdown


def test_the_verdict_says_which_setting_is_better_on_what_and_how_sure(tmp_path):
    for n, ((alpha, seed), ce) in enumerate(CE.items()):
        job(tmp_path, n, [f"loss.alpha={alpha}", f"trainer.seed={seed}"], ce)
    write_report(tmp_path, baseline="loss.alpha=0")
    md = (tmp_path / "sweep_summary.md").read_text()
    verdict = md.split("## Verdict\n\n")[1].split("\n\n")[0].splitlines()
    diffs = [CE["0.5", s] - CE["0", s] for s in "123"]
    low, high = stats.t.interval(0.95, 2, loc=np.mean(diffs), scale=stats.sem(diffs))
    assert verdict[0].startswith(f"- loss.alpha=0.5 against loss.alpha=0 (3 seeds, paired): **better** on eval_ce "
                                 f"({np.mean(diffs):+.3g} [{low:+.3g}, {high:+.3g}])")
    assert verdict[1] == "- Lowest mean eval_ce (unweighted cross entropy, comparable across losses): loss.alpha=0.5 " \
                         f"({np.mean([CE['0.5', s] for s in '123']):.4g})."
    assert len(verdict) == 2 and md.count("# Sweep") == 1  # three seeds: no warning; one heading


def test_two_seeds_are_warned_about_and_an_interval_spanning_zero_is_not_resolved(tmp_path):
    for n, (alpha, seed, ce) in enumerate([("0", "1", 0.80), ("0", "2", 0.90), ("1", "1", 0.82), ("1", "2", 0.87)]):
        job(tmp_path, n, [f"loss.alpha={alpha}", f"trainer.seed={seed}"], ce)
    write_report(tmp_path)
    verdict = (tmp_path / "sweep_summary.md").read_text().split("## Verdict\n\n")[1].split("\n\n")[0]
    assert verdict.startswith("- loss.alpha=1 against loss.alpha=0 (2 seeds, paired): ")
    assert "**not resolved** on eval_ce (-0.005 [" in verdict
    assert ("- Warning: a setting has 2 seeds: a 95% t interval from 2 values is 12.7 standard errors wide each side "
            "(from 3: 4.3, from 5: 2.8)") in verdict


@pytest.mark.parametrize("metric, higher, comparable", [
    ("eval_ce", False, True), ("eval_loss", False, False), ("eval_loss_bucket_3", False, True),
    ("eval_token_accuracy", True, True), ("eval_exact/bucket_2", True, True), ("exact_match_hardest", True, True),
    ("eval_harness/sft_sample_addition_ppl/byte_perplexity", False, True), ("eval_harness/seconds", False, False),
    ("eval_harness/sft_sample_addition_choice/acc", True, True), ("eval_gen/tool_calls_malformed", False, True),
    ("train_tokens_per_second", True, False)])
def test_each_metric_has_a_direction_and_only_those_alike_under_every_loss_are_judged(metric, higher, comparable):
    from sft.experiments.verdict import comparable as is_comparable
    from sft.experiments.verdict import higher_is_better

    assert higher_is_better(metric) == higher and is_comparable(metric) == comparable


def test_a_difference_is_resolved_only_by_an_interval_that_excludes_zero_from_more_than_one_seed():
    """The verdict and the plot's colours read one rule: seeds that all differ by the same amount resolve it, one
    seed's bootstrap over one row (low == high) or a single value does not, nor does an interval spanning 0."""
    from sft.experiments.verdict import resolved
    from sft.experiments.stats import Interval

    assert resolved(Interval(0.02, 0.02, 0.02), seeds=3) and resolved(Interval(-0.1, -0.2, -0.01), seeds=3)
    assert not resolved(Interval(0.02, 0.02, 0.02), seeds=1)
    assert not resolved(Interval(0.0, 0.0, 0.0), seeds=3) and not resolved(Interval(0.02), seeds=3)
    assert not resolved(Interval(0.02, -0.01, 0.05), seeds=3)


def test_failed_jobs_are_named_with_their_slurm_job_and_a_setting_with_none_finished_is_said_so(tmp_path):
    """A sweep whose every job of one setting failed (under SLURM: killed, its node down): the report names each failed
    job, its SLURM job and the first line of its error, and says the setting has nothing to compare; it warned of
    "a setting has 0 seeds ... nan standard errors wide" before."""
    for number, seed in enumerate((1, 2, 3)):
        job(tmp_path, number, ["loss=ce", f"trainer.seed={seed}"], 0.8 + 0.01 * seed)
    for number, seed in enumerate((1, 2, 3), 3):
        d = tmp_path / str(number)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["loss=focal", f"trainer.seed={seed}"]))
        RunResults.failed(f"SLURM job 7_{number} ended NODE_FAIL: node down\nmore", 2.0, f"7_{number}").write(d)
    write_report(tmp_path)
    text = (tmp_path / "sweep_summary.md").read_text()
    assert "- loss=focal: no job of this setting finished (0/3): nothing to compare; see Failed jobs" in text
    assert "## Failed jobs\n\n- job 3 (SLURM job 7_3): failed: SLURM job 7_3 ended NODE_FAIL: node down\n" in text
    assert "nan" not in text and "0 seeds" not in text
