"""A teacher's top-k logits written once (`sft distill cache`, `sft.model.teacher_cache`) and read by `loss=distill
loss.teacher_cache=<dir>` in its place: a cache of every logit trains as the live teacher does (packed, in pieces,
evaluated); a cache of fewer is the teacher renormalised over its top k, computed apart; the collator lays the logits at
the positions predicting their tokens; a cache of other data, of another teacher, a missing one and a top_k it cannot
give are refused in one line naming the field."""

import json

import pytest
import torch
from conftest import ROWS, composed, moved_tiny, moved_tiny_dir, sft, write_jsonl

from sft.config.schema import ConfigError
from sft.config.validate import check
from sft.data.tokens.batch import TEACHER_TOP_K_COLUMNS, TEACHER_TOP_K_KEYS, trained_positions
from sft.data.tokens.collator import WeightedDataCollator
from sft.loss.builtin import DistillLoss
from sft.loss.terms import SecondOutputs, compute_terms, select_targets
from sft.model.teacher_cache import CacheMeta, check_cache, read_meta, teacher_top_k


def test_top_k_logits_are_the_teachers_largest_at_the_trained_positions(tokenizer):
    teacher = moved_tiny()
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}, {"input_ids": [3, 4], "labels": [-100, 4]}]
    batch = WeightedDataCollator(tokenizer)([{**r, "source_line": i, "sample_weight": 1.0} for i, r in enumerate(rows)])
    values, ids, kept = teacher_top_k(teacher, batch, k=3, chunk_tokens=2)
    with torch.no_grad():
        logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    trained = logits[:, :-1][batch["labels"][:, 1:] != -100]
    expected = trained.topk(3, dim=-1)
    torch.testing.assert_close(values, expected.values, rtol=0, atol=1e-5)
    assert ids.dtype == torch.int32 and ids.tolist() == expected.indices.tolist()
    # the probability they hold: the teacher's softmax summed over them
    torch.testing.assert_close(kept, trained.softmax(-1).topk(3, dim=-1).values.sum(-1), rtol=1e-5, atol=1e-6)


def test_a_cache_is_complete_or_absent_and_one_there_before_goes_only_for_a_complete_one(tmp_path, tokenizer):
    from types import SimpleNamespace

    from sft.data.load import load_sft_datasets
    from sft.data.spec import DataSpec
    from sft.model.teacher_cache import write_cache

    train = load_sft_datasets(DataSpec(train_file=str(write_jsonl(tmp_path / "rows.jsonl", ROWS)), max_length=128),
                              tokenizer, None).train
    data, teacher, path = SimpleNamespace(train=train, eval=None, data_hash="h" * 20), moved_tiny(), tmp_path / "c"
    collator = WeightedDataCollator(tokenizer)
    write_cache(path, teacher, data, collator, top_k=2, identity={})
    assert read_meta(path).top_k == 2

    def failing(rows, calls=[]):  # the teacher's run fails halfway (its third batch)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return collator(rows)

    with pytest.raises(RuntimeError, match="out of memory"):
        write_cache(path, teacher, data, failing, top_k=3, identity={})
    assert read_meta(path).top_k == 2  # the cache there before stands, whole
    write_cache(path, teacher, data, collator, top_k=3, identity={})
    assert read_meta(path).top_k == 3 and read_meta(path).tokens["train"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "rows.jsonl"]  # nothing half-written left


@pytest.mark.parametrize("side, packing", [("right", False), ("left", False), ("right", True)])
def test_the_collator_lays_each_tokens_cached_logits_at_the_position_predicting_it(tokenizer, side, packing,
                                                                                   monkeypatch):
    monkeypatch.setattr(tokenizer, "padding_side", side)
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], TEACHER_TOP_K_COLUMNS[0]: [40, 41, 42, 43],
             TEACHER_TOP_K_COLUMNS[1]: [4.0, 4.1, 4.2, 4.3]},
            {"input_ids": [3, 4, 9], "labels": [-100, 4, -100], TEACHER_TOP_K_COLUMNS[0]: [30, 31],
             TEACHER_TOP_K_COLUMNS[1]: [3.0, 3.1]}]
    batch = WeightedDataCollator(tokenizer, packing=packing)(
        [{**r, "source_line": i, "sample_weight": 1.0} for i, r in enumerate(rows)])
    ids, values = (batch[key] for key in TEACHER_TOP_K_KEYS)
    assert ids.shape == (*batch["labels"].shape, 2)
    targets = trained_positions(batch["labels"], batch.get("position_ids"))
    at = ids[targets["target_rows"], targets["target_cols"]]
    assert at.tolist() == [[40, 41], [42, 43], [30, 31]]  # in the order the loss reads the trained tokens
    assert values[targets["target_rows"], targets["target_cols"]].flatten().tolist() == pytest.approx(
        [4.0, 4.1, 4.2, 4.3, 3.0, 3.1])
    assert int((ids != 0).any(-1).sum()) == 3  # nothing elsewhere


