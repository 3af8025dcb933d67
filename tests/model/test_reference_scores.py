"""Token weights from a reference model (`sft.model.reference_scores`, `loss=reference_weighted`): each trained token's
score is the model's own loss minus the reference's, the same packed as one row at a time; the weights fall on the
trained tokens, times the weights they had; scores are cached by what decides them, and a run trains on them from the
command line (`sft inspect` showing the kept tokens), refusing what cannot be scored in one line naming the field."""

import json

import numpy as np
import pytest
import torch
from conftest import ROWS, composed, moved_tiny, moved_tiny_dir, run_train, write_jsonl

from sft.config.schema import ConfigError
from sft.config.validate import check
from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec
from sft.data.tokens.collator import WeightedDataCollator
from sft.loss.builtin import ReferenceWeightedLoss
from sft.model.loading import load_model
from sft.model.reference_scores import (cached_scores, excess_losses, reference_weighted, scoring_batches,
                                        token_losses, trained_tokens)


@pytest.fixture(scope="module")
def train(tmp_path_factory, tokenizer):
    path = write_jsonl(tmp_path_factory.mktemp("rows") / "rows.jsonl", ROWS)
    return load_sft_datasets(DataSpec(train_file=str(path), max_length=128), tokenizer, None).train


def test_trained_tokens_are_the_labelled_positions_after_the_first():
    assert trained_tokens([-100, -100, 7, 8, -100]).tolist() == [2, 3]
    assert trained_tokens([5, 6, -100]).tolist() == [1]  # the first label has no position before it


def test_a_tokens_score_is_the_models_own_loss_minus_the_references_packed_or_not(train, tokenizer):
    model, reference = load_model("tiny"), moved_tiny()
    rows = WeightedDataCollator(tokenizer)
    own = []
    for batch in scoring_batches(train, rows, packed=False):
        ids, labels = batch["input_ids"], batch["labels"]
        with torch.no_grad():
            mine = model(input_ids=ids, labels=labels).loss
            theirs = reference(input_ids=ids, labels=labels).loss
        ours = token_losses(model, batch)
        assert ours.mean().item() == pytest.approx(mine.item(), rel=1e-5)  # the model's own (token-mean) loss
        assert len(ours) == len(trained_tokens(labels[0]))
        own.append((mine - theirs).item())
    model.train()
    one_by_one = excess_losses(model, reference, train, rows, packed=False)
    assert model.training  # scored in eval mode (no dropout), its mode given back
    packed = excess_losses(model, reference, train, WeightedDataCollator(tokenizer, packing=True), packed=True)
    np.testing.assert_allclose(packed, one_by_one, atol=1e-5)
    counts = [len(trained_tokens(labels)) for labels in train["labels"]]
    means = [chunk.mean() for chunk in np.split(one_by_one, np.cumsum(counts)[:-1])]
    np.testing.assert_allclose(means, own, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "cohere", "granite"])  # plain, softcapped, scaled logits
def test_a_tokens_score_is_its_cross_entropy_from_the_models_own_logits_on_other_families(arch):
    import torch.nn.functional as F
    from architectures import batch, tiny

    model = tiny(arch, tie=False)
    ids, mask, labels = batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    trained = labels[:, 1:] != -100
    own = F.cross_entropy(logits[:, :-1][trained].float(), labels[:, 1:][trained], reduction="none")
    ours = token_losses(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, chunk_tokens=5)
    torch.testing.assert_close(ours, own, atol=1e-5, rtol=1e-5)


def test_the_weights_fall_on_the_trained_tokens_times_the_weights_they_had(train):
    excess = np.arange(sum(len(trained_tokens(labels)) for labels in train["labels"]), dtype=np.float32)
    loss = ReferenceWeightedLoss(select="soft", temperature=50.0)
    doubled = train.map(lambda row: {"token_weights": [2.0] * len(row["input_ids"])})
    weighed = reference_weighted(doubled, loss, excess)
    expected = loss.weights_of(excess)
    start = 0
    for row in weighed:
        at = trained_tokens(row["labels"])
        w = np.asarray(row["token_weights"])
        np.testing.assert_allclose(w[at], 2 * expected[start:start + len(at)], rtol=1e-6)
        assert (np.delete(w, at) == 2.0).all()  # the untrained tokens' untouched
        start += len(at)
    with pytest.raises(ValueError, match="3 reference scores for"):
        reference_weighted(train, loss, excess[:3])


def test_scores_are_cached_by_key_and_a_cache_of_another_length_is_recomputed():
    key = f"test-{np.random.default_rng().integers(1 << 30)}"
    first = cached_scores(key, 3, lambda: [1.0, 2.0, 3.0])
    again = cached_scores(key, 3, lambda: pytest.fail("scored again"))
    assert first.tolist() == again.tolist() == [1.0, 2.0, 3.0]
    assert cached_scores(key, 2, lambda: [5.0, 6.0]).tolist() == [5.0, 6.0]


@pytest.mark.parametrize("overrides, message", [
    (["loss=reference_weighted"], "loss: ReferenceWeightedLoss reads a reference's logits and the config has none"),
    (["loss=reference_weighted", "+reference=model"], "reference.name_or_path='tiny': is the model itself: every "
                                                      "token's excess loss would be 0"),
    (["loss=reference_weighted", "+reference=path", "reference.name_or_path=x", "data.streaming=true",
      "trainer.max_steps=10"],
     "loss: ReferenceWeightedLoss scores the whole training split before training: not with a stream"),
])
def test_the_config_refuses_what_cannot_be_scored_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        check(composed(*overrides))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    return moved_tiny_dir(tmp_path_factory.mktemp("reference") / "model")


@pytest.mark.slow  # an inspection and a short run (about 10 s)
def test_inspect_shows_the_kept_tokens_and_a_run_trains_on_them_from_the_cache(tmp_path, reference_dir, train):
    """As docs/losses.md advises before a long run: `sft inspect` scores the split (and caches the scores); the run
    then reads them, never loading the reference, and names them in its data identity."""
    from conftest import sft

    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    common = ["loss=reference_weighted", "+reference=path", f"reference.name_or_path={reference_dir}",
              "loss.top_ratio=0.5", f"data.train_file={rows}"]
    shown = sft("inspect", "--rows", "8", *common)
    assert shown.returncode == 0, shown.stderr[-2000:]
    tokens = sum(len(trained_tokens(labels)) for labels in train["labels"])
    assert f"reference weights: {round(0.5 * tokens)} of {tokens} trained tokens kept (top 50%" in shown.stdout
    trained = sum(int(line.split(", ")[1].split(" trained")[0]) for line in shown.stdout.splitlines()
                  if line.startswith("-- "))
    assert trained == round(0.5 * tokens)  # every row shown (all 8): its trained tokens are the kept ones
    run = run_train(*common, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert run.returncode == 0, run.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"loss: reference scores of {tokens} tokens from the cache" in log and "loss: scoring" not in log
    assert "reference: " not in log  # the reference never loaded
    assert f"of {tokens:,} trained tokens kept (top 50%" in log
    identity = json.loads((tmp_path / "run" / "checkpoint-2" / "sft_state.json").read_text())["data"]
    assert len(identity["reference_scores"]) == 20
    # rows without the difficulty score a hard-sample weighting reads: shown as they are, with what training refuses
    unscored = write_jsonl(tmp_path / "unscored.jsonl", [{"messages": row["messages"]} for row in ROWS])
    shown = sft("inspect", *common[:-1], f"data.train_file={unscored}", "loss.alpha=1")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "note: loss=ReferenceWeightedLoss reads each row's difficulty_score" in shown.stdout
