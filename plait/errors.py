"""Errors that reach the user as one clear line (file, field, reason), never a deep traceback."""

from __future__ import annotations


class PlaitError(Exception):
    """Base of every error caused by user input or an impossible request."""
