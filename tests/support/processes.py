"""Process helpers the multi-process tests share: the tree of processes a launch started (from
/proc), killing that tree at once, and waiting for a file a running job writes. (A free port for a
rendezvous is `recsys.training.distributed.free_port`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """pid and all its descendants, from /proc (torchrun starts its workers in new sessions, so
    killing the launcher's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL the whole tree at once, like a node losing power."""
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``path`` exists; fails if ``proc`` ends first or ``timeout`` seconds pass."""
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"training ended before {path} appeared")
        if time.time() - t0 > timeout:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)
