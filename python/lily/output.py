"""Output directories. A command writes into a directory that does not exist yet or is
empty; one that holds files is the user's, and is written into only when they ask."""

from __future__ import annotations

import shutil
from pathlib import Path

from ._lily import LilyError


def check_empty_dir(path, *, allow: str | None = None) -> Path:
    """`path` as a Path when it is absent or an empty directory; else a LilyError naming it
    and, when given, the option (`allow`, e.g. "--force") that lets the command write there."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise LilyError(f"{path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        hint = f" (pass {allow} to write into it anyway)" if allow else ""
        raise LilyError(f"{path}: the output directory must not exist or be empty{hint}")
    return path


def check_free_space(path, nbytes: int, *, freed: int = 0) -> None:
    """A LilyError unless `nbytes` fit on the file system that holds (or would hold) `path`,
    counting `freed` bytes the command deletes there first; so a long write cannot fail
    at the end on a full disk."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free + freed
    if nbytes > free:
        raise LilyError(f"{path}: needs {_size(nbytes)} and only {_size(free)} are free there")


def _size(nbytes: int) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:,} bytes"
