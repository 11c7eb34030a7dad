"""The identity of a shard cache: which input files, in which state, parsed with which options.

Why: a cache keyed by file names trains on stale rows when a file is replaced under the same
name, and on the wrong data when another directory holds a file with the same name. The key
records, for every input file, its resolved path, size, mtime (ns) and SHA-256 of its first and
last block (1 MiB each), plus every option that changes the shards or whether they may be built
at all. Hashing head and tail costs at most 2 MiB of reading per file, whatever its size, and
catches replaced, truncated, appended-to and rewritten files. A change confined to the middle of
a file that keeps its size and mtime is caught by the second check, on every byte: each source
in the manifest records the SHA-256 of the whole file (:func:`content_sha256`, taken when the
cache is built), and a cache whose key matches is verified against it before it is reused
(``data.verify=full``, the default; 0.7 s per GB on one core, 3% of what parsing the same bytes
takes: tools/bench/integrity.py).
``data.verify=quick`` skips that pass and says, when the cache is reused, that it trusted size,
mtime and the head and tail blocks.

The key is stored in the cache's ``manifest.json``; :func:`describe_change` compares two keys
and says in one line what changed, which is logged when the cache is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

from recsys.data.errors import reading

__all__ = ["KEY_VERSION", "BLOCK_BYTES", "file_identity", "make_key", "describe_change", "content_sha256", "file_sha256"]

KEY_VERSION = 1
BLOCK_BYTES = 1 << 20


def _block_digest(f, offset: int, size: int) -> str:
    f.seek(offset)
    return hashlib.sha256(f.read(size)).hexdigest()


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 8 << 20) -> str:
    """SHA-256 of every byte of one file, read in chunks (read errors: OSError). Data inputs and
    checkpoint files are hashed with it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        buf = bytearray(chunk_bytes)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def content_sha256(path: str | os.PathLike) -> str:
    """`file_sha256` of a data input (read errors: a one-line ``DataFileError`` naming it)."""
    with reading(Path(path)):
        return file_sha256(path)


def file_identity(path: str | os.PathLike, block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Resolved path, size, mtime_ns and SHA-256 of the head and tail blocks of one file.

    Read errors (permissions, a directory) become a one-line ``DataFileError`` naming the file.
    """
    p = Path(path)
    with reading(p):
        resolved = p.resolve(strict=True)
        with open(resolved, "rb") as f:
            st = os.fstat(f.fileno())
            head = _block_digest(f, 0, block_bytes)
            tail_start = max(0, st.st_size - block_bytes)
            tail = head if tail_start == 0 else _block_digest(f, tail_start, block_bytes)
    return {
        "path": str(resolved),
        "size": int(st.st_size),
        "mtime_ns": int(st.st_mtime_ns),
        "head_sha256": head,
        "tail_sha256": tail,
    }


def make_key(paths: Sequence[str | os.PathLike], options: dict[str, Any]) -> dict[str, Any]:
    """The cache key of ``paths`` (in order) parsed with ``options`` (JSON-serialisable values)."""
    return {
        "key_version": KEY_VERSION,
        "files": [file_identity(p) for p in paths],
        "options": dict(sorted(options.items())),
    }


def _what_changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    for field, label in (("size", "size"), ("head_sha256", "content"), ("tail_sha256", "content"), ("mtime_ns", "modification time")):
        if old.get(field) != new.get(field):
            if field == "size":
                return f"size {old.get('size')} -> {new.get('size')} bytes"
            return f"{label} changed"
    return "changed"


def describe_change(old: dict[str, Any] | None, new: dict[str, Any]) -> str | None:
    """One line saying how ``new`` differs from ``old`` (None when they are equal)."""
    if not isinstance(old, dict) or old.get("key_version") != new.get("key_version"):
        return "it was built without a content key (an older version); its inputs cannot be verified"
    if old == new:
        return None
    old_files = {f.get("path"): f for f in old.get("files", []) if isinstance(f, dict)}
    new_files = {f["path"]: f for f in new["files"]}
    added = [p for p in new_files if p not in old_files]
    removed = [p for p in old_files if p not in new_files]
    if added or removed:
        parts = []
        if added:
            parts.append(
                f"new input file{'s' if len(added) > 1 else ''} {', '.join(added[:3])}"
                + (f" and {len(added) - 3} more" if len(added) > 3 else "")
            )
        if removed:
            parts.append(
                f"input file{'s' if len(removed) > 1 else ''} {', '.join(removed[:3])} no longer given"
                + (f" (and {len(removed) - 3} more)" if len(removed) > 3 else "")
            )
        return "; ".join(parts)
    for path, f in new_files.items():
        if old_files[path] != f:
            return f"{path} changed ({_what_changed(old_files[path], f)})"
    if [f.get("path") for f in old.get("files", [])] != [f["path"] for f in new["files"]]:
        return "the input files are given in another order"
    old_opts, new_opts = old.get("options", {}), new["options"]
    diffs = [
        f"{k} {old_opts.get(k)!r} -> {new_opts.get(k)!r}"
        for k in sorted(set(old_opts) | set(new_opts))
        if old_opts.get(k) != new_opts.get(k)
    ]
    return "parse options changed: " + ", ".join(diffs)
