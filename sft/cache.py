"""Where locally built artefacts live, and how a directory of them appears: complete or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where locally built artefacts live: `$SFT_CACHE`, else `~/.cache/sft`."""
    return Path(os.environ.get("SFT_CACHE", Path.home() / ".cache" / "sft")).expanduser()


@contextlib.contextmanager
def building(target: Path):
    """A fresh directory beside `target` to build in, renamed to `target` when the block succeeds.

    A reader sees no `target` or a complete one (the rename is atomic). If another process renamed its
    own build into place first, that one is kept; a failed build leaves nothing behind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
