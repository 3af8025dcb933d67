"""Hang watchdog: when no optimizer step completes in time, every rank dumps its stacks and exits.

Each rank arms `faulthandler.dump_traceback_later` (a C-level timer thread that needs no GIL, so it
fires even inside a stuck collective) and re-arms it after every step and evaluation batch. When it
fires, the rank's `hangs/rank-<k>.txt` in the run dir gets the stack of every thread under a header
naming the rank and its last completed step, and the process exits with status 1 instead of hanging. The armed
header is only a report once the stacks follow it: a run that ends otherwise removes it (`_disarm` at exit; after a
SIGKILL or an immediate exit on a second signal, the process's sentinel, `sft.training.processes.sentinel`).
"""

from __future__ import annotations

import atexit
import faulthandler
import time
from dataclasses import dataclass
from pathlib import Path

from sft.config.schema import config_schema, knob
from sft.files import own_dir, own_path
from sft.ranks import rank
from sft.training.controllers.base import Controller
from sft.training.processes.sentinel import guard


@config_schema("controllers", "watchdog")
@dataclass(eq=False, kw_only=True)
class HangWatchdog(Controller):
    _target_: str = "sft.training.controllers.HangWatchdog"
    timeout_s: float = knob(1200.0, "seconds without a finished optimizer step after which every thread's stack "
                            "is dumped (below trainer.ddp_timeout, so that the stacks come first)")
    name = "watchdog"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("timeout_s", self.timeout_s > 0, "must be > 0")
        if cfg is not None:
            self.require("timeout_s", self.timeout_s < cfg.trainer.ddp_timeout,
                         f"must be below trainer.ddp_timeout ({cfg.trainer.ddp_timeout}), else the collective "
                         "times out first and no stacks are dumped")

    def __post_init__(self):
        super().__post_init__()
        self._file = None
        self._rank = rank()

    def state_dict(self) -> dict:
        return {}  # nothing to carry over: a resumed run arms its own timer

    def _arm(self, step: int) -> None:
        self._file.seek(0)
        self._file.truncate()
        # Written before any hang, and read only after one or after a death that nothing tidied: it says both
        self._file.write(
            f"rank {self._rank}: watching for a hang after step {step} (armed {time.strftime('%Y-%m-%d %H:%M:%S')}, "
            f"controllers.watchdog.timeout_s={self.timeout_s:g}).\n"
            f"Where the stacks of every thread follow, no optimizer step completed within {self.timeout_s:g} s after "
            f"step {step}, and they show where each thread was.\n"
            "Where none follow, there was no hang: the process ended otherwise (killed, or it exited at once) before "
            "it or its sentinel could remove this file.\n\n"
        )
        self._file.flush()
        faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self._file)

    def on_train_begin(self, args, state, control, **kwargs):
        self._path = own_path(own_dir(Path(args.output_dir) / "hangs") / f"rank-{self._rank}.txt")
        self._file = open(self._path, "w")
        guard("report", self._path)
        # A run that ends by an exception (or sys.exit) never reaches on_train_end: disarm at exit all the
        # same, or the armed header would read as a hang. A real hang exits through faulthandler (_exit).
        atexit.register(self._disarm)
        self._arm(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._file is not None:
            self._arm(state.global_step)

    def on_prediction_step(self, args, state, control, **kwargs):
        if self._file is not None:
            self._arm(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._disarm()

    def _disarm(self) -> None:
        """Cancel the timer and remove the report that did not happen."""
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None
            self._path.unlink(missing_ok=True)  # no hang: no report
            try:
                self._path.parent.rmdir()
            except OSError:
                pass
