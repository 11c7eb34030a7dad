"""The planner's modelled step of a finished plan, in one place: what the topology-aware planner
logs for the plan it returns, and what `recsys-plan show --topology` and `diff --topology` print
for a plan file. Both call :func:`modeled_step`, i.e. ``TopologyCostModel.score_sharding_plan``
(sharding/planner/cost/model.py: lookups, host traffic, each collective phase's busiest directed link plus
latency), with the same inputs: the tables' shapes, the batch per rank and the pooling factors.
So a report shows the number the planner minimised, not a second model's.

``sharding/planner/cost/traffic.py`` stays what it is for: bytes between ranks by link kind and host
loads (what a person reads to see *where* traffic goes); its seconds are no longer reported as
the plan's step.
"""

from __future__ import annotations

from typing import Any, Mapping

from torchrec.distributed.types import ShardingPlan

from sharding.planner.cost.model import PlanCost, TopologyCostModel
from sharding.topology.cluster import ClusterTopology

__all__ = ["modeled_step", "plan_tables", "plan_pooling", "format_step", "step_line"]


def plan_tables(header: Mapping[str, Any]) -> dict[str, dict]:
    """``{table: {num_embeddings, embedding_dim}}`` from a plan file's header."""
    return {
        name: {"num_embeddings": int(t["num_embeddings"]), "embedding_dim": int(t["embedding_dim"])}
        for name, t in header.get("tables", {}).items()
    }


def plan_pooling(header: Mapping[str, Any]) -> dict[str, float]:
    """Per-table pooling factors the plan was made with (``meta.pooling``; absent: 1.0 each)."""
    pooling = (header.get("meta") or {}).get("pooling") or {}
    return {str(k): float(v) for k, v in pooling.items()}


def modeled_step(
    plan: ShardingPlan,
    tables: Mapping[str, dict],
    topo: ClusterTopology,
    batch_size_per_rank: int,
    pooling: Mapping[str, float] | None = None,
    model: TopologyCostModel | None = None,
) -> PlanCost:
    """The planner's cost model scored on a finished ``ShardingPlan``. ``model``: a cost model of
    this topology and batch already built (the planner's own: building one for 128 ranks takes
    about 1.5 s, the link matrices); otherwise one is built."""
    if model is None or model.topo is not topo or model.batch != batch_size_per_rank:
        model = TopologyCostModel(topo, batch_size_per_rank)
    return model.score_sharding_plan(plan, dict(tables), dict(pooling or {}))


def step_line(cost: PlanCost) -> str:
    """One line: the modelled step, the slowest rank and its share of the collectives."""
    return (
        f"modeled step {cost.step_time * 1e3:.4f} ms (slowest rank {cost.bottleneck_rank}: "
        f"{cost.rank_time[cost.bottleneck_rank] * 1e3:.4f} ms; collectives {cost.comm_time * 1e3:.4f} ms)"
    )


def format_step(cost: PlanCost, topology: str, batch_size_per_rank: int) -> str:
    """The step, per rank (lookups, host traffic, collectives attributed to the rank's own links)
    and the busiest directed link of every collective phase."""
    ssd = bool(cost.ssd_bytes.any())  # an SSD column only for plans with key_value tables
    lines = [
        f"{step_line(cost)} on {topology}, batch {batch_size_per_rank} per rank (the planner's model: sharding/planner/cost/model.py)",
        f"{'rank':<6} {'lookup ms':>10} {'host io ms':>11} "
        + (f"{'ssd io ms':>10} {'SSD':>12} " if ssd else "")
        + f"{'comm ms':>9} {'total ms':>9}",
    ]
    for r in range(len(cost.rank_time)):
        lines.append(
            f"{r:<6} {cost.lookup[r] * 1e3:>10.4f} {cost.host_io[r] * 1e3:>11.4f} "
            + (f"{cost.ssd_io[r] * 1e3:>10.4f} {cost.ssd_bytes[r] / 2**30:>8,.1f} GiB " if ssd else "")
            + f"{cost.comm[r] * 1e3:>9.4f} {cost.rank_time[r] * 1e3:>9.4f}"
        )
    for phase, (link, secs) in sorted(cost.phases.items()):
        lines.append(f"busiest link, {phase}: {link} ({secs * 1e3:.4f} ms)")
    return "\n".join(lines)
