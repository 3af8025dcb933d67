"""Losses beyond ce: keyword weights from the rendered text, a loss of your own (static weights from any
column, checked knobs, refused bad weights), auxiliary terms exact over the step, the example plugin package
trained from the command line, and every built-in in one sweep."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from conftest import REPO, ROWS, chat, run_train, train_steps, write_jsonl
from sft.config import ConfigError, check, compose
from sft.data.rows import DataError
from sft.data.collator import WeightedDataCollator
from sft.data.load import load_sft_datasets
from sft.loss.builtin import CrossEntropyLoss, KeywordLoss

PLUGIN_DIR = REPO / "examples" / "loss_plugin"
SAFETY = [chat("How do I reset it?", "Never share your PASSWORD; reset it from the login page.", 2.0),
          chat("Are passwords safe in email?", "Passwords in email are not safe.", 1.0),
          chat("Tell me the password policy.", "A password has 12 characters.", 1.0)]


def weighted_text(tokenizer, data, row: int, weight: float) -> str:
    """The decoded tokens of a row that the collator gives loss weight `weight`."""
    batch = WeightedDataCollator(tokenizer)([data.train[row]])
    ids = batch["input_ids"][0][batch["loss_weights"][0] == weight]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("knobs, expected", [
    ({}, ["PASSWORD", "", " password"]),  # case folded, whole words: "Passwords" is another word
    ({"case_fold": False}, ["", "", " password"]),
    ({"whole_words": False}, ["PASSWORD", "Password", " password"]),  # the tokens overlapping "Password"
])
def test_keyword_weights_fall_on_the_assistant_tokens_of_each_phrase(tmp_path, tokenizer, knobs, expected):
    path = write_jsonl(tmp_path / "t.jsonl", SAFETY)
    data = load_sft_datasets(tokenizer, KeywordLoss(phrases=["password"], factor=3.0, **knobs), str(path))
    for row, text in enumerate(expected):  # the prompts say "password" too: never weighted, never trained
        assert weighted_text(tokenizer, data, row, 3.0).strip() == text.strip()


def test_a_phrases_file_is_part_of_the_cache_key_and_a_phrase_that_matches_nothing_warns(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "t.jsonl", SAFETY)
    phrases = tmp_path / "phrases.txt"
    phrases.write_text("# safety words\nlogin page\n\n")
    first = load_sft_datasets(tokenizer, KeywordLoss(phrases_file=str(phrases)), str(path))
    assert weighted_text(tokenizer, first, 0, 3.0).strip() == "login page"
    phrases.write_text("nothing like this\n")  # the same path, other phrases: tokenised again, another hash
    with caplog.at_level("WARNING", logger="sft.data"):
        second = load_sft_datasets(tokenizer, KeywordLoss(phrases_file=str(phrases)), str(path))
    assert second.data_hash != first.data_hash and weighted_text(tokenizer, second, 0, 3.0) == ""
    trained = second.summary["train"].trained_tokens
    assert f"its token weights leave every one of the {trained} trained tokens of {path} at 1" in caplog.text


def test_inspect_data_shows_the_keyword_stretches_and_their_count(tmp_path):
    from sft.inspect_data import inspect

    path = write_jsonl(tmp_path / "t.jsonl", SAFETY[:1])
    report = inspect([f"data.train_file={path}", "data.eval_file=null", "loss=keywords", "loss.phrases=[password]",
                      "loss.regex=false", "loss.alpha=1"], rows=1)
    # difficulty 2, times 3 on the phrase's tokens (the tiny tokenizer spells PASSWORD in 8)
    answer = "⟦Never share your ⟧×2⟦PASSWORD⟧×6⟦; reset it from the login page.<|im_end|>⟧×2"
    assert f"assistant\n{answer}\n" in report
    assert "trained (59.3%), 8 of them reweighted by the loss's token weights\n\ntemplate: " in report


@dataclasses.dataclass(eq=False, kw_only=True)
class FromColumns(CrossEntropyLoss):
    """A user's loss: a row's `domain` column weighs it; `bad` rows give NaN (sample or token weights)."""

    where: str = "sample"

    def sample_weight(self, row):
        if self.where == "sample" and row.get("bad"):
            return float("nan")
        return {"safety": 4.0}.get(row.get("domain"), 1.0)

    def token_weights(self, text, offsets, row):
        weights = np.ones(len(offsets))
        if self.where == "token" and row.get("bad"):
            weights[3] = np.nan
        return weights


def test_a_loss_of_your_own_weighs_rows_by_any_column_and_refuses_nan_weights_naming_the_row(tmp_path, tokenizer):
    rows = [{**SAFETY[0], "domain": "safety"}, {**SAFETY[1], "domain": "chat", "tags": ["a", 1]}, SAFETY[2]]
    data = load_sft_datasets(tokenizer, FromColumns(), str(write_jsonl(tmp_path / "ok.jsonl", rows)))
    assert data.train["loss_weight"] == [4.0, 1.0, 1.0]
    bad = write_jsonl(tmp_path / "bad.jsonl", [SAFETY[0], {**SAFETY[1], "bad": True}])
    with pytest.raises(DataError, match=f"{bad}:2: loss weight: the loss's sample_weight returned nan"):
        load_sft_datasets(tokenizer, FromColumns(), str(bad))
    with pytest.raises(DataError, match=f"{bad}:2: loss.token_weights: the loss returned nan for token 3"):
        load_sft_datasets(tokenizer, FromColumns(where="token"), str(bad))


@pytest.mark.parametrize("overrides, message", [
    (["loss=keywords", "loss.factor=-1"], "loss.factor=-1.0: must be a finite number >= 0"),
    (["loss=focal", "loss.gamma=-0.5"], "loss.gamma=-0.5: must be a finite number >= 0"),
    (["loss=keywords", "loss.phrases_file=/no/such/file"], "loss.phrases_file='/no/such/file': no such file"),
    (["loss=keywords", "loss.phrases=[]"], "loss.phrases=[]: no phrase"),
    (["loss=keywords", "loss.phrases=['a(']"], "loss.phrases='a(': not a regular expression"),
    (["loss=focal", "+loss.gama=2"], "loss.gama: not a knob of sft.loss.builtin.FocalLoss (it takes: alpha,"),
    (["loss._target_=no_such_pkg.Loss"], "loss._target_='no_such_pkg.Loss': cannot be imported "
                                         "(ModuleNotFoundError: No module named 'no_such_pkg')"),
    (["loss._target_=sft.loss.builtin.FocalLoss", "+loss.gamma=-1"], "loss.gamma=-1: must be a finite number >= 0"),
    (["+trainer.max_grad_norm=0.5"], "trainer.max_grad_norm: set by the clip policy: clip=static clip.max_norm=0.5"),
])
def test_bad_loss_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        check(compose("train", overrides))
    assert str(e.value).startswith(message)


@pytest.mark.slow
def test_the_cli_refuses_a_plugin_that_cannot_be_imported_in_one_line():
    proc = run_train("loss._target_=no_such_pkg.Loss")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: config: loss._target_='no_such_pkg.Loss': cannot be "
                                                    "imported (ModuleNotFoundError: No module named 'no_such_pkg')")
    assert "Traceback" not in proc.stderr


def group_rows(n: int) -> list[dict]:
    """`n` rows of ROWS' answers, each with a `group` (pairs in a row, 3 groups) and a `domain`."""
    return [{**ROWS[i % len(ROWS)], "group": f"g{i // 2 % 3}", "domain": "safety" if i % 3 == 0 else "chat"}
            for i in range(n)]


