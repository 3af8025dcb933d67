"""A teacher's top-k logits, written once and read in its place: `sft distill cache` runs the teacher (`+teacher=...`)
over the training and evaluation splits and keeps, at each position that predicts a trained token, its `loss.top_k`
largest logits and their ids; `loss=distill loss.teacher_cache=<dir>` then trains from them, so that a sweep over
the student's settings holds no teacher and runs no teacher forward.

    write_cache(dir, teacher, data, collator, top_k=2, identity)   one row, trained tokens at 2 and 3, V = 5:
        train.ids.npy    [[4, 1], [0, 2]]          int32, each token's k ids, largest logit first
        train.logits.npy [[3.1, 0.2], [1.5, 1.4]]  float32, the teacher's logits there (its own transform applied)
        cache.json       data hash, the teacher's identity, top_k, the output layer's width, tokens per split, the
                         probability the k logits hold a token (mean, 5th percentile: whether k is enough)

The teacher's distribution the loss reads is its top-k renormalised: softmax over the k logits (over T), 0
elsewhere. Forward KL and the skewed Jensen-Shannon divergence are defined on it; reverse KL is not (the student's
mass outside the k would face a teacher probability of 0), and `DistillLoss` refuses it. With k = the vocabulary
the cache is the teacher itself: the run's losses are the live teacher's (tested).

A cache is tied to what decided it: the data's hash (rows, template, tokenizer, max_length: `sft.data.load`) and the
teacher (its config section and, for a local dir, its files). A run refuses a cache of other data, of another
teacher than its `+teacher` where it names one, a missing cache, and a `loss.top_k` larger than the cache holds:
`loss.teacher_cache=...: <why>`, before the first step. Its 8 bytes a kept logit (`top_k` x trained tokens x 8) go
into the splits' columns, as every per-token column does (`with_teacher_top_k`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from sft.cache import building
from sft.config.schema import ConfigError
from sft.data.tokens.batch import TEACHER_TOP_K_COLUMNS, TEACHER_TOP_K_KEYS
from sft.loss.logits import LogitTransform
from sft.model.reference_scores import model_identity, scores_key, scoring_batches, trained_counts, trained_hidden

log = logging.getLogger("sft")

META = "cache.json"
FORMAT = 1  # of the files: a reader refuses another
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class CacheMeta:
    """What a cache dir holds and what decided it (its `cache.json`)."""

    data_hash: str
    teacher: dict  # the teacher's identity (`sft.model.reference_scores.model_identity`)
    top_k: int
    width: int  # the teacher's output layer's rows: the divergence compares the models over their shared columns
    tokens: dict  # split -> its trained tokens (rows of the arrays)
    # split -> the probability the k logits hold a token: {"mean": ..., "p5": its 5th percentile}
    kept_mass: dict = dataclasses.field(default_factory=dict)
    format: int = FORMAT

    @property
    def key(self) -> str:
        """A hash of what decided the cache: joins the run's data identity (a resume under another cache is refused)."""
        return scores_key({"data": self.data_hash, "teacher": self.teacher, "top_k": self.top_k})


def teacher_top_k(model, batch: dict, k: int, chunk_tokens: int = 1024):
    """`model`'s `k` largest logits (`[N, k]` float32, largest first), their ids (`[N, k]` int32) and the probability
    they hold (`[N]`: what the cache keeps of the teacher's distribution, at temperature 1) at each position of a
    collated `batch` that predicts a trained token, in the batch's order (row by row; a packed row's samples apart by
    their `position_ids`), its own post-projection step applied (`LogitTransform`), without gradients; the logits
    projected a chunk of tokens at a time."""
    import torch

    hidden, _ = trained_hidden(model, batch)
    transform = LogitTransform.of(model.config)
    values, ids, kept = [], [], []
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        for start in range(0, len(hidden), chunk_tokens):
            logits = transform((hidden[start:start + chunk_tokens] @ weight.T).float())
            top = logits.topk(k, dim=-1)
            values.append(top.values.cpu())
            ids.append(top.indices.to(torch.int32).cpu())
            kept.append((top.values.logsumexp(-1) - logits.logsumexp(-1)).exp().cpu())
    if not values:
        return torch.zeros(0, k), torch.zeros(0, k, dtype=torch.int32), torch.zeros(0)
    return torch.cat(values), torch.cat(ids), torch.cat(kept)


