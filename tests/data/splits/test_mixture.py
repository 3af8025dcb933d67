"""Multi-task mixtures (`data.mixture`): each source drawn by its ratio or epochs, read in its own format,
trained as it would be alone, weighted by its task's loss weight; per-task eval metrics equal the model's own
losses on each task's rows; the data hash covers the mixture; bad mixtures are one config error."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import ROWS, chat, run_train, write_jsonl

from sft.config import ConfigError, check, compose
from sft.data.load import load_sft_datasets
from sft.data.splits.mixture import draw, draw_counts
from sft.data.spec import DataSpec
from sft.loss.builtin import HardSampleLoss

MORE = [chat(f"What is {a} + {b}?", str(a + b), score) for a, b, score in
        ((12, 30, 1.0), (7, 7, 2.0), (400, 600, 3.0), (5, 9, 0.5))]


def sharegpt(rows):
    """The rows in ShareGPT form with the score in a column of another name."""
    return [{"conversations": [{"from": "human", "value": r["messages"][0]["content"]},
                               {"from": "gpt", "value": r["messages"][1]["content"]}],
             "difficulty": r["difficulty_score"]} for r in rows]


@pytest.fixture
def sources(tmp_path):
    """A JSONL source of 8 rows and a Parquet ShareGPT source of 4, each with an eval file."""
    from datasets import Dataset

    chats = write_jsonl(tmp_path / "chats.jsonl", ROWS)
    write_jsonl(tmp_path / "chats_eval.jsonl", ROWS[:3])
    Dataset.from_list(sharegpt(MORE)).to_parquet(tmp_path / "math.parquet")
    Dataset.from_list(sharegpt(MORE[:2])).to_parquet(tmp_path / "math_eval.parquet")
    return {"chats": str(chats), "chats_eval": str(tmp_path / "chats_eval.jsonl"),
            "math": str(tmp_path / "math.parquet"), "math_eval": str(tmp_path / "math_eval.parquet")}


def mixture(sources, chats=None, math=None):
    return [{"train_file": sources["chats"], "eval_file": sources["chats_eval"], "task": "chats", **(chats or {})},
            {"train_file": sources["math"], "eval_file": sources["math_eval"], "task": "math",
             "columns": {"score": "difficulty"}, **(math or {})}]


def override(value) -> str:
    """A value in Hydra's override grammar: `[{train_file:'a.jsonl',ratio:1}]`."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(override, value)) + "]"
    return f"'{value}'" if isinstance(value, str) else json.dumps(value)


def load(tokenizer, mix, loss=None, seed=0):
    return load_sft_datasets(DataSpec(train_file=None, max_length=128, mixture=mix, mixture_seed=seed), tokenizer, loss)


def sequences(split) -> list[tuple]:
    return [(r.get("source", 0), r["source_line"], tuple(r["input_ids"]), tuple(r["labels"])) for r in split]


def test_counts_follow_the_ratios_or_epochs_and_draw_whole_copies_then_distinct_rows():
    assert draw_counts([1000, 200], [1, 1], [None, None]) == [600, 600]
    assert draw_counts([1000, 200], [0.7, 0.3], [None, None]) == [840, 360]
    assert draw_counts([1000, 200], [None, None], [None, 2.5]) == [1000, 500]
    rng = np.random.default_rng(0)
    drawn = Counter(draw(4, 10, rng).tolist())
    assert sorted(drawn.values()) == [2, 2, 3, 3]  # every row twice, two of them once more
    assert sorted(Counter(draw(10, 4, rng).tolist()).values()) == [1, 1, 1, 1]  # no row twice
    assert draw(50, 30, np.random.default_rng(1)).tolist() == draw(50, 30, np.random.default_rng(1)).tolist()


