"""One-line errors for data files that cannot be read or caches that cannot be written.

Why a module of its own: the raw parsers, the cache key and the shard writer all touch files, and
a user must see the same kind of message from each: one line naming the file and saying what is
wrong (truncated gzip, not gzip at all, permission denied, disk full), never a traceback from
deep inside ``gzip`` or ``numpy``. Both classes are ``ValueError``s, which ``recsys train``
prints as ``error: ...`` with exit status 2 before any worker starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import zlib
from pathlib import Path
from typing import Iterator

__all__ = ["DataFileError", "CacheWriteError", "reading", "read_error", "write_error"]


class DataFileError(ValueError):
    """An input data file that cannot be used (unreadable, corrupt, no rows); one-line message."""


class CacheWriteError(OSError, ValueError):
    """Writing a shard cache failed (disk full, permissions); nothing was published.

    An ``OSError`` too, so callers that catch I/O errors keep working; a ``ValueError`` so the
    command line prints it as one line.
    """


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def read_error(path: str | os.PathLike, exc: BaseException) -> DataFileError:
    """A one-line :class:`DataFileError` naming ``path`` for an exception raised while reading it."""
    p = Path(path)
    gz = p.suffix == ".gz"
    msg = _first_line(str(exc))
    if isinstance(exc, EOFError):
        what = "truncated gzip file (the compressed stream ends early)" if gz else "file ends unexpectedly"
    elif isinstance(exc, zlib.error):
        what = f"corrupt gzip file ({msg})"
    elif isinstance(exc, IsADirectoryError) or p.is_dir():
        what = "is a directory, not a data file"
    elif isinstance(exc, PermissionError):
        what = "cannot read it (permission denied)"
    elif isinstance(exc, FileNotFoundError):
        what = "file disappeared while reading it"
    elif type(exc).__name__ == "BadGzipFile" and msg.startswith("Not a gzipped file"):
        what = "not a gzip file although named .gz"
    elif type(exc).__name__ == "BadGzipFile":
        what = f"corrupt gzip file ({msg})"
    elif isinstance(exc, OSError):
        what = f"cannot read it ({getattr(exc, 'strerror', None) or msg or type(exc).__name__})"
    else:
        what = msg or type(exc).__name__
    return DataFileError(f"{p}: {what}; nothing was written")


@contextlib.contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Turns read-side failures (I/O, gzip, zlib) inside the block into a one-line DataFileError."""
    try:
        yield
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, CacheWriteError):
            raise
        raise read_error(path, e) from None


def write_error(dest: str | os.PathLike, target: str | os.PathLike, exc: OSError) -> CacheWriteError:
    """A one-line :class:`CacheWriteError` for a failed write of ``target`` while building ``dest``.

    numpy reports a short write as ``N requested and M written`` without errno or path; the free
    space of the filesystem is added so a full disk is recognisable.
    """
    detail = getattr(exc, "strerror", None) or _first_line(str(exc)) or type(exc).__name__
    where = Path(target)
    probe = where if where.exists() else where.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        space = f" ({shutil.disk_usage(probe).free} bytes free on that filesystem)"
    except OSError:
        space = ""
    if "requested and" in str(exc):
        detail += ": is the disk full?"
    err = CacheWriteError(f"{dest}: writing the shard cache failed at {where.name}: {detail}{space}; nothing was written")
    err.errno = getattr(exc, "errno", None)
    return err
