"""Host groups for hierarchical (k-step merge) training; see docs/kstep.md.

The world is `hosts x ranks_per_host`, host-major: global rank g lives on host g // R with local
rank g % R (torchrun's numbering with one agent per node). Two families of process groups:

- `host_pg`: the R ranks of my host. Embeddings are sharded over it (DMP's ShardingEnv) and the
  dense parameters are data-parallel over it (DMP's DDP wrapper uses the same group).
- `replica_pg`: the H ranks that hold the same shard on every host (same local rank). The k-step
  merger averages over it; it is the only traffic that crosses hosts.

Every rank must create every group in the same order (torch.distributed's rule), which
`dist.new_subgroups_by_enumeration` does.

Host failure: a collective waiting for a dead peer fails when the peer's sockets close (a killed
process) or, when nothing tells the survivors (power loss, network partition), after the process
group timeout. torch's default for gloo is 30 minutes; `build_host_groups(hosts, timeout)` sets
the given timeout on the new groups and on the default group, so a host that dies between
merges stops the job within that bound (`pg_timeout_from_env`: RECSYS_PG_TIMEOUT_S, default
600 s). The timeout must exceed the longest time one host can spend without a collective that
the others wait on (an eval, a checkpoint write, k steps of training).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass
class HostGroups:
    hosts: int
    ranks_per_host: int
    host: int  # my host index
    local_rank: int  # my rank inside my host
    host_pg: dist.ProcessGroup
    replica_pg: dist.ProcessGroup

    @property
    def host_ranks(self) -> list[int]:
        return [self.host * self.ranks_per_host + r for r in range(self.ranks_per_host)]

    @property
    def replica_ranks(self) -> list[int]:
        return [h * self.ranks_per_host + self.local_rank for h in range(self.hosts)]


def resolve_hosts(configured: int) -> int:
    """The host count: `train.hosts` when > 1, else torchrun's GROUP_WORLD_SIZE (the number of
    agents = nodes with `--nnodes N`), else NNODES, else 1."""
    if configured > 1:
        return configured
    for var in ("GROUP_WORLD_SIZE", "NNODES"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    return 1


DEFAULT_PG_TIMEOUT_S = 600.0


def pg_timeout_from_env(default: float = DEFAULT_PG_TIMEOUT_S) -> timedelta:
    """The collective timeout for hierarchical runs: RECSYS_PG_TIMEOUT_S seconds (default 600)."""
    raw = os.environ.get("RECSYS_PG_TIMEOUT_S", "")
    try:
        seconds = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"RECSYS_PG_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"RECSYS_PG_TIMEOUT_S={raw!r} must be positive")
    return timedelta(seconds=seconds)


def build_host_groups(hosts: int, timeout: timedelta | None = None) -> HostGroups:
    """Creates host and replica groups on an initialised default process group. Collective:
    every rank must call it, with the same `hosts`. With `timeout`, the new groups and the default
    group time out collectives after it (a dead host stops the job instead of hanging it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if hosts <= 0 or world % hosts:
        raise ValueError(f"world size {world} is not divisible into {hosts} hosts")
    per_host = world // hosts
    host_lists = [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
    replica_lists = [list(range(r, world, per_host)) for r in range(per_host)]
    host_pg, _ = dist.new_subgroups_by_enumeration(host_lists, timeout=timeout)
    replica_pg, _ = dist.new_subgroups_by_enumeration(replica_lists, timeout=timeout)
    if timeout is not None:
        dist.distributed_c10d._set_pg_timeout(timeout)  # the default group: barriers, metrics
    return HostGroups(hosts, per_host, rank // per_host, rank % per_host, host_pg, replica_pg)


def remap_plan_to_host(plan: Any, groups: HostGroups, device_type: str) -> Any:
    """A copy of a plan made for ranks 0..R-1 with the shard placements moved to this host's
    global ranks (``sharding.planner.job_topology.remap_plan_to_host``; ``TopologyAwarePlanner(hosts=H)``
    does this itself in ``collective_plan``)."""
    from sharding.planner.job_topology import remap_plan_to_host as remap

    return remap(plan, groups.host, groups.ranks_per_host, device_type)