@pytest.fixture
def my_losses(monkeypatch):
    """The example plugin package, importable as a user's PYTHONPATH makes it."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    import my_losses

    return my_losses


def test_an_auxiliary_term_is_summed_over_the_step_as_the_main_loss_is(tmp_path, tokenizer, my_losses):
    from sft.model.loading import load_model
    from sft.training.trainer import aux_batch

    term = my_losses.GroupContrastive(coef=0.5)
    loss = CrossEntropyLoss(aux={"contrastive": term})
    rows = group_rows(8)
    losses, params, trainer = train_steps(tmp_path / "a", tokenizer, loss, 4, 2, rows=rows, steps=1)
    logged = next(e for e in trainer.state.log_history if "loss" in e)

    # Independently: the initial model's decoder on each micro-batch, the term's numerators over its anchors.
    torch.manual_seed(0)
    model, collate = load_model("tiny"), WeightedDataCollator(tokenizer)
    numerators, denominators = [], []
    with torch.no_grad():
        for part in (trainer.train_dataset.select(range(0, 4)), trainer.train_dataset.select(range(4, 8))):
            batch = collate(list(part))
            hidden = model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
            numerators.append(term.numerator(hidden, aux_batch(batch, "contrastive")).item())
            denominators.append(term.denominator(aux_batch(batch, "contrastive")).item())
    assert min(denominators) > 0
    assert logged["aux/contrastive"] == pytest.approx(sum(numerators) / sum(denominators), rel=1e-5)
    ce_losses, _, _ = train_steps(tmp_path / "b", tokenizer, CrossEntropyLoss(), 4, 2, rows=rows, steps=1)
    assert losses[0] == pytest.approx(ce_losses[0] + 0.5 * logged["aux/contrastive"], abs=1e-5)

    # A step of one micro-batch twice is that micro-batch's step: the term is a mean over the step's anchors.
    once_losses, once, _ = train_steps(tmp_path / "c", tokenizer, loss, 4, 1, rows=rows[:4], steps=1)
    twice_losses, twice, _ = train_steps(tmp_path / "d", tokenizer, loss, 4, 2, rows=rows[:4] * 2, steps=1)
    assert twice_losses == pytest.approx(once_losses, abs=1e-5)
    torch.testing.assert_close(twice, once, atol=1e-5, rtol=0)


def test_the_example_domain_weight_multiplies_the_difficulty_weight(tmp_path, tokenizer, my_losses):
    loss = my_losses.DomainWeightedLoss(alpha=1.0, domain_weights={"safety": 4.0})
    data = load_sft_datasets(tokenizer, loss, str(write_jsonl(tmp_path / "t.jsonl", group_rows(6))))
    expected = [(4.0 if i % 3 == 0 else 1.0) * ROWS[i % len(ROWS)]["difficulty_score"] for i in range(6)]
    assert data.train["loss_weight"] == pytest.approx(expected)


@pytest.mark.slow
def test_the_example_plugin_trains_from_the_command_line_and_logs_its_term(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = write_jsonl(tmp_path / "train.jsonl", group_rows(32))
    run = tmp_path / "run"
    proc = run_train(f"hydra.searchpath=[file://{PLUGIN_DIR / 'conf'}]", "loss=domain_weighted",
                     "loss.domain_weights.safety=2", f"data.train_file={train}", "data.eval_file=null",
                     "trainer.max_steps=3", "trainer.per_device_train_batch_size=8",
                     "trainer.gradient_accumulation_steps=2", "trainer.logging_steps=1", f"hydra.run.dir={run}",
                     env={"PYTHONPATH": str(PLUGIN_DIR)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((run / "checkpoint-3" / "sft_state.json").read_text())["config"]["loss"]
    assert config["_target_"] == "my_losses.DomainWeightedLoss" and config["domain_weights"] == {"safety": 2}
    logs = next(d for d in (run / "runs").iterdir() if d.name != "hparams")  # Trainer's runs/<date>_<host>
    events = EventAccumulator(str(logs), size_guidance={"scalars": 0})
    events.Reload()
    values = [e.value for e in events.Scalars("train/aux/contrastive")]
    assert len(values) == 3 and all(math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow
def test_every_built_in_loss_runs_in_one_sweep_and_the_report_compares_them(tmp_path):
    import csv

    evaluation = write_jsonl(tmp_path / "eval.jsonl", [json.loads(line) for line in
                                                        (REPO / "sft/sample_data/validation.jsonl").open()][:48])
    losses = ["ce", "hard_sample", "keywords", "focal", "dft", "length"]
    proc = run_train("-m", f"loss={','.join(losses)}", f"data.eval_file={evaluation}", "trainer.max_steps=2",
                     "trainer.eval_steps=100", "trainer.save_steps=100", "trainer.report_to=[]",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        settings = {row["loss"]: row for row in csv.DictReader(f)}
    assert sorted(settings) == sorted(losses) and settings["ce"]["baseline"] == "True"
    buckets = [k for k in settings["ce"] if k.startswith("eval_loss_bucket_") and k[-1].isdigit()]
    assert len(buckets) == 4
    for name, row in settings.items():  # each compared with ce on eval_ce and every difficulty bucket
        assert all(math.isfinite(float(row[k])) for k in ["eval_ce", *buckets])
        assert name == "ce" or all(math.isfinite(float(row[f"diff_{k}"])) for k in ["eval_ce", *buckets])
