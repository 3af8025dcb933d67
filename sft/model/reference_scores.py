"""Token weights from a reference model, scored once before training (`loss=reference_weighted`, RHO-1's selective
language modelling): each trained token's excess loss, its cross entropy under the model as training starts minus
under a reference (`+reference=path`: a model fine-tuned on data you trust), and the weights the loss makes of them
(`ReferenceWeightedLoss.weights_of`), multiplied into the training split's `token_weights`.

A token the reference predicts much better than the model is one the model can learn and should; one both find hard
is likely noise, one both find easy is known already. Scored without gradients, a row at a time (a packed batch of
rows where the run packs: its model was checked to keep packed samples apart), each model's logits projected a chunk
of tokens at a time; the scores are cached by what decides them (the data, both models, the seed of a random-init
model), so that a sweep over the same data and models scores once, and holds no reference while it trains.

    excess_losses(model, reference, train, collator)  ->  [0.3, -0.1, 2.2, ...]   one per trained token, row by row
    reference_weighted(train, loss, excess)            ->  the split with `token_weights` (loss.select=top: 0 or 1)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sft.cache import cache_dir
from sft.data.tokens.batch import IGNORE_INDEX, trained_tokens
from sft.loss.logits import LogitTransform

if TYPE_CHECKING:
    import torch

log = logging.getLogger("sft")

BATCH_TOKENS = 8192  # a packed scoring batch's tokens


def trained_hidden(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`model`'s final hidden states at each position of a collated `batch` that predicts a trained token (`[N,
    hidden]`, in the batch's order: row by row, a packed row's samples apart by their `position_ids`) and those tokens
    (`[N]`), on the model's device, without gradients and without its logits (the callers project them a chunk at a
    time)."""
    import torch

    from sft.model.packing import PACKING_KWARGS
    from sft.model.second_model import forward_keeping_hidden

    device = next(model.parameters()).device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()
              if k in ("input_ids", "attention_mask", "position_ids", *PACKING_KWARGS)}
    labels = batch["labels"].to(device)
    rows, cols = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    no_logits = torch.empty(0, dtype=torch.long, device=device)
    with torch.no_grad():
        _, hidden = forward_keeping_hidden(model, model.get_decoder(), **inputs, logits_to_keep=no_logits)
    return hidden[rows, cols], labels[:, 1:][rows, cols]


def token_losses(model, batch: dict, chunk_tokens: int = 1024) -> torch.Tensor:
    """Each trained token's cross entropy under `model` on a collated `batch` (`trained_hidden`), in the batch's order,
    float32, without gradients; the logits a chunk of tokens at a time, as the lean loss projects them
    (`sft.loss.kernels.chunked_linear_cross_entropy`, the model's own post-projection step included)."""
    import torch

    from sft.loss.kernels import chunked_linear_cross_entropy

    hidden, targets = trained_hidden(model, batch)
    with torch.no_grad():
        # the weight detached: a trained model's output layer would otherwise get its gradient computed
        _, ce, _, _ = chunked_linear_cross_entropy(hidden, model.get_output_embeddings().weight.detach(), targets,
                                                   torch.ones(len(targets), device=hidden.device), chunk_tokens,
                                                   transform=LogitTransform.of(model.config))
    return ce


def scoring_batches(dataset, collator, packed: bool):
    """The split's rows as collated batches, in order: one row each, or (`packed`) rows packed into one of about
    `BATCH_TOKENS` tokens."""
    batch, tokens = [], 0
    for row in dataset:
        batch.append(row)
        tokens += len(row["input_ids"])
        if not packed or tokens >= BATCH_TOKENS:
            yield collator(batch)
            batch, tokens = [], 0
    if batch:
        yield collator(batch)


def excess_losses(model, reference, dataset, collator, packed: bool = False) -> np.ndarray:
    """Every trained token's excess loss, `ce(model) - ce(reference)`, over the rows of `dataset` in order (each row's
    tokens at `trained_tokens`), both models in eval mode on their own devices (the model's mode given back)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        scores = [(token_losses(model, batch) - token_losses(reference, batch).to(next(model.parameters()).device))
                  .cpu() for batch in scoring_batches(dataset, collator, packed)]
    finally:
        model.train(was_training)
    return torch.cat(scores).numpy() if scores else np.zeros(0, dtype=np.float32)


def scores_key(identity: dict) -> str:
    """The cache key of a split's scores: a hash of what decides them."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def weights_fingerprint(name_or_path: str) -> list | None:
    """A local model directory's files by name, size and modification time (the same path trained again is another
    model); None for a hub id or a file the sft cache builds."""
    path = Path(name_or_path)
    if not path.is_dir():
        return None
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in path.iterdir() if p.is_file())


