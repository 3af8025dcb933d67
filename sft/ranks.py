"""Which process of a run this is, from the launcher's environment: torchrun and accelerate set `RANK` before any
process group exists (and `sft.training.processes.distributed` maps SLURM's task variables to it), so the writes that
one process makes for all (a run dir's files, the console's summary) ask here, not `torch.distributed`. No `RANK`: a
single process, rank 0."""

from __future__ import annotations

import os


def rank() -> int:
    """This process's global rank (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def is_rank_zero() -> bool:
    """Whether this process is the run's first (the only one without a launcher)."""
    return rank() == 0


def is_local_rank_zero() -> bool:
    """Whether this process is the first on its machine (`LOCAL_RANK`; the only one without a launcher): what is said
    once a machine."""
    return os.environ.get("LOCAL_RANK", "0") == "0"