@pytest.mark.parametrize("impl", ["naive", "chunked"])
@pytest.mark.parametrize("divergence", ["forward", "jsd"])
def test_a_cached_teacher_is_its_top_k_renormalised_computed_apart(impl, divergence):
    # Each token's loss against an independent computation: the teacher's softmax over its k largest logits (over T)
    # against the student's log-softmax over the whole vocabulary gathered at those ids (0 log 0 elsewhere).
    torch.manual_seed(0)
    rows, positions, hidden_size, vocab, k, temperature, beta = 2, 6, 8, 11, 4, 2.0, 0.3
    hidden = torch.randn(rows, positions, hidden_size, requires_grad=True)
    lm_head = torch.randn(vocab, hidden_size)
    teacher = torch.randn(rows, positions, vocab) * 3
    labels = torch.randint(0, vocab, (rows, positions))
    labels[:, :2] = -100
    weights = torch.rand(rows, positions) + 0.5
    top = teacher.topk(k, dim=-1)
    second = SecondOutputs(top_ids=top.indices.int(), top_logits=top.values, width=vocab)
    loss = DistillLoss(divergence=divergence, kd_ratio=0.6, temperature=temperature, beta=beta, teacher_cache="x",
                       top_k=k, impl=impl, chunk_tokens=3)
    logits = hidden @ lm_head.T
    t = select_targets(labels, weights)
    terms = compute_terms(t, "weight", None, logits=logits, hidden=hidden, lm_head=lm_head, impl=impl,
                          chunk_tokens=3, token_loss=loss.token_loss, second=second)

    student = logits[t.rows, t.cols].detach()
    s = torch.log_softmax(student / temperature, -1)
    p_t = torch.zeros_like(s).scatter_(1, top.indices[t.rows, t.cols], torch.softmax(
        top.values[t.rows, t.cols] / temperature, -1))
    if divergence == "forward":
        kl = (p_t * (p_t.clamp_min(1e-30).log() - s)).sum(-1)
    else:
        m = beta * p_t + (1 - beta) * s.exp()
        kl = beta * (p_t * (p_t.clamp_min(1e-30).log() - m.log())).sum(-1) \
            + (1 - beta) * (s.exp() * (s - m.log())).sum(-1)
    ce = torch.nn.functional.cross_entropy(student, t.labels, reduction="none")
    expected = ((0.4 * ce + 0.6 * kl * temperature ** 2) * t.weights).sum()
    assert terms.loss_sum.item() == pytest.approx(expected.item(), rel=1e-5)
    terms.loss_sum.backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("overrides, message", [
    (["loss.divergence=reverse"], "loss.divergence='reverse': reverse KL is not defined on a cached teacher"),
    (["data.streaming=true", "trainer.max_steps=10"], "loss.teacher_cache='c': a cache holds a split's rows in order"),
    (["loss.top_k=0"], "loss.top_k=0: must be >= 1"),
])
def test_the_config_refuses_what_a_cache_cannot_give_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check(composed("loss=distill", "loss.teacher_cache=c", *overrides))


def test_a_cache_needs_no_teacher_in_the_config_and_a_live_run_does():
    check(composed("loss=distill", "loss.teacher_cache=c"))
    with pytest.raises(ConfigError, match="reads a teacher's logits and the config has none"):
        check(composed("loss=distill"))


def test_a_cache_of_other_data_another_teacher_or_fewer_logits_is_refused(tmp_path):
    teacher = {"name_or_path": "/models/teacher", "dtype": "float32", "files": [("model.safetensors", 9, 17)],
               "seed": None}
    meta = CacheMeta(data_hash="a" * 20, teacher=json.loads(json.dumps(teacher)), top_k=8, width=300,
                     tokens={"train": 10})
    check_cache(meta, "c", "a" * 20, 8, teacher)  # this run's (its files' tuples read back from JSON as lists)
    check_cache(meta, "c", "a" * 20, 4, None)  # fewer logits, and no teacher named: the cache's
    with pytest.raises(ConfigError, match=r"^loss.teacher_cache='c': written for other data \(hash aaaaaaaaaaaa, this "
                                          r"run's is bbbbbbbbbbbb"):
        check_cache(meta, "c", "b" * 20, 8, teacher)
    with pytest.raises(ConfigError, match=r"^loss.teacher_cache='c': written by another teacher \(/models/teacher; "
                                          r"differs from \+teacher in dtype, name_or_path\)"):
        check_cache(meta, "c", "a" * 20, 8, {**teacher, "name_or_path": "/models/other", "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"^loss.top_k=16: the cache c holds the teacher's top 8 logits a token: at "
                                          "most 8"):
        check_cache(meta, "c", "a" * 20, 16, None)
    with pytest.raises(ConfigError, match=rf"^loss.teacher_cache='{tmp_path / 'none'}': no such dir: write it with sft "
                                          "distill cache"):
        read_meta(tmp_path / "none")
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match=r"no cache.json in it \(not a dir `sft distill cache` wrote, or one it did"):
        read_meta(tmp_path / "half")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return moved_tiny_dir(tmp_path_factory.mktemp("teacher") / "model")


