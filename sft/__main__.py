"""`python -m sft <command> [arguments]`: the `sft` console command, where the script is not on the PATH."""

from sft.commands import main

main()
