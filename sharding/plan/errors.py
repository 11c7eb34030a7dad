"""The plan-file error, in a module of its own so that ``file_format`` and ``io`` (reading files)
and ``validation`` (checking plans) can all raise it without importing each other."""

from __future__ import annotations


class PlanFileError(ValueError):
    """A plan file that cannot be used; the message is one line naming the file and key."""