def run_losses(run_dir, overrides):
    from sft.run.build import build

    trainer = build(composed(*overrides), str(run_dir)).trainer
    trainer.train()
    history = trainer.state.log_history
    return trainer, [e["loss"] for e in history if "loss" in e], [e["eval_loss"] for e in history if "eval_loss" in e]


@pytest.mark.parametrize("divergence, packed", [("forward", False), ("jsd", True)])
@pytest.mark.slow  # a cache and two short runs (about 15 s)
def test_a_cache_of_every_logit_trains_as_the_live_teacher(tmp_path, teacher_dir, divergence, packed):
    """k = the vocabulary: the cache is the teacher, so the run's step and eval losses are the live teacher's; packed,
    its micro-batches cut into pieces of at most 48 tokens (the cached logits cut with them)."""
    from sft.commands.distill import cache
    from sft.model.loading import load_model
    from sft.model.teacher_cache import CachedTeacher

    vocab = load_model("tiny").config.vocab_size
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    common = [f"data.train_file={rows}", f"data.eval_file={rows}", "loss=distill", "loss.kd_ratio=0.7",
              "loss.temperature=2", f"loss.divergence={divergence}", "loss.alpha=1", "trainer.max_steps=3",
              "trainer.logging_steps=1", "trainer.eval_strategy=steps", "trainer.eval_steps=3",
              "trainer.save_strategy=no", "trainer.report_to=[]", "trainer.per_device_train_batch_size=2",
              "trainer.gradient_accumulation_steps=2", f"loss.top_k={vocab}"]
    if packed:
        common += ["data.packing=true", "trainer.micro_batch_tokens=48"]
    teacher = ["+teacher=path", f"teacher.name_or_path={teacher_dir}"]
    said = cache([*common, *teacher, f"loss.teacher_cache={tmp_path / 'cache'}"])
    assert f"the top {vocab} logits of {teacher_dir}" in said
    meta = json.loads((tmp_path / "cache" / "cache.json").read_text())
    assert meta["top_k"] == vocab and meta["tokens"]["train"] == meta["tokens"]["eval"] > 0
    assert meta["kept_mass"]["train"]["p5"] == pytest.approx(1.0)  # every logit: all of the teacher's probability

    _, live, live_eval = run_losses(tmp_path / "live", [*common, *teacher])
    # the packed run names its +teacher too: the cache is checked to be that teacher's, which is never loaded
    trainer, cached, cached_eval = run_losses(tmp_path / "cached", [*common, *(teacher if packed else []),
                                                                    f"loss.teacher_cache={tmp_path / 'cache'}"])
    assert isinstance(trainer.second_model, CachedTeacher)
    assert len(cached) == 3 and cached == pytest.approx(live, abs=1e-5)
    assert len(cached_eval) >= 1 and cached_eval == pytest.approx(live_eval, abs=1e-5)


@pytest.mark.slow  # a cache written and a run refused, by the command line (about 20 s)
def test_the_command_writes_a_cache_and_a_run_refuses_one_of_other_data_in_one_line(tmp_path, teacher_dir):
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    other = write_jsonl(tmp_path / "other.jsonl", ROWS[:-1])
    common = ["loss=distill", "data.eval_file=null", f"loss.teacher_cache={tmp_path / 'cache'}", "loss.top_k=4"]
    written = sft("distill", "cache", *common, f"data.train_file={rows}", "+teacher=path",
                  f"teacher.name_or_path={teacher_dir}")
    assert written.returncode == 0, written.stderr[-3000:]
    assert "the top 4 logits of" in written.stdout and "train tokens" in written.stdout
    assert "train: the top 4 hold " in written.stdout and "of the teacher's probability a token on average" in \
        written.stdout
    too_many = sft("distill", "cache", *common[:-1], "loss.top_k=100000", f"data.train_file={rows}",
                   "+teacher=path", f"teacher.name_or_path={teacher_dir}", f"loss.teacher_cache={tmp_path / 'c2'}")
    assert too_many.returncode == 2 and "Traceback" not in too_many.stderr
    assert "config: loss.top_k=100000: larger than the teacher's vocabulary" in too_many.stderr
    assert not (tmp_path / "c2").exists()
    no_teacher = sft("distill", "cache", *common, f"data.train_file={rows}")
    assert no_teacher.returncode == 2 and "config: teacher: the teacher to cache: add +teacher=path" in \
        no_teacher.stderr
    from conftest import run_train

    refused = run_train(*common, f"data.train_file={other}", "trainer.max_steps=1",
                        f"hydra.run.dir={tmp_path / 'run'}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"loss.teacher_cache='{tmp_path / 'cache'}': written for other data" in refused.stderr
