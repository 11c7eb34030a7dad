"""Durable file writes and the hidden side directories of an atomic publish.

Why a module of its own: a shard directory is published atomically (written into a hidden temp
directory next to the destination, fsynced, moved into place with ``os.replace``), and a joined
dataset's manifest is replaced in place. Both need the same guarantees: data is on disk before
the manifest that points at it, a rename survives a power loss, and the side directories a
crashed writer left behind are recognised (by host and pid in their names) and removed without
ever touching those of a live writer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from recsys.data.shard_format import MANIFEST_NAME

logger = logging.getLogger(__name__)

TMP_TAG = "tmp"
OLD_TAG = "old"


def fsync_dir(path: Path) -> None:
    """fsync a directory so renames/creations inside it survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def save_npy(path: Path, array: np.ndarray) -> None:
    """np.save + fsync, so a later manifest never points at data still in the page cache."""
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON with a final newline, fsynced."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def replace_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write ``root``'s manifest in place, atomically and durably (temp file, fsync, rename,
    directory fsync): for a directory whose shard files are already there, e.g. one joined from
    parts (recsys/data/preprocess/fanout.py). Readers see the old manifest or the new one, never a mix."""
    tmp = root / f".{MANIFEST_NAME}.tmp"
    write_json(tmp, manifest)
    os.replace(tmp, root / MANIFEST_NAME)
    fsync_dir(root)


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "host"


def side_name(dest: Path, tag: str) -> str:
    """Hidden sibling name carrying host and pid, so stale ones can be recognised later."""
    return f".{dest.name}.{tag}.{_host()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def clean_stale_temp_dirs(dest: str | Path) -> list[Path]:
    """Remove leftover temp/old siblings of ``dest`` from crashed runs *on this host*.

    Only directories whose recorded pid is no longer alive on this host are removed: a temp dir
    of a concurrent writer (or of another host on a shared filesystem) is never touched.
    """
    dest = Path(dest)
    parent = dest.parent
    if not parent.is_dir():
        return []
    host = _host()
    removed: list[Path] = []
    for tag in (TMP_TAG, OLD_TAG):
        prefix = f".{dest.name}.{tag}."
        for entry in parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            parts = entry.name[len(prefix) :].rsplit(".", 2)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue
            if _pid_alive(int(parts[1])):
                continue
            logger.warning("removing stale temporary directory %s from a crashed run", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
