"""Whether a checkpoint on disk can load: the files it must hold and their recorded hashes
(docs/run_integrity.md).

- COMMITTED records the SHA-256 of every file (`sha256`: relative path -> hex), hashed by all
  ranks in parallel after the write, before the commit (`hash_files`).
- `incomplete_reason` checks a checkpoint's files against its DCP metadata (every `.distcp`
  present and long enough, every `rank<r>.pt` present) and their bytes against the recorded
  hashes; the Checkpointer's `latest_complete` falls back past a checkpoint it names.

Apart from the Checkpointer because the run directory's checks, the export and the integrity
benchmark verify checkpoints without a Checkpointer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from recsys.data.cache_key import file_sha256
from recsys.training.checkpoint.layout import MARKER, read_marker


def incomplete_reason(path: Path, verify_bytes: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot load (naming the bad file), or None if it looks complete:
    a readable marker and DCP metadata, every storage file the metadata names present and long
    enough, one rank<r>.pt per writing rank, and (`verify_bytes`) every file's SHA-256 equal to
    the one COMMITTED recorded at save time (checkpoints written before hashes were recorded
    are checked for presence and length only)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        marker = read_marker(path)
    except (OSError, ValueError):
        return f"{path / MARKER} is unreadable"
    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception:  # a missing or truncated .metadata fails in open() or in unpickling
        return f"{path / '.metadata'} is missing or unreadable"
    needed: dict[str, int] = {}
    for info in meta.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size < size:
            return f"{f} is truncated ({f.stat().st_size} of {size} bytes)"
    for r in range(int(marker.get("world_size", 1))):
        f = path / f"rank{r}.pt"
        if not f.is_file() or f.stat().st_size == 0:
            return f"{f} is missing"
    if verify_bytes:
        for name, want in sorted((marker.get("sha256") or {}).items()):
            f = path / name
            try:
                got = file_sha256(f)
            except OSError as e:
                return f"{f} is unreadable ({e.strerror or e})"
            if got != want:
                return f"{f} is corrupt (its SHA-256 differs from the one recorded when it was written)"
    return None


def checkpoint_files(tmp: Path) -> list[str]:
    """Every file of a checkpoint being written (relative paths, sorted; COMMITTED excluded)."""
    return sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != MARKER)


def hash_files(tmp: Path, rank: int, world_size: int) -> dict[str, str]:
    """Collective over the default group: the SHA-256 of every file of the checkpoint being
    written in `tmp`, the files dealt round-robin over the ranks so each hashes its share (mostly
    still in its page cache); every rank gets them all. A rank's OSError is raised after the
    gather, so no rank waits for that one."""
    files = checkpoint_files(tmp) if rank == 0 else []
    box = [files]
    dist.broadcast_object_list(box, src=0)
    failed: OSError | None = None
    try:
        mine = {name: file_sha256(tmp / name) for name in box[0][rank::world_size]}
    except OSError as e:
        mine, failed = {}, e
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, mine)
    if failed is not None:
        raise failed
    return {k: v for part in parts for k, v in part.items()}
