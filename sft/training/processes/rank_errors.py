"""A refusal found inside the processes of a launch, said once.

Under `./launch.sh --nproc N` every rank runs the same checks (the config against the model, the data, a resume), so a
refusal used to be printed once per rank and then followed by the launcher's `ChildFailedError` traceback. The
launcher (`sft.commands.launch`) gives the ranks a folder (`SFT_RANK_ERRORS`); a rank that stops with a one-line error
records it there instead of printing it (`report`), and the launcher prints one of them, rank 0's or else the first
recorded (`first_error`), and exits with its code:

    rank 0: ConfigError('sp.size', 2, ...)  ->  <folder>/rank-0.json {"rank": 0, "code": 2, "message": "config: ..."}
    rank 1: the same                         ->  <folder>/rank-1.json
    launcher                                 ->  error: config: sp.size=2: ...   (exit 2)

Outside such a launch (one process, plain torchrun) the rank prints the error itself, as before.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from sft import ranks

ERRORS_ENV = "SFT_RANK_ERRORS"


def report(message: str, code: int) -> None:
    """Say `error: <message>`: record it for the launcher where there is one, else print it."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return
    rank = ranks.rank()
    path = Path(folder, f"rank-{rank}.json")
    try:
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"rank": rank, "code": code, "message": message}))
        partial.rename(path)  # whole or absent: the launcher may read while another rank writes
    except OSError:  # the launcher's folder is gone: say it here rather than not at all
        print(f"error: {message}", file=sys.stderr, flush=True)


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
