"""A loss of your own (`sft.loss.base.WeightedTokenLoss`): it weighs rows by any column, bad weights are refused naming
the row, bad settings naming the key (the example package trains from the command line: tests/e2e/test_examples.py)."""

import dataclasses

import numpy as np
import pytest
from conftest import ROWS, SAFETY, group_rows, run_train, write_jsonl

from sft.config import ConfigError, check, compose
from sft.data.load import load_sft_datasets
from sft.data.rows.reading import DataError
from sft.data.spec import DataSpec
from sft.loss.builtin import CrossEntropyLoss, HardSampleLoss


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
    data = load_sft_datasets(DataSpec(train_file=str(write_jsonl(tmp_path / "ok.jsonl", rows))), tokenizer,
                             FromColumns())
    assert data.train["sample_weight"] == [4.0, 1.0, 1.0]
    bad = write_jsonl(tmp_path / "bad.jsonl", [SAFETY[0], {**SAFETY[1], "bad": True}])
    with pytest.raises(DataError, match=f"{bad}:2: sample weight: the loss's sample_weight returned nan"):
        load_sft_datasets(DataSpec(train_file=str(bad)), tokenizer, FromColumns())
    with pytest.raises(DataError, match=f"{bad}:2: loss.token_weights: the loss returned nan for token 3"):
        load_sft_datasets(DataSpec(train_file=str(bad)), tokenizer, FromColumns(where="token"))


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


def test_the_example_domain_weight_multiplies_the_difficulty_weight(tmp_path, tokenizer, my_losses):
    loss = my_losses.DomainWeightedLoss(alpha=1.0, domain_weights={"safety": 4.0})
    data = load_sft_datasets(DataSpec(train_file=str(write_jsonl(tmp_path / "t.jsonl", group_rows(6)))), tokenizer,
                             loss)
    expected = [(4.0 if i % 3 == 0 else 1.0) * ROWS[i % len(ROWS)]["difficulty_score"] for i in range(6)]
    assert data.train["sample_weight"] == pytest.approx(expected)


def test_difficulty_weights_of_a_split_are_each_rows_difficulty_weight():
    scores = np.array([0.0, 0.5, 1.0, 3.0, 1e300, float("nan"), 7.25])
    for loss in (HardSampleLoss(alpha=1.0), HardSampleLoss(alpha=2.0, max_weight=10.0, min_weight=0.5),
                 HardSampleLoss(alpha=-1.5), HardSampleLoss(alpha=0.0), CrossEntropyLoss()):
        expected = [loss.difficulty_weight(s) for s in scores]
        np.testing.assert_array_equal(loss.difficulty_weights(scores), expected)
