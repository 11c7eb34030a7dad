"""One line for why a checkpoint could not be written or loaded (docs/run_integrity.md).

A failed write (a full disk) removes the `.tmp` directory on every rank and raises
`CheckpointError` with one line; DCP wraps the real cause (an OSError, or torch.save's
`unexpected pos`) in a CheckpointException of (exception, stack) pairs per rank, so the line is
dug out of it here. Apart from the Checkpointer because finding the cause is independent of
what was being saved, and the export reuses it for its load failures.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def describe_failure(e: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException is unwrapped to its first rank's error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, (list, tuple)) else first
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# Below min(this, 1/16 of the file system) free, a failed write is put down to a full disk
# (see `disk_reason`).
FULL_DISK_BYTES = 1 << 20


def disk_reason(e: BaseException, where: Path | None = None) -> str:
    """One line for a failed write: the first OSError found in the exception (DCP wraps them).

    torch.save (DCP's tensor writer) turns a failed write into `RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos`; whether the OSError survives as its `__context__` depends
    on which write hit the end of the disk, so when no OSError is found, the file system of `where`
    is asked directly: nearly nothing free (FULL_DISK_BYTES, or 1/16 of a smaller file system) means
    the full disk is the reason. Call it before the
    partial files are removed."""
    seen: list[BaseException] = [e]
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict):
        for v in failures.values():
            seen.extend(v if isinstance(v, (list, tuple)) else [v])
    for x in seen:  # (DCP's failures are (exception, stack) pairs)
        while isinstance(x, BaseException):
            if isinstance(x, OSError):
                where_ = f" ({x.filename})" if x.filename else ""
                return (os.strerror(x.errno) if x.errno else str(x)) + where_
            x = x.__cause__ or x.__context__
    if where is not None and _nearly_full(where):
        return os.strerror(errno.ENOSPC)
    return describe_failure(e)


def _nearly_full(path: Path) -> bool:
    """Whether the file system holding `path` (or its nearest existing parent) has (nearly) no room
    left for this process."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize < min(FULL_DISK_BYTES, st.f_blocks * st.f_frsize // 16)
    return False
