"""Errors that reach the user as one clear line (file, field, reason), never a deep traceback."""

from __future__ import annotations


class PlaitError(Exception):
    """Base of every error caused by user input or an impossible request."""


def check_output_path(path: object, flag: str) -> None:
    """Raise PlaitError unless a file can be written at `path`: checked before any work, so a
    typo in an output folder does not throw away a finished run. `flag` names the option."""
    if path is None:
        return
    import os
    from pathlib import Path

    p = Path(str(path)).expanduser()
    if p.is_dir():
        raise PlaitError(f"{flag} {path}: is a folder; give a file name")
    parent = p.parent
    if not parent.exists():
        raise PlaitError(f"{flag} {path}: folder {parent} does not exist (create it first; nothing was run)")
    if not parent.is_dir():
        raise PlaitError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlaitError(f"{flag} {path}: folder {parent} is not writable")
