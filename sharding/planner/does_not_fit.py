"""When the model does not fit: the planner's error type and the one line that says what the
model needs (weights plus each table's real optimizer state), what the cluster has and what
would fit."""

from __future__ import annotations

import math

from torch import nn
from torchrec.distributed.planner.types import (
    PlannerError,
    PlannerErrorType,
    Topology,
)
from torchrec.distributed.types import ModuleSharder

from sharding.optimizer_state import table_bytes
from sharding.planner.ssd_tier import key_value_tables
from sharding.plan.fit_report import TORCHREC_RESERVE, format_bytes, planner_said, reserve_exceeds_hbm
from sharding.topology.cluster import ClusterTopology


class ModelDoesNotFitError(PlannerError):
    """torchrec's "insufficient storage" ``PlannerError`` with ``fit_message``'s one line as its message."""

    def __init__(self, message: str) -> None:
        super().__init__(message=message, error_type=PlannerErrorType.INSUFFICIENT_STORAGE)


def fit_message(
    cluster: ClusterTopology, module: nn.Module, topo: Topology, err: Exception, sharders: list[ModuleSharder[nn.Module]] | None = None
) -> str:
    """One line: what the model needs (weights plus each table's real optimizer state), what the
    cluster has (its SSD tier too), the largest tables, what would fit."""
    tables = table_bytes(module, sharders)
    need = sum(tables.values())
    top = sorted(tables.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    w = cluster.world_size
    cpu = cluster.compute_device == "cpu"
    # the capacities planned with: torchrec's topology carries --hbm-gb / --ddr-gb overrides
    hbm_dev = 0 if cpu else min(d.storage.hbm for d in topo.devices)
    host = min(d.storage.ddr for d in topo.devices) * cluster.local_world_size
    ssd = 0 if cpu else min(h.ssd_bytes for h in cluster.hosts)
    avail_hbm, avail_host, avail_ssd = hbm_dev * w, host * len(cluster.hosts), ssd * len(cluster.hosts)
    per_rank = hbm_dev + host / cluster.local_world_size
    if need > 0.85 * (avail_hbm + avail_host) + avail_ssd:
        per = 0.85 * per_rank + ssd / cluster.local_world_size  # what a rank brings, its share of SSD too
        ranks_needed = math.ceil(need / per) if per else 0
        fix = (
            f"about {ranks_needed} ranks ({math.ceil(ranks_needed / cluster.local_world_size)} hosts like these), "
            + ("or more SSD per host, " if ssd else "")
            + "or smaller embedding_dim / fewer rows for the largest tables"
        )
    elif ssd and key_value_tables(tables, topo):  # key_value was offered to them: the SSD tier is too small
        fix = (
            f"more SSD per host or more hosts (a key_value table lives on its hosts' SSD; the largest needs "
            f"{format_bytes(top[0][1])}), or smaller embedding_dim / fewer rows for the largest tables"
        )
    else:
        fix = "allow fused_uvm_caching / fused_uvm and row_wise sharding for the largest tables, or smaller embedding_dim for them"
    if reserve_exceeds_hbm(err):
        fix = (
            f"more HBM per rank (each rank's {format_bytes(hbm_dev)} is less than what torchrec reserves before placing any "
            f"table: {TORCHREC_RESERVE:.0%} of it, the dense modules and the input buffers)"
        )
    ssd_part = f" and {format_bytes(ssd)} SSD per host ({format_bytes(avail_ssd)} in all)" if ssd else ""
    first = planner_said(err)
    return (
        f"model does not fit {cluster.name or 'topology'} ({w} ranks, {len(cluster.hosts)} "
        f"host{'s' if len(cluster.hosts) != 1 else ''}): "
        f"embeddings need {format_bytes(need)} (weights + optimizer state), available {format_bytes(hbm_dev)} HBM per device "
        f"({format_bytes(avail_hbm)} in all) and {format_bytes(host)} host memory per host ({format_bytes(avail_host)} in all){ssd_part}; "
        f"largest tables: " + ", ".join(f"{n} {format_bytes(b)}" for n, b in top) + f"; to fit: {fix}; planner said: {first}"
    )
