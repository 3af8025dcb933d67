"""sft: fine-tune chat LLMs with weighted losses on a narrow `transformers.Trainer` subclass (see README.md)."""


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
