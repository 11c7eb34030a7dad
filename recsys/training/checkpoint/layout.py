"""A checkpoint directory on disk: its name, its marker, the listing of committed ones, and the
atomic commit that makes a written directory one of them.

Layout: <root>/step_000000120/ holds DCP's files for the sharded model and the optimizer state
(embedding shards stay sharded: each rank writes its own), plus one `rank<r>.pt` per rank with
its RNG states, and `COMMITTED` (JSON: step, world size, extra state).

Atomicity: everything is written into `step_XXXXXXXXX.tmp/`; only after every rank has
finished (barrier) does rank 0 write COMMITTED, fsync, and rename the directory to its final
name (`commit_dir`). A crash at any point leaves either a `.tmp` directory (ignored, removed by
the next save) or a complete checkpoint; nothing half-written is ever listed by `committed`.

Apart from the Checkpointer (recsys/training/checkpoint/checkpointer.py) because the run directory's checks,
the export and the tools read this layout without deciding anything about saving or resuming.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^step_(\d{9})$")
MARKER = "COMMITTED"


def step_dir_name(step: int) -> str:
    """`step_000000120`; a negative or oversized step has no name (resume could never find it)."""
    if not 0 <= step < 10**9:
        raise ValueError(f"checkpoint step {step} is outside [0, 1e9)")
    return f"step_{step:09d}"


def step_of(path: Path) -> int | None:
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def read_marker(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / MARKER).read_text())


def committed(root: Path) -> list[Path]:
    """The checkpoint directories under `root` that carry a marker, oldest step first (complete
    or not: `integrity.incomplete_reason` tells)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
    return sorted(out, key=lambda p: p.name)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """The files directly in `path`, then the directory itself."""
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def commit_dir(tmp: Path, final: Path, marker: dict[str, Any]) -> None:
    """Makes the fully written `tmp` the checkpoint `final`: its files (and each `host*/`'s)
    synced, the marker written and synced, then one rename. A checkpoint already at `final` (a
    re-save of the same step, e.g. after resume) is moved aside and deleted only once the new
    one is in place."""
    for sub in tmp.glob("host*"):
        fsync_tree(sub)
    fsync_tree(tmp)
    with open(tmp / MARKER, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    old = final.parent / f"{final.name}.old.tmp"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
