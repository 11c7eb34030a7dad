"""A lower bound on the modeled step time of any plan drawn from a search space.

The step time is the slowest rank's time, so it is at least the mean over ranks. In the cost
model (``sharding/cost_model.py``) each shard adds to the ranks' lookup and comm terms
independently of the others, so the sum over ranks of a plan's time is at least the sum, over
tables, of the cheapest sum any one of the table's options can contribute, each shard on its
cheapest rank (memory ignored). Host-memory traffic (UVM) is a max over shared resources, not a
sum; a shard's share of it is bounded below by its bytes over the fastest resource of the model.
Every plan uses at least one sharding type, so the cheapest type's collective latency is added.

    mean-rank bound = min_type_latency + sum_t min_{option of t} contribution(option) / world

No whole-table plan reaches it unless the tables split into equal loads per rank; it says how far
below a given plan any plan of the same search space could possibly go, by the model (the
benchmark prints ``lower_bound / default`` as the best ratio the target could be met with).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
from torchrec.distributed.planner.types import ShardingOption

from sharding.constants import A2A_TYPES as _A2A, UVM_KERNELS
from sharding.cost_model import TopologyCostModel, placed_from_option, with_all_ranks


def step_time_lower_bound(model: TopologyCostModel, search_space: list[ShardingOption]) -> float:
    """Seconds: no plan of ``search_space`` (one option per table) has a lower modeled step time."""
    if not search_space:
        return 0.0
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    latency = float("inf")
    for so in search_space:
        best[so.name] = min(best[so.name], option_contribution(model, so))
        latency = min(latency, model.type_latency(so.sharding_type))
    return latency + sum(best.values()) / model.world


def option_contribution(model: TopologyCostModel, so: ShardingOption) -> float:
    """The least sum over ranks of rank time (without collective latency) that ``so`` can add."""
    m = model
    protos = placed_from_option(_ranked(so, 0))
    if not protos:
        return 0.0
    fastest_res = max(m.res_bw, default=float("inf"))
    col_inv = m.inv_bw.sum(axis=0)
    total = 0.0
    if so.sharding_type in _A2A:
        st = m.new_state()
        for p in protos:
            lb = st._lookup_bytes(p)
            hf = st._host_fraction(p)
            per_rank = lb * (1 - hf) / m.mem_bw + m.a2a_unit(p.cols, p.pooling) * (m.inv_rowsum + col_inv)
            total += float(per_rank.min()) + lb * hf / fastest_res
        return total
    # uniform (RW, DP) and table-row-wise: the options' own placements (each host for TWRW)
    if so.sharding_type == "table_row_wise":
        lw = m.topo.local_world_size
        placements = [[h * lw + i for i in range(len(protos))] for h in range(len(m.host_ranks))]
    else:
        placements = [list(range(len(protos)))]
    out = float("inf")
    for ranks in placements:
        st = m.new_state()
        host = 0.0
        for p, r in zip(protos, ranks):
            p = replace(p, rank=r, group=tuple(ranks))
            hf = st._host_fraction(p)
            host += st._lookup_bytes(p) * hf / fastest_res
            st.add(replace(p, kernel="fused") if p.kernel in UVM_KERNELS else p)
            if hf:  # the device-resident add charged all lookups to device memory
                st.lookup[r] -= st._lookup_bytes(p) * hf / m.mem_bw[r]
        latency = m.type_latency(so.sharding_type)
        out = min(out, float(st.rank_time().sum()) - latency * m.world + host)
    return out


def _ranked(so: ShardingOption, rank: int):
    return with_all_ranks(so, rank)
