"""`Callback`: what Trainer's callback handler calls, without importing transformers (so that the controllers, whose
knobs are part of the config, compose and check in a moment). Trainer calls `getattr(callback, event)(args,
state, control, **kwargs)` for each of its events; a `Callback` answers every `on_*` event it does not define with
a no-op, as `transformers.TrainerCallback` does (a test holds the two to the same events).
"""

from __future__ import annotations


def _no_op(*args, **kwargs):
    return None


class Callback:
    """Base of the controllers, the throughput meter and preemption: Trainer events as methods, the rest no-ops."""

    def __getattr__(self, name: str):
        if name.startswith("on_"):
            return _no_op
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
