"""sft: fine-tune chat LLMs with weighted losses on a narrow `transformers.Trainer` subclass (see README.md)."""

import os

# GNU OpenMP's threads (torch's on a CPU) spin at each barrier before they sleep: 300,000 turns by default. On a machine
# where other work shares the cores, the spinning threads take the cores from the ones with work: the default run on 2
# cores beside two busy processes made 1,142-1,805 tokens/s spinning, 3,331-3,968 at 1,000 turns, the same quiet
# (docs/performance.md#cpu-threads). Read by libgomp when torch loads it: set before torch is imported; a value the
# user set stands.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def version() -> str:
    """This package's version: the installed distribution's, or pyproject.toml's in a source tree that was not
    installed (a GPU image running from a checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("sft")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return f"{found.group(1)}+source" if found else "unknown"
