"""Warnings from the stack that ask nothing of the user, silenced in one place, each by its exact message and with
the reason (issue 51: a run's console shows what a person should act on, not the stack's chatter). A warning that
sft's own calls cause is fixed at the call instead; anything not listed here stays visible.

    quiet_foreign_noise()  # once, at the start of a command
"""

from __future__ import annotations

import logging
import warnings

# (category, the message's start, why it asks nothing of the user)
FOREIGN_WARNINGS = [
    (FutureWarning, "`is_gradient_checkpointing` is deprecated",
     "PEFT's get_peft_model reads the model's is_gradient_checkpointing (peft_model.py), which transformers 5 "
     "deprecated: PEFT's call, not the user's nor sft's"),
]
# (logger, the message's start, why)
FOREIGN_LOG_LINES = [
    ("DeepSpeed", "Setting accelerator to CPU.",
     "DeepSpeed says it on import on every machine without a GPU, whether or not the run uses DeepSpeed (transformers "
     "and accelerate import it where installed); a run on DeepSpeed says which engine it has in sft's own log"),
]


class _Drop(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.start)


def quiet_foreign_noise() -> None:
    """Install the filters of `FOREIGN_WARNINGS` and `FOREIGN_LOG_LINES` (idempotent)."""
    import re

    for category, start, _ in FOREIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)
    for name, start, _ in FOREIGN_LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.start == start for f in logger.filters):
            logger.addFilter(_Drop(start))
