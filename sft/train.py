"""`python -m sft.train [overrides]`: the training command as users type it, the same as `sft train`
(`sft.commands.train`; the run it starts: `sft.run`)."""

from sft.commands.train import cli

if __name__ == "__main__":
    from sft.training.processes.distributed import exit_without_teardown

    cli()
    exit_without_teardown()  # not in `cli`: tests call that in their own process