def test_each_source_is_drawn_by_its_share_and_trains_exactly_as_alone(tokenizer, sources):
    loss = HardSampleLoss(alpha=1.0)
    data = load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 1, "loss_weight": 2.5}), loss)
    drawn = Counter(r["source"] for r in data.train)
    assert drawn == {0: 6, 1: 6}  # 12 rows in all, half each: 6 of the 8 chats, each of the 4 math rows 1.5 times
    per_row = Counter((r["source"], r["source_line"]) for r in data.train)
    assert len([k for k in per_row if k[0] == 0]) == 6 and max(v for k, v in per_row.items() if k[0] == 0) == 1
    assert sorted(v for k, v in per_row.items() if k[0] == 1) == [1, 1, 2, 2]
    alone = {0: load_sft_datasets(DataSpec(train_file=sources["chats"], max_length=128), tokenizer, loss),
             1: load_sft_datasets(DataSpec(train_file=sources["math"], max_length=128,
                                           columns={"score": "difficulty"}), tokenizer, loss)}
    as_alone = {(s, r["source_line"]): (tuple(r["input_ids"]), tuple(r["labels"]), r["sample_weight"])
                for s, d in alone.items() for r in d.train}
    for r in data.train:
        ids, labels, weight = as_alone[(r["source"], r["source_line"])]
        assert (tuple(r["input_ids"]), tuple(r["labels"])) == (ids, labels)
        assert r["sample_weight"] == pytest.approx(weight * (2.5 if r["source"] == 1 else 1.0))
    assert Counter(r["source"] for r in data.eval) == {0: 3, 1: 2}  # both eval sets, whole
    assert data.tasks == {0: "chats", 1: "math"} and data.source_name("eval", 1) == sources["math_eval"]
    again = load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 1, "loss_weight": 2.5}), loss)
    assert sequences(again.train) == sequences(data.train)  # the draw is seeded
    reseeded = [load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 1}), seed=s) for s in range(1, 4)]
    assert any(sorted(sequences(d.train)) != sorted(sequences(data.train)) for d in reseeded)


def test_epochs_repeat_a_source_and_a_fraction_takes_part_of_it(tokenizer, sources):
    data = load(tokenizer, mixture(sources, {"epochs": 0.5}, {"epochs": 3}))
    assert Counter(r["source"] for r in data.train) == {0: 4, 1: 12}
    assert set(Counter((r["source"], r["source_line"]) for r in data.train if r["source"] == 1).values()) == {3}


def test_the_data_hash_covers_the_mixture_and_a_change_is_named(tokenizer, sources):
    from sft.training.checkpoints.resume import data_changes

    base = load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 1}))
    changed = {"ratio": load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 3})),
               "seed": load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 1}), seed=7),
               "weight": load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 1, "loss_weight": 2})),
               "task": load(tokenizer, mixture(sources, {"ratio": 1}, {"ratio": 1, "task": "sums"}))}
    assert len({base.data_hash, *(d.data_hash for d in changed.values())}) == 5
    assert data_changes(base.identity, changed["ratio"].identity) == ["mixture[1].ratio: 1 -> 3"]
    assert data_changes(base.identity, changed["seed"].identity) == ["mixture_seed: 0 -> 7"]


@pytest.mark.parametrize("entries, extra, message", [
    ([{"ratio": 0}], [], "data.mixture[0].ratio=0.0: must be a finite number > 0"),
    ([{"ratio": 1, "epochs": 2}], [], "data.mixture[0].ratio=1.0: give ratio or epochs, not both"),
    ([{"ratio": 1}, {"epochs": 2}], [], "data.mixture: mixes ratio and epochs"),
    ([{"task": "a"}, {"task": "a"}], [], "data.mixture[1].task='a': names another source's task too"),
    ([{"task": "a b"}], [], "data.mixture[0].task='a b': must be letters, digits"),
    ([{"loss_weight": -1}], [], "data.mixture[0].loss_weight=-1.0: must be a finite number >= 0"),
    ([{"eval_file": "EVAL"}], [], "data.mixture[0].eval_file='EVAL': needs a task name"),
    ([{"train_file": "/nonexistent.jsonl"}], [], "data.mixture[0].train_file='/nonexistent.jsonl': no such file"),
    ([{}], ["data.train_file=TRAIN"], "data.train_file='TRAIN': must be null with data.mixture"),
])
def test_a_bad_mixture_is_one_config_error_naming_the_source_and_field(sources, entries, extra, message):
    mix = [{"train_file": sources["chats"], **e} for e in entries]
    for entry in mix:
        entry.update({k: sources["chats_eval"] for k, v in entry.items() if v == "EVAL"})
    overrides = ["data=mixture", "data.mixture=" + override(mix)]
    overrides += [o.replace("TRAIN", sources["chats"]) for o in extra]
    with pytest.raises(ConfigError) as e:
        check(compose("train", overrides))
    assert str(e.value).replace(sources["chats"], "TRAIN").replace(sources["chats_eval"], "EVAL").startswith(message)


def test_a_mixture_sources_format_outside_the_formats_is_refused_at_composition(sources):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose("train", ["data=mixture", "data.mixture=" + override([{"train_file": sources["chats"],
                                                                       "format": "chatml"}])])
    assert "Invalid value 'chatml', expected one of [auto, messages, sharegpt, alpaca, prompt_completion]" in str(
        e.value.__cause__)


