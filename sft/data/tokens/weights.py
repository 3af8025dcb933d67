"""The loss's static weights of a split, as its columns: each sequence's `sample_weight` and auxiliary
terms' row values; and the difficulty scores a run needs (`scores_used_by`, `require_scores`)."""

from __future__ import annotations

import hashlib
import logging
import math
from typing import TYPE_CHECKING

import numpy as np

from sft.data.rows.reading import DataError, Rejected, finite_number, raw_rows
from sft.data.rows.sources import Source
from sft.data.tokens.columns import assistant_tokens, column
from sft.data.tokens.labels import row_fields

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


def scores_used_by(loss, controllers: dict | None = None) -> list[str]:
    """What in a run uses the rows' `difficulty_score`: the loss where it says it reads it
    (`reads_difficulty_score`: an `alpha` not 0), and controllers that say they need it (`needs_difficulty_score`:
    the curriculum).

        HardSampleLoss(alpha=1), {"curriculum": Curriculum()}  ->  ["loss.alpha=1", "controllers.curriculum"]
    """
    users = []
    if getattr(loss, "reads_difficulty_score", False):
        users.append(f"loss.alpha={loss.alpha:g}" if hasattr(loss, "alpha") else "loss")
    return users + [f"controllers.{name}" for name, c in (controllers or {}).items()
                    if getattr(c, "needs_difficulty_score", False)]


def require_scores(ds: datasets.Dataset, source: Source, needed_by: list[str],
                    on_error: str) -> tuple[datasets.Dataset, list[Rejected]]:
    """Where the run uses difficulty scores (`needed_by` names what does), a row without one is refused
    (`on_error=raise`) or left out and reported (`skip`); elsewhere it trains with no score.

        needed_by=["loss.alpha=1"], a row of line 7 without a score  ->
            DataError "train.jsonl:7: difficulty_score: missing (used by loss.alpha=1: set data.default_score=...)"
    """
    path = str(source)
    lines = column(ds, "source_line")
    unscored = sorted({line for line, score in zip(lines, column(ds, "difficulty_score")) if math.isnan(score)})
    if not unscored:
        return ds, []
    if not needed_by:
        log.info("data: %s: %d row(s) without difficulty_score, which this run does not use", path, len(unscored))
        return ds, []
    reason = missing_score_reason(needed_by)
    raw = raw_rows(source, set(unscored))
    missing = [Rejected(path, line, "difficulty_score", reason, raw[line]) for line in unscored]
    if on_error == "raise":
        raise DataError(missing)
    unscored_set = set(unscored)
    kept = ds.select([i for i, line in enumerate(lines) if line not in unscored_set])
    if len(kept) == 0:
        raise DataError([f"{path}: file: no row with a difficulty_score (used by {', '.join(needed_by)})"])
    return kept, missing


def missing_score_reason(needed_by: list[str]) -> str:
    """Why a row without `difficulty_score` is refused, and the knobs that help (`needed_by`: `scores_used_by`'s)."""
    without = [("train without difficulty weights: loss=ce" if user.startswith("loss.") else f"drop it: ~{user}")
               for user in needed_by]
    return (f"missing (used by {', '.join(needed_by)}: set data.default_score=<score> to give every such row one, map "
            f"the file's score column with data.columns.score=<column>, or {' and '.join(without)})")


def with_static_weights(ds: datasets.Dataset, loss, path: str, scale: float = 1.0) -> datasets.Dataset:
    """The split with `sample_weight` (the loss's sample weight of each sequence, times `scale`: a mixture source's
    `loss_weight`) and the auxiliary terms' row values as columns. A weight that is not a finite number >= 0
    is a `DataError` naming the row."""
    lines = None
    for name, values in _static_values(ds, loss).items():
        is_weight = name == "sample_weight"
        array = np.asarray(values, dtype=np.float64) if isinstance(values, np.ndarray) else None
        if array is not None:
            bad = np.flatnonzero(~np.isfinite(array) | (array < 0 if is_weight else False)).tolist()
        else:
            bad = [i for i, v in enumerate(values) if not finite_number(v, nonnegative=is_weight)]
        if bad:
            lines = lines or column(ds, "source_line")
            what, need = (("sample weight: the loss's sample_weight", "a finite number >= 0") if is_weight
                          else (f"loss.aux.{name[4:]}: row_value", "a finite number"))
            shown = [values[i] if array is None else float(values[i]) for i in bad]
            raise DataError([f"{path}:{lines[i]}: {what} returned {v!r} (must be {need})" for i, v in zip(bad, shown)])
        # Fingerprinted by the values' bytes, which datasets would otherwise do by pickling the list.
        array = (np.asarray(values, dtype=np.float64) if array is None else array) * (scale if is_weight else 1.0)
        fingerprint = hashlib.sha256(ds._fingerprint.encode() + name.encode() + array.tobytes()).hexdigest()[:16]
        ds = ds.add_column(name, array, new_fingerprint=fingerprint)
    return ds.remove_columns(["truncated", "extra"])


def _static_values(ds: datasets.Dataset, loss) -> dict[str, np.ndarray | list]:
    """Each sequence's sample weight (`sample_weight`, by `loss.sample_weights`: from the scores alone where the loss
    weighs by difficulty only) and auxiliary terms' values (`aux_<name>`), from the row's columns as the loss's hooks
    see them (`row_fields`, with its `assistant_tokens`)."""
    if loss is None:
        return {"sample_weight": np.ones(len(ds))}
    rows: list[dict] = []

    def row_columns() -> list[dict]:
        if not rows:
            rows.extend(row_fields(score, extra) | {"assistant_tokens": n} for score, extra, n
                        in zip(column(ds, "difficulty_score"), column(ds, "extra"), assistant_tokens(ds)))
        return rows

    scores = np.asarray(column(ds, "difficulty_score"), dtype=np.float64)
    values = {"sample_weight": loss.sample_weights(scores, row_columns)}
    for name, term in dict(getattr(loss, "aux", None) or {}).items():
        values[f"aux_{name}"] = [term.row_value(r) for r in row_columns()]
    return values
