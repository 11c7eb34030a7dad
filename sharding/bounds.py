"""A lower bound on the modeled step time of any plan drawn from a search space.

The modeled step (``sharding/cost_model.py``) is the slowest rank's lookups and host traffic
plus, per collective phase, its busiest directed link, plus the sharding types' latency:

    step = max_r (lookup_r + host_r) + sum_phases max_k load[phase, k] + latency

Both maxima are at least a weighted mean: ``max_r x_r >= sum_r x_r / world`` and ``max_k
load_k >= sum_k weight_k load_k`` for weights summing to 1. The weights are those of the links
that are some rank pair's first or last hop (``TopologyCostModel.edge_weight``; every transfer
loads its first and its last hop), so the bound is exact when every such link carries the same
load. Both sums add up per table over the phases, so

    bound = min_type_latency + sum_t min_{option of t} contribution(option)

with ``contribution = sum_r (lookup + host) / world + sum_phases weight . load``, each
table-/column-wise shard on the rank where that is least (memory ignored). A shard's host
traffic (UVM) is a max over shared resources, not a sum; its share is bounded below by its bytes
over the fastest resource of the model. No plan reaches the bound unless the tables split into
equal loads per rank and per link; it says how far below a given plan any plan of the same
search space could possibly go, by the model (the benchmark prints ``lower_bound / default``).
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
    return latency + sum(best.values())


def option_contribution(model: TopologyCostModel, so: ShardingOption) -> float:
    """The least ``sum_r (lookup + host) / world + edge_weight . loads`` (seconds, without
    collective latency) that ``so`` can add (see the module docstring)."""
    m = model
    protos = placed_from_option(_ranked(so, 0))
    if not protos:
        return 0.0
    fastest_res = max(m.res_bw, default=float("inf"))
    wt = m.edge_weight
    L = m.links
    total = 0.0
    if so.sharding_type in _A2A:
        st = m.new_state()
        in_w, out_w = L.in_inv @ wt, L.out_inv @ wt  # [world]: weighted load per byte per peer
        for p in protos:
            lb = st._lookup_bytes(p)
            hf = st._host_fraction(p)
            per_rank = (lb * (1 - hf) / m.mem_bw + lb * hf / fastest_res) / m.world
            per_rank = per_rank + m.ids_bytes(p.pooling) * in_w + m.batch * p.cols * 4.0 * (in_w + out_w)
            total += float(per_rank.min())
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
        links = sum(float(v @ wt) for v in st.loads.values())
        out = min(out, (float(st.lookup.sum()) + host) / m.world + links)
    return out


def _ranked(so: ShardingOption, rank: int):
    return with_all_ranks(so, rank)