def model_identity(node, seed: int) -> dict:
    """What decides a model a config section (`model`, `teacher`, `reference`) builds: its knobs, a local dir's files
    (`weights_fingerprint`) and, for a random-init one, the `seed`."""
    from omegaconf import OmegaConf

    return {**OmegaConf.to_container(node, resolve=True), "files": weights_fingerprint(str(node.name_or_path)),
            "seed": seed if node.get("random_init") else None}


def cached_scores(key: str, count: int, compute) -> np.ndarray:
    """The scores cached under `key` (`$SFT_CACHE/reference_scores/<key>.npy`), else `compute()`'s, written there
    (complete or absent: written aside and renamed); a cached file of another length than `count` is recomputed."""
    path = cache_dir() / "reference_scores" / f"{key}.npy"
    if path.is_file():
        scores = np.load(path)
        if len(scores) == count:
            log.info("loss: reference scores of %d tokens from the cache (%s)", count, path)
            return scores
    scores = np.asarray(compute(), dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    with open(partial, "wb") as f:
        np.save(f, scores)
    os.replace(partial, path)
    return scores


def trained_counts(dataset) -> list[int]:
    """Each row's number of trained tokens (`trained_tokens`)."""
    return [len(trained_tokens(labels)) for labels in dataset["labels"]]


def reference_weighted(dataset, loss, excess: np.ndarray, counts: list[int] | None = None):
    """`dataset` with each trained token's `token_weights` times the loss's weight of its excess loss
    (`loss.weights_of(excess)`; `excess` in the order of `trained_tokens` row by row), other tokens' unchanged;
    `counts`: the rows' `trained_counts`, where the caller has them."""
    weights = loss.weights_of(excess).astype(np.float32)
    counts = trained_counts(dataset) if counts is None else counts
    if sum(counts) != len(weights):
        raise ValueError(f"{len(weights)} reference scores for {sum(counts)} trained tokens")
    starts = np.concatenate([[0], np.cumsum(counts)])

    def weigh(batch, indices):
        out = []
        for i, ids, labels, own in zip(indices, batch["input_ids"], batch["labels"],
                                       batch.get("token_weights") or [None] * len(indices)):
            w = np.ones(len(ids), dtype=np.float32) if own is None else np.asarray(own, dtype=np.float32)
            w[trained_tokens(labels)] *= weights[starts[i]:starts[i + 1]]
            out.append(w)
        return {"token_weights": out}

    fingerprint = scores_key({"of": dataset._fingerprint, "weights": hashlib.sha256(weights.tobytes()).hexdigest()})
    return dataset.map(weigh, batched=True, with_indices=True, new_fingerprint=fingerprint, desc="reference weights")


def weigh_by_reference(data, loss, the_model, model_node, reference_node, tokenizer, packed: bool, seed: int,
                       device=None):
    """`data` (`sft.data.load.SFTData`) with its training split weighed by the excess loss of the model as it starts
    (`the_model()`, built from `model_node`, the config's `model` section) against the reference (`reference_node`, its
    `reference` section): from the cache where the data, both models (and `seed`, for a random-init model) were scored
    before, else scored now on `device` (the model built, left there; the reference loaded, checked to share its
    vocabulary, run and freed). The scores' key joins the data's identity, so that a resume under another reference is
    refused as other data is. Returns that data and the excess losses."""
    from sft.data.tokens.collator import WeightedDataCollator
    from sft.model.second_model import load_second_model

    identity = {"data": data.data_hash, "model": model_identity(model_node, seed),
                "reference": model_identity(reference_node, seed)}
    key = scores_key(identity)
    counts = trained_counts(data.train)
    count = sum(counts)

    def score() -> np.ndarray:
        model = the_model()
        reference = load_second_model(reference_node, "reference", tokenizer, packed)
        if device is not None:
            model.to(device)
        reference.requires_grad_(False).eval().to(next(model.parameters()).device)
        log.info("loss: scoring %d trained tokens with the model and the reference (once; cached as %s)", count, key)
        try:
            return excess_losses(model, reference, data.train, WeightedDataCollator(tokenizer, packing=packed), packed)
        finally:
            del reference

    excess = cached_scores(key, count, score)
    log.info("loss: %s", loss.describe_weights(excess))
    weighed = dataclasses.replace(data, train=reference_weighted(data.train, loss, excess, counts),
                                  identity={**data.identity, "reference_scores": key})
    return weighed, excess
