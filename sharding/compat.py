"""What differs across the supported torch / FBGEMM / torchrec versions, in one place.

The project supports torch 2.11-2.14 with FBGEMM 1.6-1.9 and torchrec 1.6-1.9 (docs/install.md).
Where those versions behave differently, this module says which version needs what, and code
elsewhere calls it instead of probing with ``hasattr``. tests/test_compat.py has a test per
branch; CI runs the oldest and newest stacks (tools/stack_tier.sh).

Differences handled here:

- FBGEMM 1.6.0's ``fbgemm_gpu/__init__.py`` has no entry for its own version in its torch
  compatibility table (it stops at 1.5), so every library it loads logs a multi-line "has no entry
  for 1.6.0 of FBGEMM; cannot determine compatibility" warning, 14 of them per process, although
  FBGEMM 1.6 is the release built for torch 2.11. :func:`install_log_filters` drops exactly that
  message, and only with torch 2.11 (any other pairing keeps FBGEMM's own warnings).

Nothing here imports torchrec or FBGEMM: versions are read from the installed distributions'
metadata, so ``import sharding`` stays cheap.
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from importlib import metadata

__all__ = ["distribution_version", "fbgemm_version", "torchrec_version", "torch_version",
           "install_log_filters", "FbgemmCompatTableFilter"]


def _parse(version: str) -> tuple[int, int, int]:
    """'2.11.0+cu130' -> (2, 11, 0); missing parts are 0."""
    nums = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


@lru_cache(maxsize=None)
def distribution_version(*names: str) -> tuple[int, int, int] | None:
    """The version of the first installed distribution among ``names``, or None."""
    for name in names:
        try:
            return _parse(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    return None


def torch_version() -> tuple[int, int, int] | None:
    return distribution_version("torch")


def fbgemm_version() -> tuple[int, int, int] | None:
    """FBGEMM_GPU's version, whichever build (CUDA ``fbgemm-gpu`` or ``fbgemm-gpu-cpu``) is installed."""
    return distribution_version("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm_gpu", "fbgemm_gpu_cpu")


def torchrec_version() -> tuple[int, int, int] | None:
    return distribution_version("torchrec")


class FbgemmCompatTableFilter(logging.Filter):
    """Drops FBGEMM 1.6's false "_fbgemm_torch_compat_table has no entry for 1.6.x" warning when
    torch is 2.11 (the pairing FBGEMM's release notes give for 1.6); lets everything else through."""

    NEEDLE = "_fbgemm_torch_compat_table has no entry for 1.6."

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not isinstance(record.msg, str) or self.NEEDLE not in record.msg:
            return True
        tv = torch_version()
        return not (tv is not None and tv[:2] == (2, 11))


def install_log_filters() -> None:
    """Install the filters above on the root logger (FBGEMM logs with ``logging.warning``), once.
    Called when ``sharding`` or ``recsys`` is imported, before anything imports FBGEMM."""
    root = logging.getLogger()
    if not any(isinstance(f, FbgemmCompatTableFilter) for f in root.filters):
        root.addFilter(FbgemmCompatTableFilter())
