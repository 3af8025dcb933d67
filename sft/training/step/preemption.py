"""Graceful preemption: on SIGTERM or SIGINT, finish the optimizer step, save a complete checkpoint, stop.

SLURM, Kubernetes and spot instances send SIGTERM some time before they kill; Ctrl-C sends SIGINT. Each
rank's handler only notes the signal; at the end of the step every rank learns whether any rank got one,
so all of them save the same checkpoint and stop together. `Preemption` is a controller like the others
(the recipe adds it to every run, with `signal_grace_s`): its `requests_stop` travels in the step's one
all-reduce of `sft.training.step.control` (with the step loss the guard judges), right before the optimizer
step, and `stop_agreed` tells it on every rank; a signal that arrives during the optimizer step itself stops
the run after the next step. The run then
writes `results.json` with `status: "preempted"` and the checkpoint, says how to continue (`resume=auto`
with the same run dir) and exits with `PREEMPTED_EXIT_CODE`.

A signal during start-up (before training begins: the data, the model) stops the run at once (`Preempted`, exit
75, nothing to save). A second signal exits at once, except within `DUPLICATE_S` of the first: launchers (torchrun,
accelerate, SLURM's job step) deliver the same signal to a worker that the process group already got; with exit
code 75 where the stop's checkpoint is already saved, and also once the handler is given back while stopping.
`signal_grace_s` bounds the wait for the step and the checkpoint: past it the process exits without one.

A process forked from the run (a `multiprocessing` pool, a DataLoader worker) inherits the handler; there the
signal takes its default action, since its parent stops it with SIGTERM (`Pool.__exit__` does) and waits for it.

A signal after training (the final evaluation, the model's save, exact match) lets the run finish, within
`signal_grace_s`: its `results.json` is then the finished run's. Where it cannot finish (the grace runs out, or
a second signal), `on_exit` runs before the process exits: the recipe records `status: "preempted"` there,
with the newest complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from sft.config.schema import knob
from sft.training.controllers.base import Controller
from sft.training.processes.slurm import EARLY_SIGNALS

log = logging.getLogger("sft")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL ("try again"): SLURM's --requeue, a Kubernetes restart policy
DUPLICATE_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Under SLURM, also the warnings it sends some seconds before the time limit (`--signal=USR1@60`) and submitit's
# (SIGUSR2, before the limit or a preemption): the same stop, saved and requeued (sft.training.processes.slurm)
SLURM_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def signals() -> tuple:
    """The signals a run stops at: SIGTERM and SIGINT; under SLURM, SIGUSR1 and SIGUSR2 too."""
    return SIGNALS + (SLURM_SIGNALS if "SLURM_JOB_ID" in os.environ else ())


class Preempted(RuntimeError):
    """The run stopped at a signal after saving `checkpoint`; the message says how to continue."""

    def __init__(self, message: str, checkpoint: str | None, at_start: bool = False):
        super().__init__(message)
        self.checkpoint, self.at_start = checkpoint, at_start


@dataclass(eq=False, kw_only=True)
class Preemption(Controller):
    """Notes SIGTERM/SIGINT (`install`), and at the end of the step in which any rank got one, asks Trainer to save
    and stop (`stopped_at` is then that step)."""

    _target_: str = "sft.training.step.preemption.Preemption"
    grace_s: float = knob(600.0, "at most this long to finish the step and save a checkpoint after a signal")
    name = "preemption"

    def check(self, cfg=None):
        self.require("grace_s", self.grace_s > 0, "must be > 0")

    def __post_init__(self):
        self.signal: str | None = None
        self._received_at = 0.0
        self._stop = False
        self._timer: threading.Timer | None = None
        self.stopped_at: int | None = None
        self.saved = False  # the checkpoint of the stop is complete
        self.training_started = False  # Trainer's training loop began (before it: start-up, where a signal stops at once)
        self.training_done = False  # set by the recipe once trainer.train returns
        self.on_exit = None  # called (no arguments) right before an exit without a finished run
        self._pid = os.getpid()  # the process whose signals this is about (`install` sets it again)

    def state_dict(self) -> dict:
        return {}  # a resumed run waits for signals of its own

    def requests_stop(self) -> bool:
        return self.signal is not None

    def stop_agreed(self, step: int) -> None:
        self._stop = True

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (from the main thread, where Python runs signal handlers); a signal noted
        since the command started (`note_signals_from_the_start`, under SLURM) is acted on now."""
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for sig in signals():
                signal.signal(sig, self._on_signal)
            while EARLY_SIGNALS:
                self._on_signal(EARLY_SIGNALS.pop(0), None)

    def uninstall(self) -> None:
        """Give SIGTERM and SIGINT back, and the grace timer up. Where a signal came (the run is stopping), a further
        one exits with `PREEMPTED_EXIT_CODE`, not killed by it: what was to be saved is."""
        if self._timer is not None:
            self._timer.cancel()
        if threading.current_thread() is threading.main_thread():
            for sig in signals():
                default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
                signal.signal(sig, default if self.signal is None else self._after_stop)

    def _after_stop(self, signum, frame) -> None:
        # expected, not a fault: SLURM's requeue ends the attempt with a SIGTERM of its own, after the run stopped
        log.info("%s after the run stopped (what it saved is complete): exiting now (exit code %d)",
                 signal.Signals(signum).name, PREEMPTED_EXIT_CODE)
        logging.shutdown()
        os._exit(PREEMPTED_EXIT_CODE)

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked child (lm-eval's bootstrap pool): act as if never installed
            self.uninstall()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._received_at = signal.Signals(signum).name, now
            if not self.training_started and not self.training_done:  # start-up: nothing to save, stop at once
                raise Preempted(f"{self.signal} during start-up: nothing trained yet; the same command starts the run "
                                "again (resume=auto, where it had checkpoints)", None, at_start=True)
            where = _under_slurm(self.signal)
            if self.training_done:
                log.warning("%s%s after training: finishing the run (final evaluation and save; a second signal "
                            "exits at once; at most signal_grace_s=%g s)", where, self.signal, self.grace_s)
            else:
                log.warning("%s%s: finishing the current step, then saving a checkpoint and stopping (a second "
                            "signal exits at once; at most signal_grace_s=%g s)", where, self.signal, self.grace_s)
            self._timer = threading.Timer(self.grace_s, self._give_up)
            self._timer.daemon = True
            self._timer.start()
        elif now - self._received_at > DUPLICATE_S:
            log.warning("%s again: exiting now, without %s", signal.Signals(signum).name,
                        "finishing the run" if self.training_done else
                        "more (its checkpoint is saved)" if self.saved else "a checkpoint")
            self._exit(PREEMPTED_EXIT_CODE if self.saved else 128 + signum)

    def _give_up(self) -> None:
        log.error("%s: the %s did not finish within signal_grace_s=%g s: exiting (resume=auto continues from the "
                  "last complete checkpoint)", self.signal,
                  "final evaluation and save" if self.training_done else "step and its checkpoint", self.grace_s)
        self._exit(128 + signal.SIGTERM)

    def _exit(self, code: int) -> None:
        if self.on_exit is not None:
            try:
                self.on_exit()
            except Exception as e:  # noqa: BLE001 - exiting all the same
                log.error("preemption: %s", e)
        logging.shutdown()
        os._exit(code)

    def on_train_begin(self, args, state, control, **kwargs):
        self.training_started = True

    def on_save(self, args, state, control, **kwargs):
        if self._stop:
            self.saved = True

    def on_step_end(self, args, state, control, **kwargs):
        if self._stop:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step


def _under_slurm(name: str) -> str:
    """`SLURM job 42 (attempt 1): ... ` before a signal's log line where the run is a SLURM job: what the signal means
    there and how long the scheduler gives after it; "" elsewhere."""
    from sft.training.processes.slurm import SlurmJob, signal_meaning

    job = SlurmJob.current()
    if job is None:
        return ""
    return (f"SLURM job {job.id} (attempt {job.restart + 1}, {signal_meaning(name)}; the scheduler gives "
            f"{job.grace()}): ")
