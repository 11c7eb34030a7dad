"""A lower bound on the modeled step time of any plan drawn from a search space.

The modeled step (``sharding/planner/cost/model.py``) is the slowest rank's lookups and host traffic
plus, per collective phase, its busiest directed link, plus the sharding types' latency:

    step = max_r (lookup_r + host_r) + sum_phases max_k load[phase, k] + latency

Both maxima are at least a weighted mean: ``max_r x_r >= sum_r x_r / world`` and ``max_k
load_k >= sum_k weight_k load_k`` for any weights summing to 1. Both sums add up per table over
the phases, so for each weighting

    bound(weights) = min_type_latency + sum_t min_{option of t} contribution(option, weights)

with ``contribution = sum_r (lookup + host) / world + sum_phases weights . load``, each
table-/column-wise shard on the rank where that is least (memory ignored), and the bound is the
largest over the weightings of ``TopologyCostModel.bound_weights``: the links that are some
transfer's first or last hop (every transfer loads both; exact when those links carry equal
loads, e.g. one NVSwitch host), and per bandwidth class the links of that class some path
crosses (across DGX hosts: the 25 GB/s PCIe ports, NICs and fabric ports that every cross-host
transfer must pass). A shard's host traffic (UVM) is a max over shared resources, not a sum;
its share is bounded below by its bytes over the fastest resource of the model. A key_value
shard's SSD time lands on at least one rank of its host: its share is its SSD seconds on the
fastest host's drives (over ``world``, like every rank term). No plan reaches the bound unless the tables split into
equal loads per rank and per link; it says how far below a given plan any plan of the same
search space could possibly go, by the model (the benchmark prints ``lower_bound / default``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
from torchrec.distributed.planner.types import ShardingOption

from sharding.constants import A2A_TYPES as _A2A, SSD_KERNELS, UVM_KERNELS
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import placed_from_option, with_all_ranks


def step_time_lower_bound(model: TopologyCostModel, search_space: list[ShardingOption]) -> float:
    """Seconds: no plan of ``search_space`` (one option per table) has a lower modeled step time."""
    if not search_space:
        return 0.0
    n = max(1, model.bound_weights.shape[1])
    best: dict[str, np.ndarray] = defaultdict(lambda: np.full(n, np.inf))
    latency = float("inf")
    for so in search_space:
        best[so.name] = np.minimum(best[so.name], option_contribution(model, so))
        latency = min(latency, model.type_latency(so.sharding_type))
    return latency + float(np.sum(list(best.values()), axis=0).max())


def option_contribution(model: TopologyCostModel, so: ShardingOption) -> np.ndarray:
    """Per weighting of ``model.bound_weights``: the least ``sum_r (lookup + host) / world +
    weights . loads`` (seconds, without collective latency) that ``so`` can add."""
    m = model
    W = m.bound_weights if m.bound_weights.shape[1] else np.zeros((m.links.count, 1))
    protos = placed_from_option(_ranked(so, 0))
    if not protos:
        return np.zeros(W.shape[1])
    fastest_res = max(m.res_bw, default=float("inf"))
    L = m.links

    def ssd_share(st, p) -> float:  # the shard's SSD seconds on the fastest host (0 for other kernels)
        io = st.ssd_traffic(p)
        return min(st.ssd_seconds(h, io, io) for h in range(len(m.topo.hosts))) if io else 0.0

    if so.sharding_type in _A2A:
        st = m.new_state()
        in_w, out_w = L.in_inv @ W, L.out_inv @ W  # [world, weightings]: weighted load per byte per peer
        total = np.zeros(W.shape[1])
        for p in protos:
            lb = st._lookup_bytes(p)
            hf = st._host_fraction(p)
            miss = st._ssd_fraction(p)
            local = (lb * (1 - hf - miss) / m.mem_bw + lb * hf / fastest_res + ssd_share(st, p)) / m.world
            per_rank = local[:, None] + m.ids_bytes(p.pooling) * in_w + m.batch * p.cols * 4.0 * (in_w + out_w)
            total += per_rank.min(axis=0)
        return total
    # uniform (RW, DP) and table-row-wise: the options' own placements (each host for TWRW)
    if so.sharding_type == "table_row_wise":  # one NVLink domain's ranks (a host's, usually)
        placements = [list(g[: len(protos)]) for g in m.twrw_groups]
    else:
        placements = [list(range(len(protos)))]
    out = np.full(W.shape[1], np.inf)
    for ranks in placements:
        st = m.new_state()
        host = 0.0
        for p, r in zip(protos, ranks):
            p = replace(p, rank=r, group=tuple(ranks))
            hf = st._host_fraction(p) + st._ssd_fraction(p)
            host += st._lookup_bytes(p) * st._host_fraction(p) / fastest_res + ssd_share(st, p)
            st.add(replace(p, kernel="fused") if p.kernel in UVM_KERNELS + SSD_KERNELS else p)
            if hf:  # the device-resident add charged all lookups to device memory
                st.lookup[r] -= st._lookup_bytes(p) * hf / m.mem_bw[r]
        links = sum((v @ W for v in st.loads.values()), np.zeros(W.shape[1]))
        out = np.minimum(out, (float(st.lookup.sum()) + host) / m.world + links)
    return out


def _ranked(so: ShardingOption, rank: int):
    return with_all_ranks(so, rank)
