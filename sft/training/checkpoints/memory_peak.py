"""The most memory a stretch of work took above where it started: this process's resident set (RSS), sampled every few
milliseconds by a thread, as `/proc/self/statm` reports it (Linux; elsewhere nothing is measured).

    with PeakRss() as peak:
        save_checkpoint()
    peak.above_start  # bytes: the peak RSS during the save minus the RSS when it began (e.g. a gathered model)

What a checkpoint's save costs each rank (`WeightedLossTrainer._save_checkpoint` logs it): gathered through rank 0,
rank 0's peak grows with the whole model and optimizer state; sharded, each rank's with its own share at most.
"""

from __future__ import annotations

import os
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss() -> int | None:
    """This process's resident set in bytes, or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


class PeakRss:
    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self.start = self.peak = None  # bytes, from __enter__
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            now = rss()
            if now is not None and self.peak is not None:
                self.peak = max(self.peak, now)

    def __enter__(self) -> PeakRss:
        self.start = self.peak = rss()
        self._began = time.perf_counter()
        if self.start is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        now = rss()
        if now is not None and self.peak is not None:
            self.peak = max(self.peak, now)
        self.seconds = time.perf_counter() - self._began

    @property
    def above_start(self) -> int | None:
        return None if self.start is None else self.peak - self.start
