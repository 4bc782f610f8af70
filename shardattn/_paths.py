"""Output paths of the command-line tools, checked before they run (no torch: the launcher parses
its options before importing it)."""

from __future__ import annotations

import os

__all__ = ["unwritable_reason"]


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
