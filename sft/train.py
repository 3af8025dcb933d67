"""`python -m sft.train [overrides]`: the training command as users type it, the same as `sft train`
(`sft.commands.train`; the run it starts: `sft.run`)."""

import sys

from sft.training.processes.slurm import note_signals_from_the_start

if __name__ == "__main__":  # before the stack's imports (seconds): a SLURM signal then is not fatal
    note_signals_from_the_start(sys.argv[1:])

from sft.commands.train import cli  # noqa: E402

if __name__ == "__main__":
    from sft.training.processes.distributed import exit_without_teardown

    cli()
    exit_without_teardown()  # not in `cli`: tests call that in their own process
