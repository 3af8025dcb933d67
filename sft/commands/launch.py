"""`sft launch [accelerate launch arguments] -m sft.train [overrides]`: several processes, errors said once.

What `./launch.sh --nproc N` (and each job of `./launch.sh --nproc N -m ...`) runs: `accelerate launch` itself, in
this process, so that a failed launch ends the way a one-process run does. A refusal raised inside the ranks (a config
that needs the model to be checked, bad data, a resume that cannot continue) is printed once, rank 0's words or the
first failing rank's (`sft.training.processes.rank_errors`), and the launch exits with its code (2), without the
launcher's `ChildFailedError` traceback or the elastic agent's log lines. A rank that crashed printed its own traceback;
the launcher then adds one line naming the rank and its exit code or signal, and exits 1. Preempted ranks (exit 75,
`sft.training.step.preemption`) make the launch exit 75.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

from sft.training.processes.rank_errors import ERRORS_ENV, first_error


def failure_line(failures: dict) -> str:
    """One line for ranks that failed without a recorded error: the first one's rank and exit code or signal.

        {1: ProcessFailure(exitcode=-9, ...)}  ->  "rank 1 was killed by SIGKILL (its output is above)"
    """
    rank = min(failures)
    failure = failures[rank]
    how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    others = f" ({len(failures) - 1} other rank(s) failed too)" if len(failures) > 1 else ""
    return f"rank {rank} {how}{others}; its output is above"


def main(argv: list[str] | None = None) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from sft.training.step.preemption import PREEMPTED_EXIT_CODE

    argv = sys.argv[1:] if argv is None else argv
    args = launch_command_parser().parse_args(argv)
    # the agent's own lines on a failed child ("failed (exitcode: 2) local_rank: 0 ...", "Sending process ... closing
    # signal SIGTERM"): the one line below says it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    folder = tempfile.mkdtemp(prefix="sft-rank-errors-")
    os.environ[ERRORS_ENV] = folder
    try:
        launch_command(args)
    except ChildFailedError as e:
        error = first_error(folder)
        codes = {failure.exitcode for failure in e.failures.values()}
        if error is not None:
            print(f"error: {error['message']}", file=sys.stderr, flush=True)
            sys.exit(error["code"])
        if codes == {PREEMPTED_EXIT_CODE}:
            sys.exit(PREEMPTED_EXIT_CODE)
        print(f"error: {failure_line(e.failures)}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
