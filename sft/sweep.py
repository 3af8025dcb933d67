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
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


def expand(overrides: list[str]) -> list[list[str]]:
    """The override list of every job, in Hydra's order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from sft.config import compose

    plain = [o for o in overrides if not o.startswith("hydra.sweep.dir=")]
    cfg = compose("train", [o for o in plain if "," not in o], return_hydra_config=True)
    params = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.params or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + plain)
    return [job for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None) for job in batch]


JOB_RECORD = "sweep_job.json"  # in each job dir: the overrides that made the job


def _identity(overrides: list[str]) -> list[str]:
    """The overrides that decide what a job computes (not where it writes, not how the sweep goes)."""
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "sweep.", "resume="))]


def start_job(run_dir: str | Path, number: int, overrides: list[str], resume: bool):
    """Record the job's overrides in its dir; with `sweep.resume`, return its results if it already
    finished (`results.json` ok: nothing to run). A job dir holding another job is a `ConfigError`."""
    from sft.config import ConfigError
    from sft.results import RunResults

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
    record.write_text(json.dumps({"overrides": mine}) + "\n")
    return None


def main(argv: list[str] | None = None) -> None:
    from sft.config import ConfigError, compose
    from sft.preemption import PREEMPTED_EXIT_CODE
    from sft.report import ReportError, write_report
    from sft.results import RunResults
    from sft.tracking import log_sweep_report, sweep_experiment

    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if a not in ("-m", "--multirun")]
    sweep_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")),
                     time.strftime("multirun/%Y-%m-%d/%H-%M-%S"))
    jobs = expand(overrides)
    launcher = ["accelerate", "launch", *shlex.split(os.environ.get("SFT_LAUNCH_ARGS", "")), "-m", "sft.train"]
    cfg = compose("train", [o for o in overrides if "," not in o and not o.startswith("hydra.")])
    print(f"[sweep] {len(jobs)} job(s) in {sweep_dir}", flush=True)
    # ./launch.sh signals the whole process group: the running job saves and stops, and this loop sees it
    # preempted. A Python handler, not SIG_IGN, which the job's processes would inherit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    for number, job in enumerate(jobs):
        run_dir = Path(sweep_dir) / str(number)
        try:
            if start_job(run_dir, number, job, cfg.sweep.resume) is not None:
                print(f"[sweep] #{number}: finished before (sweep.resume): skipped", flush=True)
                continue
        except ConfigError as e:
            print(f"error: config: {e}", file=sys.stderr)
            sys.exit(2)
        if cfg.sweep.resume:
            job = [*job, "resume=auto"]
        print(f"[sweep] #{number}: {' '.join(job)}", flush=True)
        started = time.time()
        # Each job is a run of its own (no Hydra multirun): the trackers group and name it as in one.
        env = {**os.environ, "SFT_RUN_NAME": " ".join(job) or "defaults",
               "WANDB_RUN_GROUP": os.environ.get("WANDB_RUN_GROUP", Path(sweep_dir).name),
               "MLFLOW_EXPERIMENT_NAME": sweep_experiment(sweep_dir)}
        proc = subprocess.run([*launcher, *job, f"hydra.run.dir={run_dir}"], stderr=subprocess.PIPE, text=True,
                              env=env)
        sys.stderr.write(proc.stderr[-5000:])
        results = RunResults.read(run_dir)
        if results is not None and results.status == "preempted":  # the machine is going away: so is the sweep
            print(f"[sweep] #{number} preempted; continue with the same command plus sweep.resume=true "
                  f"hydra.sweep.dir={sweep_dir}", file=sys.stderr, flush=True)
            sys.exit(PREEMPTED_EXIT_CODE)
        if proc.returncode != 0 and results is None:
            last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [""]
            RunResults.failed(f"exit code {proc.returncode}: {last[0].strip()}", time.time() - started).write(run_dir)
    try:
        write_report(sweep_dir, cfg.sweep.baseline)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    log_sweep_report(sweep_dir, cfg.trainer.report_to)
    print((Path(sweep_dir) / "sweep_summary.md").read_text())


if __name__ == "__main__":
    main()
