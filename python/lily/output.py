"""Output directories. A command writes into a directory that does not exist yet or is
empty; one that holds files is the user's, and is written into only when they ask."""

from __future__ import annotations

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
