"""Writing a run's own files without following links planted where they go; finding files shipped in packages.

A run dir may be shared, or prepared by someone else: a symlink `results.json -> ~/.bashrc` (or a `model/` that
links elsewhere) would make the run overwrite its target. Every file the run writes into its dirs goes through
`own_path`, which removes a symlink at that path (the run's file takes its place; the link's target is untouched),
and `write_text` writes whole files atomically through a fresh temporary file (`O_EXCL`: never a planted one).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("sft")


def own_path(path: str | os.PathLike) -> Path:
    """`path`, with a symlink there removed (logged): what is written there lands in the run's dir.

        own_path("run/results.json")  # run/results.json -> /etc/passwd: the link is removed, not followed
    """
    path = Path(path)
    if path.is_symlink():
        target = os.readlink(path)
        path.unlink()
        log.warning("%s was a symlink (to %s): removed it; the run writes its own file there, never through a link",
                    path, target)
    return path


def own_dir(path: str | os.PathLike) -> Path:
    """`own_path`, then the dir made (with its parents)."""
    path = own_path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` whole or not at all: a fresh temporary file beside it, then renamed over it (a rename
    replaces a symlink itself, never its target)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def in_package(name: str) -> tuple[Path | None, list[str]]:
    """The file `<package>/<path inside it>` of an installed Python package, found without importing the package
    (a top-level name's spec says where it lies), and the places looked in; None where there is no such file.

        in_package("sft/model/chat_templates/gemma3.jinja")  # -> (<site-packages>/sft/model/chat_templates/..., [])
    """
    import importlib.util

    package, _, inside = name.partition("/")
    if not inside or not package.isidentifier():
        return None, []
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, []
    looked = []
    for folder in spec.submodule_search_locations:
        if (Path(folder) / inside).is_file():
            return (Path(folder) / inside).resolve(), looked
        looked.append(str(Path(folder) / inside))
    return None, looked


def read_json_lines(path: str | os.PathLike) -> list[dict]:
    """A file of one JSON object a line, as a process that may be killed writes it: [] where there is no file, and a
    line cut short (killed while writing it) left out."""
    import json

    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
