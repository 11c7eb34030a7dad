"""Planner seam: the one function the trainer calls to turn a model into a ShardingPlan.

Which planner is a setting (``sharding.planner``): ``torchrec``, torchrec's own
`EmbeddingShardingPlanner` on a `Topology` built from the process group, or ``topology``, our
`TopologyAwarePlanner` on a topology file; both answer the same `plan()` / `collective_plan()`
contract.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    PlannerError,
    PlannerErrorType,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from typing import Protocol, Sequence

from sharding.planner.cache_sizing import DEFAULT_TARGET_HIT_RATE, apply_cache_stats
from sharding.constants import MODEL_PARALLEL_TYPES as _MODEL_PARALLEL_TYPES
from sharding.tables import table_configs
from sharding.planner.job_topology import cluster_for
from sharding.planner.topology_planner import TopologyAwarePlanner, default_constraints


class PlannerSettings(Protocol):
    """What the seam reads of a run's sharding settings (the trainer's ``ShardingConfig`` has
    these fields; any object with them will do: this package does not import the trainer)."""

    planner: str  # "torchrec" or "topology"
    topology: str  # planner == "topology": a topology file or shipped name ("" on CPU: cpu-gloo)
    sharding_types: Sequence[str]  # empty: the model-parallel types
    target_hit_rate: float


def embedding_tables(model: nn.Module) -> list[str]:
    """Names of all tables in the model's embedding collections."""
    return [t.name for t in table_configs(model)]


# Model-parallel types only, by default: a data-parallel table gets torchrec's DENSE kernel, whose
# full-table gradient is all-reduced by DDP and updated by the dense optimizer, not by the
# configured fused embedding optimizer; so it is opt-in (sharding.sharding_types).
MODEL_PARALLEL_TYPES = list(_MODEL_PARALLEL_TYPES)


def allowed_sharding_types(cfg: PlannerSettings) -> list[str]:
    return list(cfg.sharding_types) if cfg.sharding_types else list(MODEL_PARALLEL_TYPES)


def build_planner(
    cfg: PlannerSettings,
    model: nn.Module,
    world_size: int,
    local_world_size: int,
    compute_device: str,
    batch_size_per_rank: int,
    hbm_bytes: int | None = None,
    ddr_bytes: int | None = None,
    cache_stats: dict | None = None,
    target_hit_rate: float | None = None,
) -> EmbeddingShardingPlanner:
    """torchrec's planner on a uniform topology; hbm/ddr capacities per rank (torchrec's
    defaults when None). ``cfg.planner == "topology"``: the topology-aware planner
    (sharding/planner/topology_planner.py) on ``cfg.topology`` (default for CPU runs: ``cpu-gloo``).

    ``cache_stats``: table -> torchrec ``CacheStatistics`` (``sharding.cache_sizing``; the trainer's
    ``recsys.data.id_histogram.load_sample``):
    UVM-caching tables get the smallest load factor reaching ``target_hit_rate`` (default 0.95)
    and their measured miss rate is what the topology-aware cost model charges."""
    target = DEFAULT_TARGET_HIT_RATE if target_hit_rate is None else target_hit_rate
    if cfg.planner == "topology":
        cluster = cluster_for(cfg.topology, compute_device, world_size, local_world_size)
        return TopologyAwarePlanner(
            cluster,
            batch_size_per_rank,
            default_constraints(model, compute_device, allowed_sharding_types(cfg)),
            hbm_bytes=hbm_bytes,
            ddr_bytes=ddr_bytes,
            cache_stats=cache_stats,
            target_hit_rate=target,
        )
    hardware = HardwareConfig(
        **({"hbm_cap_bytes": hbm_bytes} if hbm_bytes is not None else {}),
        **({"ddr_cap_bytes": ddr_bytes} if ddr_bytes is not None else {}),
    )
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size, local_world_size=local_world_size),
        hardware_config=hardware,
        kernel_config=KernelConfig(compute_device=compute_device),
    )
    constraints = {name: ParameterConstraints(sharding_types=allowed_sharding_types(cfg)) for name in embedding_tables(model)}
    if cache_stats:
        apply_cache_stats(constraints, cache_stats, target)
    return StorageExplainingPlanner(topology=topology, batch_size=batch_size_per_rank, constraints=constraints)


class StorageExplainingPlanner(EmbeddingShardingPlanner):
    """torchrec's planner whose "insufficient storage" error is one line naming what the
    embeddings need, the shortfall and the largest tables (sharding/plan/fit_report.py)."""

    def __init__(self, topology: Topology, **kwargs) -> None:
        super().__init__(topology=topology, **kwargs)
        self.topology = topology

    def collective_plan(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]] | None = None, pg: dist.ProcessGroup | None = None
    ) -> ShardingPlan:
        from sharding.optimizer_state import check_cowclip_sharders

        check_cowclip_sharders(module, sharders)  # on every rank, before rank 0 plans and the others wait
        return super().collective_plan(module, sharders, pg)

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        from sharding.optimizer_state import check_cowclip_sharders

        check_cowclip_sharders(module, sharders)
        try:
            return super().plan(module, sharders)
        except PlannerError as e:
            if e.error_type != PlannerErrorType.INSUFFICIENT_STORAGE:
                raise
            from sharding.plan.fit_report import does_not_fit_message

            raise PlannerError(does_not_fit_message(module, self.topology, e), PlannerErrorType.INSUFFICIENT_STORAGE) from None


def make_plan(
    cfg: PlannerSettings,
    model: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    device: torch.device,
    local_world_size: int,
    batch_size_per_rank: int,
    pg: dist.ProcessGroup | None = None,
    cache_stats: dict | None = None,
) -> ShardingPlan:
    """Plans on rank 0 and broadcasts, so every rank shards identically."""
    world = dist.get_world_size(pg)
    planner = build_planner(
        cfg, model, world, local_world_size, device.type, batch_size_per_rank, cache_stats=cache_stats, target_hit_rate=cfg.target_hit_rate
    )
    return planner.collective_plan(model, sharders, pg or dist.GroupMember.WORLD)
