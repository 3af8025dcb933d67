"""The bench's table (`sft.bench.cases`): a case is one row, and the bench is a loop over the table, so a case added
to it runs, feeds its ratios and keeps its target with nothing else changed."""

import ast
from pathlib import Path

import pytest

from sft.bench.cases import CASES, TABLE, TRAINING, Case, Ratio, default_cases, target_of


def test_a_case_added_to_the_table_runs_in_the_rounds_and_feeds_its_ratio_and_target(monkeypatch, capsys):
    """A new training case and a ratio of it against `ce`, added as one row (no other file touched): composed with its
    overrides at each batch size, run in every round, its ratio the median of its per-round ratios, its target
    judged, its name accepted by `bench.cases`."""
    import sft.bench.run

    monkeypatch.setitem(CASES, "ce_lr_high", Case("ce_lr_high", TRAINING, run=None, overrides=("loss=ce",
                                                                                             "trainer.learning_rate=1"),
                                                  ratios={"high_lr_vs_ce": Ratio("ce", target=1.5)}))
    seen = []

    def spawn(case, cfg):
        seen.append((case, cfg.trainer.learning_rate, cfg.trainer.per_device_train_batch_size))
        return {"tokens_per_second": 30.0 if case == "ce_lr_high" else 20.0, "peak_memory_gb": 1.0}

    monkeypatch.setattr(sft.bench.run, "spawn", spawn)
    report = sft.bench.run.run_all(["bench.cases=[ce,ce_lr_high]", "bench.batch_sizes=[8,4]", "bench.repeats=2",
                                    "bench.min_cpu_share=0"])
    assert ("ce_lr_high", 1.0, 8) in seen and ("ce_lr_high", 1.0, 4) in seen and len(seen) == 8
    assert report["ratios"]["high_lr_vs_ce"] == report["ratios"]["high_lr_vs_ce_b4"] == 1.5
    assert report["targets"]["high_lr_vs_ce"] == {"target": 1.5, "kind": "min", "met": True}
    sft.bench.run.print_report(report)
    assert "high_lr_vs_ce" in capsys.readouterr().out


def test_every_ratio_has_one_name_one_case_against_a_case_of_the_table_and_one_target():
    names = [name for case in TABLE for name in case.ratios]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for case in TABLE:
        for name, ratio in case.ratios.items():
            assert ratio.versus is None or ratio.versus in CASES, (case.name, name)
            if ratio.target is not None:
                assert target_of(name) == (ratio.target, "max" if ratio.at_most else "min")
                assert target_of(name + "_b16") == target_of(name)  # at another batch size: the same target
    assert target_of("packing_vs_trl_best") == (1.3, "min") and target_of("stream_peak_rss_ratio") == (1.2, "max")
    assert target_of("lean_loss_gain_memory") is None  # a ratio without a target


def test_the_default_cases_are_the_tables_but_those_on_request_and_a_name_outside_it_is_refused():
    from sft.bench.config import compose
    from sft.config import ConfigError, check

    assert list(compose([]).bench.cases) == default_cases() == [c.name for c in TABLE if not c.on_request]
    assert "packing" in default_cases() and "trl_best" not in default_cases()
    with pytest.raises(ConfigError, match=r"bench.cases=\['pakcing'\]: no such case: pakcing \(cases: raw, hf, ce_naive"):
        check(compose(["bench.cases=[pakcing]"]))


@pytest.mark.parametrize("module", ["run.py", "report.py"])
def test_the_driver_and_the_report_name_no_case(module):
    """Every case's identity is its row: the driver and the report read the table, never test a case by name (the
    chain of `if "<case>" in cases:` blocks the table replaced)."""
    import sft.bench

    tree = ast.parse(Path(sft.bench.__file__).with_name(module).read_text())
    named = sorted({node.value for compare in ast.walk(tree) if isinstance(compare, ast.Compare)
                    for node in ast.walk(compare) if isinstance(node, ast.Constant) and node.value in CASES})
    assert named == [], named