def test_a_source_whose_share_draws_no_row_is_refused(tokenizer, sources):
    from sft.data.rows.reading import DataError

    with pytest.raises(DataError, match=r"data.mixture\[1\] \(math\): its share draws no row of its 4"):
        load(tokenizer, mixture(sources, {"ratio": 1000}, {"ratio": 0.01}))


@pytest.mark.slow
def test_a_mixture_run_reports_each_task_as_the_models_own_loss_and_a_changed_mixture_is_not_resumed(
        tmp_path, tokenizer, sources):
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    from sft.experiments.report import write_report
    from sft.experiments.results import RunResults

    run = tmp_path / "run"
    mix = mixture(sources, {"ratio": 1}, {"ratio": 1, "loss_weight": 3})
    overrides = ["data=mixture", "data.mixture=" + override(mix), "loss=ce", "data.max_length=128",
                 "trainer.max_steps=3", "trainer.save_steps=3", "trainer.eval_steps=3", f"hydra.run.dir={run}"]
    proc = run_train(*overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())

    # the saved model's own loss (transformers' mean over the labelled tokens) on each task's eval rows
    model = AutoModelForCausalLM.from_pretrained(run / "model").eval()
    data = load(tokenizer, mix)
    sums = {}
    with torch.no_grad():
        for r in data.eval:
            ids, labels = torch.tensor([r["input_ids"]]), torch.tensor([r["labels"]])
            n = int((labels[0, 1:] != -100).sum())
            task = sums.setdefault(data.tasks[r["source"]], [0.0, 0])
            task[0] += float(model(input_ids=ids, labels=labels).loss) * n
            task[1] += n
    for task, (ce, n) in sums.items():
        assert results[f"eval_ce_task_{task}"] == pytest.approx(ce / n, rel=1e-4)
        assert results[f"eval_loss_task_{task}"] == pytest.approx(ce / n, rel=1e-4)  # loss=ce, one weight per task
    weighted = (sums["chats"][0] + 3 * sums["math"][0]) / (sums["chats"][1] + 3 * sums["math"][1])
    assert results["eval_loss"] == pytest.approx(weighted, rel=1e-4)  # the task's loss weight, in evaluation too
    rows = [json.loads(line) for line in (run / "eval_rows.jsonl").read_text().splitlines()]
    assert Counter(r["task"] for r in rows) == {"chats": 3, "math": 2}

    (events,) = run.glob("runs/*_*/events.out.tfevents.*")
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})
    reader.Reload()
    logged = reader.Scalars("eval/ce_task_math")
    assert [e.step for e in logged] == [0, 3] and logged[-1].value == pytest.approx(results["eval_ce_task_math"])

    # a sweep of two jobs (this run twice): the report's settings show the task metrics
    sweep = tmp_path / "sweep"
    for job, ratio in enumerate((1, 2)):
        (sweep / str(job) / ".hydra").mkdir(parents=True)
        (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(f"- data.mixture[1].ratio={ratio}\n")
        RunResults.from_json(results).write(sweep / str(job))
    write_report(sweep)
    summary = (sweep / "sweep_summary.md").read_text()
    assert "eval_ce_task_math" in summary and "eval_loss_task_chats" in summary

    changed = mixture(sources, {"ratio": 1}, {"ratio": 2, "loss_weight": 3})
    proc = run_train(*overrides[:1], "data.mixture=" + override(changed), *overrides[2:],
                     "resume=auto")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the data changed since this checkpoint (mixture[1].ratio: 1.0 -> 2.0)" in proc.stderr


def test_inspect_data_names_each_row_by_its_own_source_and_shows_its_tasks_weight(sources):
    from sft.commands.inspect import inspect

    mix = mixture(sources, {"epochs": 1}, {"epochs": 1, "loss_weight": 3})
    report = inspect(["data=mixture", "data.mixture=" + override(mix), "loss=ce"], rows=12, split="train")
    shown = [block for block in report.strip().split("\n\n") if block.startswith("-- ")]
    assert len(shown) == 12  # 8 chats and 4 math rows, epochs 1
    math = [b for b in shown if b.startswith(f"-- {sources['math']}:")]
    assert len(math) == 4 and all("sample weight 3" in b.splitlines()[0] for b in math)
    assert all("sample weight 1" in b.splitlines()[0] for b in shown if b.startswith(f"-- {sources['chats']}:"))
    evaluation = inspect(["data=mixture", "data.mixture=" + override(mix), "loss=ce"], rows=5, split="eval")
    assert evaluation.count(f"-- {sources['chats_eval']}:") == 3 and evaluation.count(f"-- {sources['math_eval']}:") == 2
