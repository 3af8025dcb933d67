"""A pytest plugin for the GPU pack's tests (`-p sft.bench.outcomes`): each test's outcome written as it ends, and a
limit on each test.

    SFT_TEST_OUTCOMES=out/tests.jsonl SFT_TEST_LIMIT_S=60 python -m pytest -p sft.bench.outcomes -m gpu ...
      -> out/tests.jsonl gains {"test": ..., "outcome": "passed" | "failed" | "skipped", "detail": ..., "seconds": ...}
         as each test ends; a test past 60 s fails ("over its limit of 60 s") and the others run on

The pack's time limit on the whole part may still kill pytest: every outcome written before that stands (pytest's own
JUnit file is written only when it ends). The limit is a SIGALRM in the test's own thread, as pytest-timeout's signal
method: it interrupts Python code, and a kernel call once it returns.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from sft.files import read_json_lines


class OverItsLimit(Exception):
    """A test ran past `SFT_TEST_LIMIT_S`."""


def limit_s() -> float | None:
    value = os.environ.get("SFT_TEST_LIMIT_S")
    return float(value) if value else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = limit_s()
    if not limit or not hasattr(signal, "SIGALRM"):
        yield
        return

    def over(signum, frame):
        raise OverItsLimit(f"over its limit of {limit:g} s (SFT_TEST_LIMIT_S)")

    previous = signal.signal(signal.SIGALRM, over)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logreport(report):
    """One line for each test, written (and flushed) when its outcome is known: its call's, or its setup's where that
    failed or skipped it."""
    path = os.environ.get("SFT_TEST_OUTCOMES")
    if not path or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    if report.skipped:
        detail = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        outcome = "skipped"
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        detail, outcome = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0], "failed"
    else:
        detail, outcome = "", "passed"
    line = {"test": report.nodeid.split("::", 1)[-1], "outcome": outcome, "detail": detail.removeprefix("Skipped: "),
            "seconds": round(report.duration, 2), "at": time.time()}
    with Path(path).open("a") as f:
        f.write(json.dumps(line) + "\n")


def read(path: Path) -> list[dict]:
    """The outcomes written so far (a line cut short by a kill is left out)."""
    return read_json_lines(path)
