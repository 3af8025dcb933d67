"""`results.json`, what a run reports when it ends: one schema for the trainer, the sweep runner,
`sft.experiments.report` and the bench.

    {"status": "ok", "eval_loss": 0.57, "eval_ce": 0.55, ..., "eval_history": [...]}     a finished run
    {"status": "failed", "error": "ConfigError: ...", "wall_time_s": 3.1}               a failed job
    {"status": "preempted", "checkpoint": ".../checkpoint-40", "global_step": 40, ...}   stopped at a signal
    no file                                                                              an interrupted one

The per-bucket eval losses are one field here (`eval_loss_buckets`, keyed by bucket number) and
`eval_loss_bucket_<k>` keys in the file, as in the training logs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Optional

from sft.files import own_path, write_text
from sft.ranks import is_rank_zero

FILE = "results.json"
EVAL_ROWS = "eval_rows.jsonl"  # the final evaluation, one line per eval sequence (see write_eval_rows)
BUCKET = "eval_loss_bucket_"
TASK_METRICS = ("eval_loss_task_", "eval_ce_task_")  # a mixture's per-task eval metrics (sft.data.splits.mixture)
# the final evaluation's generation metrics (sft.eval.samples), exact match per bucket (sft.eval.generation) and
# benchmark scores (sft.eval.harness), as logged
EVAL_EXTRA = ("eval_gen/", "eval_exact/", "eval_harness/")


@dataclass
class RunResults:
    status: str = "ok"  # ok | failed | preempted; sft.experiments.report shows a job dir without the file as interrupted
    error: Optional[str] = None  # failed: the reason, one line
    checkpoint: Optional[str] = None  # preempted: the checkpoint saved at the signal (resume=auto takes it)
    eval_loss_initial: Optional[float] = None
    eval_loss: Optional[float] = None
    eval_ce: Optional[float] = None
    eval_token_accuracy: Optional[float] = None
    eval_loss_buckets: dict = field(default_factory=dict)  # bucket number -> unweighted eval loss
    eval_tasks: dict = field(default_factory=dict)  # a mixture's eval_loss_task_<task> / eval_ce_task_<task> -> value
    eval_extra: dict = field(default_factory=dict)  # eval_gen/<metric>, eval_harness/<task>/<metric> -> value
    train_loss: Optional[float] = None
    global_step: Optional[int] = None
    train_tokens_per_second: Optional[float] = None
    loss_impl: Optional[str] = None
    train_runtime: Optional[float] = None
    data_hash: Optional[str] = None
    resumed_from: Optional[str] = None
    stopped_early: bool = False
    eval_exact_match_hardest: Optional[float] = None
    wall_time_s: Optional[float] = None
    eval_history: list = field(default_factory=list)  # [{step, eval_loss, eval_ce}] of every evaluation
    # each stop at a signal the run went on from: [{signal, step, checkpoint, time, slurm_job, attempt}]
    preemptions: list = field(default_factory=list)
    slurm_job: Optional[str] = None  # the SLURM job (its last attempt) that ran it, where one did
    # fields the run's controllers contribute (`Controller.results`), each under its own name in the file
    extra: dict = field(default_factory=dict)

    # the fields above a controller may decide; any other name it gives is a field of its own (`extra`)
    CONTROLLER_FIELDS: ClassVar[tuple[str, ...]] = ("stopped_early",)

    def add_controller_results(self, name: str, values: dict) -> None:
        """A controller's `results()`: `stopped_early` sets that field; another name not of this schema is added as
        it is (a JSON value). A name of another field, or one that another controller gave, is an error naming
        the controller."""
        known = {f.name for f in fields(self)} | {"status", "error"}
        for key, value in values.items():
            if key in self.CONTROLLER_FIELDS:
                setattr(self, key, value)
            elif key in known or key.startswith((BUCKET, *TASK_METRICS, *EVAL_EXTRA)):
                raise ValueError(f"controllers.{name}: results() gives {key!r}, a field the run itself reports; "
                                 "name the controller's field otherwise")
            elif key in self.extra:
                raise ValueError(f"controllers.{name}: results() gives {key!r}, which another controller gives too")
            else:
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"controllers.{name}: results() gives {key}={value!r}, not a JSON value "
                                     f"({e})") from None
                self.extra[key] = value

    @classmethod
    def failed(cls, error: BaseException | str, wall_time_s: float, slurm_job: str | None = None,
               before: RunResults | None = None) -> RunResults:
        """A failed run: the error's type and first line (and the SLURM job that ran it, where one did); the stops at a
        signal of the attempts `before` it (their `preemptions`) stay on record."""
        if isinstance(error, BaseException):
            text = str(error).strip()
            error = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
        return cls(status="failed", error=error, wall_time_s=round(wall_time_s, 1), slurm_job=slurm_job,
                   preemptions=list(before.preemptions) if before is not None else [])

    def to_json(self) -> dict:
        if self.status == "failed":
            return {"status": self.status, "error": self.error, "wall_time_s": self.wall_time_s,
                    **({"slurm_job": self.slurm_job} if self.slurm_job else {}),
                    **({"preemptions": self.preemptions} if self.preemptions else {})}
        out = {}
        for key, value in asdict(self).items():
            if key == "eval_loss_buckets":
                out.update({f"{BUCKET}{k}": v for k, v in sorted(value.items(), key=lambda kv: int(kv[0]))})
            elif key in ("eval_tasks", "eval_extra"):
                out.update(sorted(value.items()))
            elif key == "extra":
                out.update(value)
            elif key in ("preemptions", "slurm_job") and not value:
                continue  # only where there were some
            elif key not in ("error", "checkpoint") or value is not None:
                out[key] = value
        return out

    @staticmethod
    def buckets(metrics: dict) -> dict:
        """The `eval_loss_bucket_<k>` entries of metrics (or of the file) as {k: loss}."""
        return {k[len(BUCKET):]: v for k, v in metrics.items() if k.startswith(BUCKET)}

    @staticmethod
    def tasks(metrics: dict) -> dict:
        """The per-task entries of metrics (or of the file), `eval_loss_task_<task>` and `eval_ce_task_<task>`."""
        return {k: v for k, v in metrics.items() if k.startswith(TASK_METRICS)}

    @staticmethod
    def extra_metrics(metrics: dict) -> dict:
        """The generation and benchmark entries of metrics (or of the file): `eval_gen/...`, `eval_exact/...`,
        `eval_harness/...`."""
        return {k: v for k, v in metrics.items() if k.startswith(EVAL_EXTRA)}

    @classmethod
    def from_json(cls, data: dict) -> RunResults:
        known = {f.name for f in fields(cls)} - {"extra"}
        buckets, tasks, measured = cls.buckets(data), cls.tasks(data), cls.extra_metrics(data)
        extra = {k: v for k, v in data.items()
                 if k not in known and k not in tasks and k not in measured and not k.startswith(BUCKET)}
        return cls(**{k: v for k, v in data.items() if k in known}, eval_loss_buckets=buckets, eval_tasks=tasks,
                   eval_extra=measured, extra=extra)

    def write(self, run_dir: str | Path) -> None:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text(own_path(run_dir / FILE), json.dumps(self.to_json(), indent=2) + "\n")

    def record(self, run_dir: str | Path) -> None:
        """A failed job of a sweep (`failed`): its error in the log, and in `results.json` (rank 0); the sweep goes on."""
        import logging

        logging.getLogger("sft").error("job failed (sweep.continue_on_error=true, the sweep goes on): %s", self.error)
        if is_rank_zero():
            self.write(run_dir)

    @classmethod
    def read(cls, run_dir: str | Path) -> RunResults | None:
        """The run's results, or None when it never wrote any (interrupted, or still running)."""
        path = Path(run_dir) / FILE
        return cls.from_json(json.loads(path.read_text())) if path.is_file() else None


