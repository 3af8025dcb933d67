"""A refusal found inside the processes of a launch, said once.

Under `./launch.sh --nproc N` every rank runs the same checks (the config against the model, the data, a resume), so a
refusal used to be printed once per rank and then followed by the launcher's `ChildFailedError` traceback. The
launcher (`sft.commands.launch`) gives the ranks a folder (`SFT_RANK_ERRORS`); a rank that stops with a one-line error
records it there instead of printing it (`report`), and the launcher prints one of them, rank 0's or else the first
recorded (`first_error`), and exits with its code:

    rank 0: ConfigError('sp.size', 2, ...)  ->  <folder>/rank-0.json {"rank": 0, "code": 2, "message": "config: ..."}
    rank 1: the same                         ->  <folder>/rank-1.json
    launcher                                 ->  error: config: sp.size=2: ...   (exit 2)

Under SLURM's `srun` (each task a rank, no launcher of sft's around them: `examples/slurm/train.sbatch`), the tasks
record theirs in a folder beside the job's submission (`srun_folder`); rank 0 prints its own, naming its node and
rank, and another rank prints its own only where rank 0 recorded none within `SRUN_WAIT_S` (it alone failed):

    rank 0 on node1, rank 1 on node2: the same refusal  ->  error: config: ... (node1, rank 0)   (once)

Outside such a launch (one process, plain torchrun) the rank prints the error itself, as before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from sft import ranks

ERRORS_ENV = "SFT_RANK_ERRORS"
SRUN_WAIT_S = 10.0


def report(message: str, code: int) -> None:
    """Say `error: <message>`: record it for the launcher where there is one, else print it."""
    folder = os.environ.get(ERRORS_ENV)
    if folder and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if not record(Path(folder), message, code):  # the launcher's folder is gone: said here rather than not at all
            print(f"error: {message}", file=sys.stderr, flush=True)
        return
    if srun_folder() is not None:
        report_under_srun(message, code)
        return
    print(f"error: {message}", file=sys.stderr, flush=True)


def record(folder: Path, message: str, code: int) -> bool:
    """This rank's error as `<folder>/rank-<k>.json`, whole or absent (another process may read meanwhile)."""
    rank = ranks.rank()
    path = folder / f"rank-{rank}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"rank": rank, "code": code, "message": message}))
        partial.rename(path)
    except OSError:
        return False
    return True


def srun_folder() -> Path | None:
    """Where the tasks of a SLURM job step of several tasks record their errors (beside the submission, which the
    nodes share); None outside one."""
    env = os.environ
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) <= 1 or "SLURM_JOB_ID" not in env:
        return None
    return Path(env.get("SLURM_SUBMIT_DIR", "."), ".sft-rank-errors",
                f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}.{env.get('SLURM_RESTART_COUNT', '0')}")


def report_under_srun(message: str, code: int) -> None:
    """Rank 0 says its error, naming its node and rank; another rank says its own only where rank 0 recorded none in
    `SRUN_WAIT_S` (see the module)."""
    folder, rank = srun_folder(), ranks.rank()
    said = f"error: {message} ({os.environ.get('SLURMD_NODENAME', 'this node')}, rank {rank})"
    recorded = record(folder, message, code)
    if rank != 0 and recorded:
        deadline = time.monotonic() + SRUN_WAIT_S
        while time.monotonic() < deadline:
            if (folder / "rank-0.json").is_file():
                return  # rank 0 says it
            time.sleep(0.2)
    print(said, file=sys.stderr, flush=True)


def first_error(folder: str | os.PathLike) -> dict | None:
    """The error to print for a failed launch: rank 0's, else the one recorded first; None where no rank recorded
    one (a crash: its traceback is the rank's own output)."""
    recorded = []
    for path in Path(folder).glob("rank-*.json"):
        try:
            recorded.append((path.stat().st_mtime_ns, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    if not recorded:
        return None
    rank0 = [error for _, error in recorded if error.get("rank") == 0]
    return rank0[0] if rank0 else min(recorded, key=lambda pair: pair[0])[1]
