"""The planner's last callback: cache load factors grown into the HBM a plan leaves free.

torchrec sizes a ``fused_uvm_caching`` or ``key_value`` (SSD) table's HBM cache from
``CacheParams.load_factor``; the search places those tables with the load factor they started
with (the default, the one reaching ``target_hit_rate`` from measured statistics, or the SSD
tier's start value), so a plan usually leaves HBM unused on their ranks. This callback runs after
the search, on the chosen plan, and spends that HBM on their caches. It is separate from the
planner class because it is a pure function of the placed plan and the storage it was placed in.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from torchrec.distributed.planner.types import ShardingOption, Storage, Topology
from torchrec.distributed.types import CacheParams

from sharding.constants import DEFAULT_LOAD_FACTOR, MAX_CACHE_LOAD_FACTOR, SSD_KERNELS
from sharding.planner.cache_sizing import saturation_load_factor

# the share of a rank's free HBM a table's cache may take at once (a margin for rounding)
FREE_HBM_SHARE = 0.95


def grow_cache_load_factors(plan: list[ShardingOption], storage_constraint: Topology | None) -> list[ShardingOption]:
    """Raise each UVM-caching and key_value (SSD) table's load factor into the HBM still free on
    its ranks of ``storage_constraint`` (largest tables first), up to ``MAX_CACHE_LOAD_FACTOR``, in
    steps of 0.01. Tables with measured cache statistics go first, by modeled miss traffic
    (lookups x dim x miss rate), and never past the load factor where their hit-rate curve stops
    rising (``saturation_load_factor``). The shards' HBM storage grows with their cache. Without a
    storage constraint (nothing was partitioned) the plan is returned as it is."""
    if storage_constraint is None:
        return plan
    free = np.array([float(d.storage.hbm) for d in storage_constraint.devices])
    for so in plan:
        for sh in so.shards:
            free[sh.rank] -= sh.storage.hbm
    caching = [so for so in plan if so.compute_kernel in ("fused_uvm_caching",) + SSD_KERNELS]
    caching.sort(key=_order)
    for so in caching:
        cp = so.cache_params
        lf = cp.load_factor if cp is not None and cp.load_factor is not None else DEFAULT_LOAD_FACTOR
        cap = MAX_CACHE_LOAD_FACTOR
        st = _stats_of(so)
        if st is not None:
            cap = min(cap, saturation_load_factor(st))
        if lf >= cap:
            continue
        # extra HBM per shard for each +1.0 of load factor
        per = [(sh, sh.size[0] * sh.size[1] * 4) for sh in so.shards]
        room = min((free[sh.rank] / b if b else math.inf) for sh, b in per)
        new = min(cap, lf + FREE_HBM_SHARE * room)
        new = math.floor(new * 100) / 100
        if new <= lf + 0.01:
            continue
        for sh, b in per:
            extra = b * (new - lf)
            free[sh.rank] -= extra
            sh.storage = Storage(hbm=int(sh.storage.hbm + extra), ddr=sh.storage.ddr, ssd=sh.storage.ssd)
        so.cache_params = dataclasses.replace(cp, load_factor=new) if cp is not None else CacheParams(load_factor=new)
    return plan


def _stats_of(so: ShardingOption):
    return None if so.cache_params is None else so.cache_params.stats


def _order(so: ShardingOption) -> tuple:
    """Measured tables first, by modeled miss traffic; then the others, largest first; ties by name."""
    st = _stats_of(so)
    if st is None:
        return (1, -so.tensor.shape[0] * so.tensor.shape[1], 0.0, so.name)
    lf0 = so.cache_params.load_factor if so.cache_params.load_factor is not None else DEFAULT_LOAD_FACTOR
    pooling = float(sum(so.input_lengths)) if so.input_lengths else 1.0
    return (0, -pooling * so.tensor.shape[1] * st.expected_miss_rate(lf0), 0.0, so.name)
