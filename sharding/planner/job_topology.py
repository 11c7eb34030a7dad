"""The cluster a plan is for and torchrec's view of it: the topology a training run plans on
(``cluster_for``: a file or shipped name, CPU topologies resized to the run), one host of it for
k-step replicas (``cluster_to_plan``), torchrec's ``Topology`` with capacities and bandwidths from
the path model (``torchrec_topology``), and a one-host plan moved onto another host's ranks
(``remap_plan_to_host``)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ShardingPlan

from sharding.topology.bandwidth import host_to_gpu_bandwidth
from sharding.compat import keep_zero_capacities
from sharding.topology.cluster import ClusterTopology
from sharding.topology.topology_file import load_topology


def torchrec_topology(topo: ClusterTopology, hbm_bytes: int | None = None, ddr_bytes: int | None = None) -> Topology:
    """A torchrec ``Topology`` for the cluster: capacities per rank (host memory and SSD are the
    host's divided by its ranks, the smallest host's), bandwidths (bytes/ms, as torchrec wants)
    from the path model; ``ssd_mem_bw`` is a host's SSD read bandwidth per rank. Without an SSD
    tier on every host ``ssd_cap`` is 0 (torchrec's default would be 2 TB per rank), so torchrec
    offers no key_value option either."""
    from sharding.topology.bandwidth import bandwidth_matrix

    cpu = topo.compute_device == "cpu"
    w, lw = topo.world_size, topo.local_world_size
    bw = bandwidth_matrix(topo, shared=False)
    same = np.equal.outer(np.arange(w) // lw, np.arange(w) // lw)
    off = ~np.eye(w, dtype=bool)
    intra = float(bw[same & off].min()) if (same & off).any() else None
    inter = float(bw[~same].min()) if (~same).any() else None
    ddr = min(h.ddr_bytes for h in topo.hosts) // lw
    hbm = None if cpu else min(g.hbm_bytes for h in topo.hosts for g in h.gpus)
    ssd = min(h.ssd_bytes for h in topo.hosts) // lw
    ssd_bw = min(h.ssd.read_bw for h in topo.hosts) / lw if ssd else None
    hardware = HardwareConfig(
        hbm_cap_bytes=hbm_bytes if hbm_bytes is not None else hbm,
        ddr_cap_bytes=ddr_bytes if ddr_bytes is not None else ddr,
        ssd_cap_bytes=ssd,
        ssd_mem_bw=None if ssd_bw is None else ssd_bw / 1e3,
        intra_host_bw=None if intra is None else intra / 1e3,
        inter_host_bw=None if inter is None else inter / 1e3,
        hbm_mem_bw=None if cpu else min(g.hbm_bw for h in topo.hosts for g in h.gpus) / 1e3,
        ddr_mem_bw=min(n.ddr_bw for h in topo.hosts for n in h.numa_nodes) / 1e3,
        hbm_to_ddr_mem_bw=None if cpu else min(host_to_gpu_bandwidth(topo, r) for r in range(w)) / 1e3,
    )
    topology = TopologyFactory.create_topology(
        # pod_size: torchrec then cuts table-row-wise tables over an NVLink domain's ranks, as our
        # partitioner and cost model place them (cost_model.twrw_groups)
        trainer_config=TrainerConfig(
            world_size=w, local_world_size=lw, pod_size=topo.network.nvlink_domain_hosts if topo.network.nvlink_domain_hosts > 1 else None
        ),
        hardware_config=hardware,
        kernel_config=KernelConfig(compute_device=topo.compute_device, use_hardware_based_bandwidth=True),
    )
    return keep_zero_capacities(topology, hardware.hbm_cap_bytes, hardware.ddr_cap_bytes, ssd)


def remap_plan_to_host(plan: ShardingPlan, host: int, ranks_per_host: int, device_type: str) -> ShardingPlan:
    """A copy of a plan made for ranks 0..R-1 with the shard placements moved to ``host``'s
    global ranks (ShardedTensor placements name global ranks, even on a subgroup); ``ranks`` stay
    host-local because the sharders index per-rank lists of the group with them (DMPCollection
    remaps both and translates back with ShardingEnv2D.remap_rank, which is CUDA-only)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torch.distributed.remote_device import _remote_device

    plan = copy.deepcopy(plan)
    offset = host * ranks_per_host
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            spec = ps.sharding_spec
            if isinstance(spec, EnumerableShardingSpec) and spec.shards:
                for shard in spec.shards:
                    r = shard.placement.rank() + offset
                    dev = "cpu" if device_type == "cpu" else f"{device_type}:{r % ranks_per_host}"
                    shard.placement = _remote_device(f"rank:{r}/{dev}")
    return plan


def cluster_to_plan(cluster: ClusterTopology, hosts: int, world_size: int | None, from_job: bool) -> ClusterTopology:
    """The cluster one plan is for: with ``hosts`` > 1 (k-step replicas) one host of it; a CPU
    topology with one host resized to ``world_size`` ranks (if None and ``from_job``: the
    initialised process group's world size / ``hosts``)."""
    if hosts > 1 and len(cluster.hosts) > 1:
        if len(cluster.hosts) != hosts:
            raise ValueError(f"topology {cluster.name or cluster.source}: {len(cluster.hosts)} hosts, the planner was given hosts={hosts}")
        cluster = dataclasses.replace(cluster, hosts=cluster.hosts[:1], name=f"{cluster.name}-1host")
    if world_size is None and from_job:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size() // hosts
    if world_size is not None and cluster.compute_device == "cpu" and len(cluster.hosts) == 1 and world_size != cluster.world_size:
        cluster = cpu_topology_like(cluster, world_size)
    return cluster


def cpu_topology_like(template: ClusterTopology, world_size: int) -> ClusterTopology:
    """A single-host CPU topology with ``world_size`` ranks, from a CPU template's first host."""
    h = template.hosts[0]
    g0 = h.gpus[0]
    gpus = tuple(dataclasses.replace(g0, index=i) for i in range(world_size))
    return dataclasses.replace(template, hosts=(dataclasses.replace(h, gpus=gpus),), name=f"{template.name}-{world_size}")


def cluster_for(topology: str, compute_device: str, world_size: int, local_world_size: int) -> ClusterTopology:
    """The cluster a training run plans for: ``topology`` (a file or shipped name), or the shipped
    ``cpu-gloo`` one for CPU runs. CPU topologies are resized to the run's world size."""
    name = topology or ("cpu-gloo" if compute_device == "cpu" else "")
    if not name:
        raise ValueError("sharding.planner=topology on cuda needs sharding.topology (a topology file or shipped name)")
    cluster = load_topology(name)
    if cluster.compute_device != compute_device:
        raise ValueError(f"topology {name} is for {cluster.compute_device}, the run is on {compute_device}")
    if cluster.world_size != world_size:
        if compute_device == "cpu" and world_size == local_world_size:
            return cpu_topology_like(cluster, world_size)
        raise ValueError(
            f"topology {name} has {cluster.world_size} ranks ({cluster.local_world_size} per host), "
            f"the run has {world_size} ({local_world_size} per host)"
        )
    return cluster