def write_eval_rows(run_dir: str | Path, rows: dict, scores: dict, tasks: dict | None = None) -> None:
    """The final evaluation row by row, so that a report can pair two runs on the same rows.

    `rows`: (source, line, view) -> [numerator, denominator, ce sum, tokens, correct] (the trainer's);
    `scores`: (source, line) -> difficulty score; `tasks`: a mixture's source number -> task. One JSON object
    per line (`source` and `task` only in a mixture):
    `{"line": 12, "view": 0, "ce_sum": 3.1, "tokens": 9, "loss_num": 6.2, "loss_den": 18.0, "correct": 7,
    "difficulty_score": 2.0}`.
    """
    tasks = tasks or {}
    with open(own_path(Path(run_dir) / EVAL_ROWS), "w") as f:
        for (source, line, view), (num, den, ce, tokens, correct) in sorted(rows.items()):
            mixture = {"source": source, "task": tasks.get(source)} if tasks else {}
            f.write(json.dumps({**mixture, "line": line, "view": view, "ce_sum": ce, "tokens": int(tokens),
                                "loss_num": num, "loss_den": den, "correct": int(correct),
                                "difficulty_score": scores.get((source, line))}) + "\n")


def read_eval_rows(run_dir: str | Path) -> list[dict] | None:
    """A run's `eval_rows.jsonl` (see `write_eval_rows`), or None when it has none."""
    path = Path(run_dir) / EVAL_ROWS
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
