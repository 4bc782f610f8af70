"""Output paths of the command-line tools, checked before they run (no torch: the launcher parses
its options before importing it)."""

from __future__ import annotations

import os
import tempfile

__all__ = ["unwritable_reason", "write_text"]


def unwritable_reason(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (``None``: it can, as far as the file system says
    before trying): an empty path, a directory, a missing or read-only directory, a read-only file.

    >>> unwritable_reason(""), unwritable_reason("/")
    ('an empty path', 'a directory')
    """
    if not path:
        return "an empty path"
    if os.path.isdir(path):
        return "a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"no directory {parent}"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "a file that cannot be written"
    return None if os.access(parent, os.W_OK) else f"directory {parent} cannot be written"


def write_text(path: str, text: str) -> str | None:
    """Write ``text`` to ``path``: ``None`` once written, else why not (the file system refused it
    after :func:`unwritable_reason` passed: a full disk, a directory removed during the run) and
    where the text was kept instead, a new temporary file, so the run's results are not lost."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return None
    except OSError as e:
        why = e.strerror or str(e)
    try:
        fd, kept = tempfile.mkstemp(prefix="shardattn-", suffix=os.path.splitext(path)[1])
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        return f"{why}; nor in a temporary file: {e.strerror or e}"
    return f"{why}; kept in {kept}"
