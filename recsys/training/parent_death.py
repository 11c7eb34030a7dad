"""Process lifetime: no worker outlives the run that started it (docs/run_integrity.md).

Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`) delivers a signal to a process when its
parent dies, however the parent died (SIGKILL included). `recsys train` sets it (SIGTERM) on the
torchrun it starts; each worker sets it (SIGTERM) on itself, so a worker also dies when its
torchrun agent is killed outright. A SIGTERM a worker gets ends it at once (Python's default
action); checkpoints are atomic, so the last complete one stays resumable.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> None:
    """Asks the kernel to send `sig` to this process when its parent exits. `expected_parent`:
    if the parent is not that pid any more (it died before the call), exits now. A no-op off
    Linux."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))