def write_cache(path: str | os.PathLike, teacher, data, collator, top_k: int, identity: dict,
                packed: bool = False) -> CacheMeta:
    """Run `teacher` (on its device, in eval mode) over `data`'s training and evaluation splits
    (`sft.data.load.SFTData`; a row at a time, or `packed` rows of about 8k tokens: `scoring_batches`) and write its
    `top_k` logits at every trained token to the dir `path`: complete or absent (built aside and renamed), a cache
    there before replaced only once the new one is complete. `identity`: the teacher's (`model_identity`)."""
    width = teacher.get_output_embeddings().weight.shape[0]
    if top_k > width:
        raise ConfigError("loss.top_k", top_k, f"larger than the teacher's vocabulary ({width:,} logits a token)")
    teacher.requires_grad_(False).eval()
    target, tokens, kept_mass = Path(path), {}, {}
    staging = target.with_name(f".{target.name}.new-{os.getpid()}")
    with building(staging) as tmp:  # a failed write leaves nothing behind
        for split in SPLITS:
            dataset = getattr(data, split)
            if dataset is None:
                continue
            started, count = time.perf_counter(), sum(trained_counts(dataset))
            log.info("distill cache: the teacher's top %d logits at %d trained tokens of %s", top_k, count, split)
            found = [teacher_top_k(teacher, batch, top_k) for batch in scoring_batches(dataset, collator, packed)]
            values = np.concatenate([v.numpy() for v, _, _ in found]) if found else np.zeros((0, top_k), np.float32)
            ids = np.concatenate([i.numpy() for _, i, _ in found]) if found else np.zeros((0, top_k), np.int32)
            kept = np.concatenate([m.numpy() for _, _, m in found]) if found else np.zeros(0, np.float32)
            if len(values) != count:
                raise RuntimeError(f"{split}: {len(values)} positions scored for {count} trained tokens")
            if count:
                kept_mass[split] = {"mean": float(kept.mean()), "p5": float(np.quantile(kept, 0.05))}
            np.save(tmp / f"{split}.ids.npy", ids)
            np.save(tmp / f"{split}.logits.npy", values)
            tokens[split] = count
            log.info("distill cache: %s done in %.1f s", split, time.perf_counter() - started)
        meta = CacheMeta(data_hash=data.data_hash, teacher=identity, top_k=top_k, width=width, tokens=tokens,
                         kept_mass=kept_mass)
        (tmp / META).write_text(json.dumps(dataclasses.asdict(meta), indent=1, sort_keys=True, default=str))
    # the new cache is complete: only now does a cache there before leave
    aside = target.with_name(f".{target.name}.replaced-{os.getpid()}")
    if target.exists():
        target.rename(aside)
    staging.rename(target)
    shutil.rmtree(aside, ignore_errors=True)
    return meta


def read_meta(path: str | os.PathLike) -> CacheMeta:
    """The `cache.json` of the cache dir `path`; `ConfigError` on `loss.teacher_cache` where there is none."""
    file = Path(path) / META
    if not file.is_file():
        reason = ("no such dir" if not Path(path).exists() else f"no {META} in it (not a dir `sft distill cache` "
                  "wrote, or one it did not finish)")
        raise ConfigError("loss.teacher_cache", str(path), f"{reason}: write it with sft distill cache <the run's "
                          "overrides> +teacher=... loss.teacher_cache=<dir>")
    try:
        meta = CacheMeta(**json.loads(file.read_text()))
    except (ValueError, TypeError) as e:
        raise ConfigError("loss.teacher_cache", str(path), f"{META} cannot be read ({e}): write the cache again")
    if meta.format != FORMAT:
        raise ConfigError("loss.teacher_cache", str(path), f"written in format {meta.format}, this sft reads "
                          f"{FORMAT}: write the cache again")
    return meta


