"""`./launch.sh -m ...`: a sweep whose jobs each need several processes.

Hydra's `-m` runs every job inside the current process, which cannot work under `accelerate launch`
(every rank would run the whole sweep). Here the overrides are expanded as Hydra's basic sweeper does
(`a=1,2 b=x,y` gives 4 jobs; `hydra.sweeper.params` of the config count too), then each job runs in
turn through `accelerate launch ... -m sft.train` with its own run dir `<sweep dir>/<job number>`,
and the sweep report is written at the end, as after a single-process multirun.

Both kinds of sweep record each job's overrides in its dir (`sweep_job.json`, `start_job`), so that the
same command run again with `hydra.sweep.dir=<that sweep> sweep.resume=true` skips the jobs that finished,
resumes the interrupted ones from their newest complete checkpoint, and refuses a dir of another sweep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sft.config.schema import ConfigError, Schema, knob
from sft.files import own_path, write_text


@dataclass
class SweepConfig(Schema):
    """The `sweep` node: how a multirun goes."""

    continue_on_error: bool = knob(True, "in a multirun, a failing job is recorded and the sweep goes on")
    resume: bool = knob(False, "the same -m command again with hydra.sweep.dir=<that sweep> and sweep.resume=true: "
                        "finished jobs are skipped, interrupted ones resume from their newest complete checkpoint, "
                        "the report is rebuilt")
    baseline: Optional[str] = knob(None, 'the report\'s reference setting, e.g. "loss.alpha=0"; null: the first')




JOB_RECORD = "sweep_job.json"  # in each job dir: the overrides that made the job
def _identity(overrides: list[str]) -> list[str]:
    """The overrides that decide what a job computes (not where it writes, not how the sweep goes)."""
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "sweep.", "resume="))]


def start_job(run_dir: str | Path, number: int, overrides: list[str], resume: bool):
    """Record the job's overrides in its dir; with `sweep.resume`, return its results if it already
    finished (`results.json` ok: nothing to run). A job dir holding another job is a `ConfigError`."""
    from sft.experiments.results import RunResults

    run_dir = Path(run_dir)
    record, mine = run_dir / JOB_RECORD, _identity(overrides)
    if resume and record.is_file():
        theirs = json.loads(record.read_text())["overrides"]
        if theirs != mine:
            ran, asked = (" ".join(o) or "(no overrides)" for o in (theirs, mine))
            raise ConfigError("sweep.resume", True, f"job {number} in {run_dir.parent} ran {ran}, this command's "
                              f"job {number} is {asked}: another sweep (give it its own hydra.sweep.dir)")
        results = RunResults.read(run_dir)
        if results is not None and results.status == "ok":
            return results
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(own_path(record), json.dumps({"overrides": mine}) + "\n")
    return None
