"""`sft sweep -m [sweep overrides]` (what `./launch.sh -m` runs): each job of a sweep in turn through
`accelerate launch`, one run dir per job, then the sweep's report (`sft.experiments.sweep`, `sft.experiments.report`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from sft.experiments.sweep import start_job


def expand(overrides: list[str]) -> list[list[str]]:
    """The override list of every job, in Hydra's order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from sft.config.registry import compose

    plain = [o for o in overrides if not o.startswith("hydra.sweep.dir=")]
    cfg = compose("train", [o for o in plain if "," not in o], return_hydra_config=True)
    params = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.params or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + plain)
    return [job for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None) for job in batch]


def refused_job(overrides: list[str]) -> str | None:
    """The first job of a sweep whose overrides do not compose (`-m trainer.learning_rate=abc,0.001`,
    `-m loss=ce,nonexistent`), as one line naming the job and the knob; None where every job composes. Said before
    any job starts, not as Hydra's text mid-sweep."""
    from sft.config.argv import refused_value

    try:
        jobs = expand([o for o in overrides if o not in ("-m", "--multirun")])
    except Exception:  # noqa: BLE001 - the sweep itself does not parse: Hydra says why as it starts
        return None
    for number, job in enumerate(jobs):
        if (error := refused_value([o for o in job if not o.startswith("hydra.")])) is not None:
            return f"job {number} ({' '.join(o for o in job if not o.startswith('hydra.'))}): {error}"
    return None


def last_error(stderr: str) -> str:
    """What a failed job said: its last `error:` and the lines under it (the bad rows), joined; else its last line.

        "...\nerror: 1 bad row(s) in the data:\n  a.jsonl:1: messages: missing\n"
            -> "1 bad row(s) in the data: a.jsonl:1: messages: missing"
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    starts = [k for k, line in enumerate(lines) if line.startswith("error: ")]
    if not starts:
        return lines[-1] if lines else ""
    return " ".join(lines[starts[-1]:])[len("error: "):]


def start_multirun(argv: list[str]) -> None:
    """Before Hydra runs a sweep in this process (`python -m sft.train -m`): every job's values checked, and the sweep
    dir, where given, claimed for this sweep (`claim_sweep_dir`); an error is one line and exit code 2."""
    from sft.config.schema import ConfigError
    from sft.training.checkpoints.run_dir import claim_sweep_dir

    refused = refused_job(argv)
    sweep_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.sweep.dir=")), None)
    try:
        if refused is None and sweep_dir:
            claim_sweep_dir(sweep_dir.strip("'\""), any(a.lstrip("+") in ("sweep.resume=true", "sweep.resume=True")
                                                        for a in argv))
    except ConfigError as e:
        refused = str(e)
    if refused:
        print(f"error: config: {refused}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    from sft.config.registry import compose
    from sft.config.schema import ConfigError
    from sft.config.secrets import secrets_to_environment
    from sft.experiments.report import ReportError, exit_if_a_job_failed, write_report
    from sft.experiments.results import RunResults
    from sft.experiments.tracking import log_sweep_report, sweep_experiment
    from sft.training.checkpoints.run_dir import claim_sweep_dir
    from sft.training.step.preemption import PREEMPTED_EXIT_CODE

    argv = secrets_to_environment(sys.argv[1:] if argv is None else argv)  # the jobs inherit the environment
    overrides = [a for a in argv if a not in ("-m", "--multirun")]
    sweep_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")),
                     time.strftime("multirun/%Y-%m-%d/%H-%M-%S"))
    jobs = expand(overrides)
    launch_args = shlex.split(os.environ.get("SFT_LAUNCH_ARGS", ""))
    # One process: accelerate's launcher would only set the environment, and kills the job's whole process tree 5 s
    # after a SIGTERM, in the middle of its checkpoint; the job itself is the process to signal and wait for.
    one = "--num_processes" not in launch_args or launch_args[launch_args.index("--num_processes") + 1] == "1"
    launcher = [sys.executable, "-m", "sft.train"] if one else [sys.executable, "-m", "sft.commands.launch",
                                                                  *launch_args, "-m", "sft.train"]
    if refused := refused_job(overrides):
        print(f"error: config: {refused}", file=sys.stderr)
        sys.exit(2)
    cfg = compose("train", [o for o in overrides if "," not in o and not o.startswith("hydra.")])
    try:
        claim_sweep_dir(sweep_dir, cfg.sweep.resume)  # held until this process ends (a dir named by time: new)
    except ConfigError as e:
        print(f"error: config: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"[sweep] {len(jobs)} job(s) in {sweep_dir}", flush=True)
    # ./launch.sh signals the whole process group: the running job saves and stops (or finishes, after its training),
    # and this loop, which noted the signal, starts no other job. A Python handler, not SIG_IGN, which the job's
    # processes would inherit.
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signalled.append(signum))
    for number, job in enumerate(jobs):
        run_dir = Path(sweep_dir) / str(number)
        try:
            if start_job(run_dir, number, job, cfg.sweep.resume) is not None:
                print(f"[sweep] #{number} ({number + 1}/{len(jobs)}): finished before (sweep.resume): skipped",
                      flush=True)
                continue
        except ConfigError as e:
            print(f"error: config: {e}", file=sys.stderr)
            sys.exit(2)
        if cfg.sweep.resume:
            job = [*job, "resume=auto"]
        print(f"[sweep] #{number} ({number + 1}/{len(jobs)}, {number} done): {' '.join(job)}", flush=True)
        started = time.time()
        # Each job is a run of its own (no Hydra multirun): the trackers group and name it as in one.
        env = {**os.environ, "SFT_RUN_NAME": " ".join(job) or "defaults",
               "WANDB_RUN_GROUP": os.environ.get("WANDB_RUN_GROUP", Path(sweep_dir).name),
               "MLFLOW_EXPERIMENT_NAME": sweep_experiment(sweep_dir)}
        proc = subprocess.run([*launcher, *job, f"hydra.run.dir={run_dir}"], stderr=subprocess.PIPE, text=True,
                              env=env)
        sys.stderr.write(proc.stderr[-5000:])
        results = RunResults.read(run_dir)
        if signalled or (results is not None and results.status == "preempted"):  # the machine is going away
            state = "preempted" if results is None or results.status != "ok" else "finished"
            print(f"[sweep] #{number} {state} at a signal; the sweep stops: continue with the same command plus "
                  f"sweep.resume=true hydra.sweep.dir={sweep_dir}", file=sys.stderr, flush=True)
            sys.exit(PREEMPTED_EXIT_CODE)
        if proc.returncode != 0 and results is None:
            RunResults.failed(f"exit code {proc.returncode}: {last_error(proc.stderr)}",
                              time.time() - started).write(run_dir)
    try:
        write_report(sweep_dir, cfg.sweep.baseline)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full disk: the jobs are done, the report is not
        print(f"error: the sweep's report cannot be written into {sweep_dir}: {e.strerror} ({e.filename}); "
              f"sft report {sweep_dir} writes it once there is room", file=sys.stderr)
        sys.exit(1)
    log_sweep_report(sweep_dir, cfg.trainer.report_to)
    print((Path(sweep_dir) / "sweep_summary.md").read_text())
    exit_if_a_job_failed(sweep_dir)


if __name__ == "__main__":
    main()