def check_cache(meta: CacheMeta, path, data_hash: str, top_k: int, teacher: dict | None) -> None:
    """`ConfigError` on `loss.teacher_cache` (or `loss.top_k`) where the cache at `path` is not this run's: written
    for other data, by another teacher than the config's (`teacher`, its identity; None: the config names none), or
    holding fewer than `top_k` logits a token."""
    if meta.data_hash != data_hash:
        raise ConfigError("loss.teacher_cache", str(path), f"written for other data (hash {meta.data_hash[:12]}, this "
                          f"run's is {data_hash[:12]}: other rows, template, tokenizer or max_length): write it again "
                          "for this data")
    if teacher is not None:
        teacher = json.loads(json.dumps(teacher, default=str))  # as its cache.json holds it (tuples as lists)
    if teacher is not None and teacher != meta.teacher:
        differ = sorted(k for k in teacher.keys() | meta.teacher.keys() if teacher.get(k) != meta.teacher.get(k))
        raise ConfigError("loss.teacher_cache", str(path), f"written by another teacher "
                          f"({meta.teacher.get('name_or_path')}; differs from +teacher in {', '.join(differ)}): drop "
                          "+teacher to train from the cache as it is, or write it again with this teacher")
    if top_k > meta.top_k:
        raise ConfigError("loss.top_k", top_k, f"the cache {path} holds the teacher's top {meta.top_k} logits a token: "
                          f"at most {meta.top_k} (or write it again with loss.top_k={top_k})")


def with_teacher_top_k(dataset, path: str | os.PathLike, split: str, top_k: int, key: str):
    """`dataset` (a split, rows in the order the cache was written) with each row's cached teacher logits as its
    `TEACHER_TOP_K_COLUMNS`: its trained tokens' first `top_k` ids and logits, flat (tokens x top_k), which the collator
    lays at the positions predicting them; `key`: the cache's (`CacheMeta.key`), for the split's fingerprint."""
    ids = np.load(Path(path) / f"{split}.ids.npy", mmap_mode="r")
    values = np.load(Path(path) / f"{split}.logits.npy", mmap_mode="r")
    counts = trained_counts(dataset)
    if sum(counts) != len(ids):
        raise ConfigError("loss.teacher_cache", str(path), f"holds {len(ids)} {split} tokens, the split has "
                          f"{sum(counts)}: write it again")
    starts = np.concatenate([[0], np.cumsum(counts)])

    def attach(batch, indices):
        return {TEACHER_TOP_K_COLUMNS[0]: [np.ascontiguousarray(ids[starts[i]:starts[i + 1], :top_k]).ravel()
                                           for i in indices],
                TEACHER_TOP_K_COLUMNS[1]: [np.ascontiguousarray(values[starts[i]:starts[i + 1], :top_k]).ravel()
                                           for i in indices]}

    fingerprint = scores_key({"of": dataset._fingerprint, "teacher_cache": key, "top_k": top_k})
    return dataset.map(attach, batched=True, with_indices=True, new_fingerprint=fingerprint,
                       desc=f"teacher top-{top_k} ({split})")


def cached_teacher(data, path: str | os.PathLike, top_k: int, teacher_node=None, seed: int = 0):
    """`data` (`sft.data.load.SFTData`) with the teacher's cached logits on its splits (checked to be this data's, and
    the config's teacher's where it names one: `teacher_node`), its identity joined by the cache's key (a resume
    under another cache is refused as other data is), and the `CachedTeacher` the trainer reads them with."""
    meta = read_meta(path)
    check_cache(meta, path, data.data_hash, top_k,
                model_identity(teacher_node, seed) if teacher_node is not None else None)
    splits = {split: with_teacher_top_k(getattr(data, split), path, split, top_k, meta.key)
              for split in SPLITS if getattr(data, split) is not None}
    log.info("teacher: its top %d logits a token from the cache %s (written by %s, %s)", top_k, path,
             meta.teacher.get("name_or_path"), ", ".join(f"{meta.tokens.get(s, 0):,} {s} tokens" for s in splits))
    data = dataclasses.replace(data, **splits, identity={**data.identity, "teacher_cache": meta.key, "top_k": top_k})
    return data, CachedTeacher(meta.width)


class CachedTeacher:
    """The teacher as a loss reads it from a cache: each micro-batch's `TEACHER_TOP_K_KEYS`, taken out of it (the
    model's forward never sees them), as `sft.loss.terms.SecondOutputs` (the trainer's second model, as
    `sft.model.second_model.FrozenModel` is for a live one)."""

    def __init__(self, width: int):
        self.width = width

    def outputs(self, inputs: dict, lean: bool):
        from sft.loss.terms import SecondOutputs

        if TEACHER_TOP_K_KEYS[0] not in inputs:
            raise ValueError("loss.teacher_cache: a micro-batch without the cached teacher logits (a split or a "
                             "collator that did not attach them)")
        ids, values = (inputs.pop(key) for key in TEACHER_TOP_K_KEYS)
        return SecondOutputs(top_ids=ids, top_logits=values, width=self.width)

    def parameters(self):
        return iter(())
