"""The SSD tier in the planner: which tables may live on SSD, and what a ``key_value`` shard stores.

FBGEMM's SSD embedding kernels (torchrec's ``key_value`` compute kernel) keep a table's rows and
their optimizer state on the host's NVMe drives, with an HBM cache of hot rows in front. They run
on CUDA only. SSD is orders of magnitude slower than HBM, so the planner offers the kernel only
where nothing else can hold the model (``key_value_tables``): on a CUDA topology whose every
host has an SSD tier (``ssd:`` in the topology file), to the largest tables, largest first,
until the rest fit in HBM and host memory (after torchrec's reserve), and to any table larger
than HBM or host memory can hold on their own. A model that fits without SSD is planned exactly
as before.

Storage of a key_value shard of ``R x C`` (``key_value_storage``), replacing torchrec's estimate,
which counts no HBM cache unless ``KeyValueParams.max_l1_cache_size`` is set and adds UVM-cache
bookkeeping to the SSD figure:

- ``ssd = R*C*element bytes + optimizer state`` (``sharding/optimizer_state.py``, the table's
  fused optimizer as its sharder runs it), checked per host by the partitioner;
- ``hbm = torchrec's estimate (input/output buffers) + load_factor * R*C*element bytes`` (the
  cache torchrec sizes from ``CacheParams.load_factor`` at run time; a table without one starts
  at ``KEY_VALUE_START_LOAD_FACTOR`` and the planner grows it into free HBM after the search);
- ``ddr = 0``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from torchrec.distributed.planner.types import ShardingOption, Storage, Topology
from torchrec.distributed.types import CacheParams, ModuleSharder

from sharding.constants import KEY_VALUE_START_LOAD_FACTOR, SSD_KERNELS
from sharding.plan.fit_report import TORCHREC_RESERVE
from sharding.optimizer_state import UnknownOptimizerError, optimizer_kind, sharder_fused_params, state_bytes

__all__ = ["has_ssd_tier", "key_value_tables", "key_value_storage", "apply_key_value_storage"]


def has_ssd_tier(topology: Topology) -> bool:
    """Whether torchrec's ``Topology`` (as ``torchrec_topology`` builds it) can run key_value
    tables: CUDA ranks, each with SSD capacity (0 where a host has no SSD tier)."""
    return topology.compute_device == "cuda" and all(d.storage.ssd > 0 for d in topology.devices)


def key_value_tables(table_bytes: Mapping[str, int], topology: Topology, reserve: float = TORCHREC_RESERVE) -> list[str]:
    """The tables the planner offers the key_value kernel: none without an SSD tier; else the
    largest tables (ties by name), in order, while the tables not taken exceed ``1 - reserve``
    of all HBM + host memory, or the next one alone exceeds ``1 - reserve`` of all HBM or of all
    host memory (what fused / fused_uvm / fused_uvm_caching can give one table, row-wise over
    every rank). ``table_bytes``: weights + optimizer state per table."""
    if not has_ssd_tier(topology):
        return []
    hbm = sum(d.storage.hbm for d in topology.devices)
    ddr = sum(d.storage.ddr for d in topology.devices)
    usable, one_table = (1 - reserve) * (hbm + ddr), (1 - reserve) * max(hbm, ddr)
    rest = sum(table_bytes.values())
    out = []
    for name, size in sorted(table_bytes.items(), key=lambda kv: (-kv[1], kv[0])):
        if rest <= usable and size <= one_table:
            break
        out.append(name)
        rest -= size
    return out


def key_value_storage(
    so: ShardingOption, fused_params: Mapping[str, Any] | None = None, start_load_factor: float = KEY_VALUE_START_LOAD_FACTOR
) -> None:
    """Sets the storage of a key_value option's shards (module docstring) and, when its
    ``cache_params`` name no load factor, the start load factor (a new ``CacheParams``: torchrec
    shares one object among a table's options). An optimizer with no known state layout keeps
    torchrec's SSD figure."""
    cp = so.cache_params
    if cp is None or cp.load_factor is None:
        cp = so.cache_params = dataclasses.replace(cp or CacheParams(), load_factor=start_load_factor)
    elem = so.tensor.element_size()
    try:
        kind: str | None = optimizer_kind(so.tensor, fused_params)
    except UnknownOptimizerError:
        kind = None
    torchrec_cache = so.key_value_params is not None and so.key_value_params.max_l1_cache_size
    for sh in so.shards:
        rows, cols = int(sh.size[0]), int(sh.size[1])
        weights = rows * cols * elem
        ssd = sh.storage.ssd if kind is None else weights + state_bytes(kind, rows, cols)
        hbm = sh.storage.hbm if torchrec_cache else sh.storage.hbm + math.ceil(cp.load_factor * weights)
        sh.storage = Storage(hbm=int(hbm), ddr=0, ssd=int(ssd))


def apply_key_value_storage(space: list[ShardingOption], sharders: list[ModuleSharder]) -> None:
    """``key_value_storage`` for every key_value option of an enumerated search space."""
    for so in space:
        if so.compute_kernel in SSD_KERNELS:
            key_value_storage(so, sharder_fused_params(sharders, so.module[1]))
