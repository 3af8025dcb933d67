"""A small process that outlives this one, to tidy what only a clean exit would have tidied.

A run killed with SIGKILL, or one that exits at once on a second SIGTERM (`os._exit`), runs no `atexit` handler:
it would leave the run dir's lock (`.sft.lock`, which a later run then has to take over) and the hang watchdog's
armed report (`hangs/rank-K.txt`, a header that reads as a hang that never happened). `guard(kind, path)` hands
such a file to this process's sentinel, started on first use (`python -S -I`, no imports, ~20 ms): it waits for
its parent to go, then removes a `lock` file that still names the parent's pid, and a `report` file that holds
no stacks (a real hang's report has them: faulthandler wrote them before exiting). It ignores SIGTERM and
SIGINT, and runs in a session of its own, so that a signal to the run's process group does not take it first.
"""

from __future__ import annotations

import os
import subprocess
import sys

STACKS = "most recent call first"  # in every stack faulthandler dumps

_CODE = r"""
import json, os, signal, sys, threading, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, guarded = int(sys.argv[1]), []

def read():
    for line in sys.stdin:
        kind, _, path = line.rstrip("\n").partition(" ")
        guarded.append((kind, path))

threading.Thread(target=read, daemon=True).start()
while os.getppid() == parent:  # reparented once the parent is gone (also while it is a zombie)
    time.sleep(0.2)
time.sleep(0.2)  # the reader's last lines
for kind, path in guarded:
    try:
        if kind == "lock":
            with open(path) as f:
                if json.loads(f.read()).get("pid") == parent:
                    os.unlink(path)
        elif kind == "report":
            with open(path, errors="replace") as f:
                text = f.read()
            if STACKS not in text:
                os.unlink(path)
                try:
                    os.rmdir(os.path.dirname(path))
                except OSError:
                    pass
    except (OSError, ValueError):
        pass
""".replace("STACKS", repr(STACKS))

_sentinel: tuple[int, subprocess.Popen] | None = None  # (the pid that started it, the process)


def guard(kind: str, path: str | os.PathLike) -> None:
    """Have this process's sentinel tidy `path` after this process is gone: `lock` (removed if it still names this
    pid) or `report` (removed unless it holds stacks)."""
    global _sentinel
    if _sentinel is None or _sentinel[0] != os.getpid() or _sentinel[1].poll() is not None:  # a fork has its own
        process = subprocess.Popen([sys.executable, "-S", "-I", "-c", _CODE, str(os.getpid())],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True, text=True)
        _sentinel = (os.getpid(), process)
    try:
        _sentinel[1].stdin.write(f"{kind} {os.fspath(path)}\n")
        _sentinel[1].stdin.flush()
    except OSError:  # the sentinel is gone: the clean exit still tidies
        pass
