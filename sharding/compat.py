"""What differs across the supported torch / FBGEMM / torchrec versions, in one place.

The project supports torch 2.11-2.14 with FBGEMM 1.6-1.9 and torchrec 1.6-1.9 (docs/install.md).
Where those versions behave differently, this module says which version needs what, and code
elsewhere calls it instead of probing with ``hasattr``. tests/unit/sharding/test_compat.py has a test per
branch; CI runs the oldest and newest stacks (tools/ci/stack_tier.sh).

Differences handled here (versions checked against the installed sources of torchrec 1.6.1,
1.7.0, 1.8.0, 1.9.2 and FBGEMM 1.6.0-1.9.0):

- **FBGEMM 1.6 and 1.7**: ``fbgemm_gpu/__init__.py``'s torch compatibility table stops at 1.5, so
  every library FBGEMM loads logs a multi-line "has no entry for 1.6.0 of FBGEMM; cannot determine
  compatibility" warning, 14 per process, although 1.6 / 1.7 are the releases built for torch
  2.11 / 2.12 (1.8 and 1.9 list themselves). :func:`install_log_filters` drops exactly that message,
  and only for FBGEMM's own pairing (1.x with torch 2.(x+5)); any other pairing keeps the warning.
- **FBGEMM < 1.7** has no ``fbgemm_gpu.tbe.config``: its CowClip weight-decay types live in
  ``split_table_batched_embeddings_ops_training`` (:func:`fbgemm_cowclip_types`).
- **torchrec < 1.7**: ``ShardedEmbeddingBagCollection.__init__`` wraps data-parallel lookups in DDP
  inline; 1.7 moved that into ``init_data_parallel()``, which a subclass can override
  (:data:`SEBC_WRAPS_DP_IN_INIT`, :func:`ddp_wrap_skipping`).
- **torchrec < 1.7**: shard estimators take the enumerator's sharders (``estimate(options,
  sharder_map)``); 1.7 passes precomputed ``SharderData`` (``estimate(options, sharder_data_map)``)
  (:func:`estimator_sharders`).
- **torchrec < 1.7**: a capacity of 0 (no SSD, no HBM) in ``HardwareConfig`` / ``Topology`` reads as
  "not set", so each rank gets torchrec's default (2 TB of SSD); 1.7 tests ``is not None``
  (:func:`keep_zero_capacities`).

Nothing here imports torchrec or FBGEMM: versions are read from the installed distributions'
metadata, so ``import sharding`` stays cheap.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from typing import Any

__all__ = [
    "distribution_version",
    "fbgemm_version",
    "torchrec_version",
    "torch_version",
    "install_log_filters",
    "FbgemmCompatTableFilter",
    "fbgemm_cowclip_types",
    "SEBC_WRAPS_DP_IN_INIT",
    "ddp_wrap_skipping",
    "keep_zero_capacities",
    "estimator_sharders",
]


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
    """Drops FBGEMM 1.6/1.7's false "_fbgemm_torch_compat_table has no entry for 1.x.y of FBGEMM"
    warning when torch is FBGEMM's own pairing, 2.(x+5) (FBGEMM's release table: 1.6 <-> 2.11,
    1.7 <-> 2.12); lets everything else through."""

    PATTERN = re.compile(r"_fbgemm_torch_compat_table has no entry for 1\.(6|7)\.\d+")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not isinstance(record.msg, str):
            return True
        m = self.PATTERN.search(record.msg)
        if m is None:
            return True
        tv = torch_version()
        return not (tv is not None and tv[:2] == (2, int(m.group(1)) + 5))


def install_log_filters() -> None:
    """Install the filters above on the root logger (FBGEMM logs with ``logging.warning``), once.
    Called when ``sharding`` or ``recsys`` is imported, before anything imports FBGEMM."""
    root = logging.getLogger()
    if not any(isinstance(f, FbgemmCompatTableFilter) for f in root.filters):
        root.addFilter(FbgemmCompatTableFilter())


def fbgemm_cowclip_types() -> tuple[Any, Any, Any]:
    """FBGEMM's ``(CounterWeightDecayMode, CowClipDefinition, WeightDecayMode)``: from
    ``fbgemm_gpu.tbe.config.optimizer_config`` (FBGEMM >= 1.7), else from
    ``fbgemm_gpu.split_table_batched_embeddings_ops_training`` (1.6)."""
    fv = fbgemm_version()
    if fv is not None and fv[:2] < (1, 7):
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            CounterWeightDecayMode,
            CowClipDefinition,
            WeightDecayMode,
        )
    else:
        from fbgemm_gpu.tbe.config.optimizer_config import CounterWeightDecayMode, CowClipDefinition, WeightDecayMode
    return CounterWeightDecayMode, CowClipDefinition, WeightDecayMode


def _torchrec_before(version: tuple[int, int]) -> bool:
    tv = torchrec_version()
    return tv is not None and tv[:2] < version


# torchrec < 1.7: ShardedEmbeddingBagCollection.__init__ DDP-wraps data-parallel lookups itself
# (1.7+: in init_data_parallel(), called from __init__ and overridable).
SEBC_WRAPS_DP_IN_INIT: bool = _torchrec_before((1, 7))


@contextmanager
def ddp_wrap_skipping(skip: Callable[[Any], bool], module_name: str = "torchrec.distributed.embeddingbag") -> Iterator[None]:
    """For torchrec < 1.7 (:data:`SEBC_WRAPS_DP_IN_INIT`): while the block runs,
    ``ShardedEmbeddingBagCollection.__init__``'s inline ``DistributedDataParallel(module=lookup, ...)``
    returns ``lookup`` itself, unwrapped, when ``skip(lookup)``; every other lookup is wrapped as
    usual. The subclass then calls its own ``init_data_parallel()``, as torchrec 1.7+ does.
    ``module_name``: the torchrec module whose ``DistributedDataParallel`` is patched
    (``torchrec.distributed.embedding`` for ``ShardedEmbeddingCollection``)."""
    import importlib

    ebc_module = importlib.import_module(module_name)

    ddp = ebc_module.DistributedDataParallel

    class _DDPUnlessSkipped(ddp):  # type: ignore[misc, valid-type]
        def __new__(cls, module: Any = None, *args: Any, **kwargs: Any) -> Any:
            if module is not None and skip(module):
                return module  # not an instance of cls: __init__ is not called
            return super().__new__(cls)

    ebc_module.DistributedDataParallel = _DDPUnlessSkipped
    try:
        yield
    finally:
        ebc_module.DistributedDataParallel = ddp


def keep_zero_capacities(topology: Any, hbm: int | None, ddr: int | None, ssd: int | None) -> Any:
    """A torchrec ``Topology`` built from capacities some of which are 0: with torchrec < 1.7 those
    came out as torchrec's defaults (0 reads as unset); set them back to 0 on every device.
    Returns ``topology`` (changed in place)."""
    if _torchrec_before((1, 7)):
        for device in topology.devices:
            for name, value in (("hbm", hbm), ("ddr", ddr), ("ssd", ssd)):
                if value == 0:
                    setattr(device.storage, name, 0)
    return topology


def estimator_sharders(enumerator: Any) -> Any:
    """What a torchrec ``ShardEstimator.estimate(options, ...)`` takes as its second argument, from
    an enumerator that has enumerated: the ``SharderData`` map (torchrec >= 1.7), else the sharders."""
    return enumerator._sharder_map if _torchrec_before((1, 7)) else enumerator._sharder_data_map
