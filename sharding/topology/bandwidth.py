"""Rank-pair bandwidths, derived from the one path model (``sharding/topology/paths.py``).

A pair's bandwidth is that of the bottleneck link of its route, bytes/s, one direction, nominal
(from the topology file). Two views:

- ``shared=True`` (default): every rank sends at once, as in the embedding all-to-all. A link used
  by ``k`` ranks' traffic gives each ``bw / k`` (``Hop.sharers``: a switch uplink the ranks below
  the switch, the inter-socket link the ranks of the busier socket, a NIC the ranks that use it).
  The slowest, most shared link dominates.
- ``shared=False``: one pair alone on an idle machine; the slowest link dominates.

NVLink and a device's own PCIe port are not shared in either view: per-device egress limits are
for the caller (the planner) to apply. A rank with itself is its device's memory bandwidth (HBM;
the DDR of its NUMA node for CPU ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sharding.topology.cluster import ClusterTopology
from sharding.topology.paths import Hop, host_label, host_memory_route, nearest_nic, route

__all__ = [
    "Link",
    "UplinkGroup",
    "bandwidth_matrix",
    "host_to_gpu_bandwidth",
    "nearest_nic",
    "pair_bandwidth",
    "pair_path",
    "path_bandwidth",
    "shared_uplink_groups",
]


@dataclass(frozen=True)
class Link:
    name: str  # the physical link, e.g. "host0#0/sw1.uplink", "host0#0/nvlink(0,3)"
    bw: float  # bytes/s, one direction, the whole link
    sharers: int = 1  # ranks whose traffic crosses it at once in the all-to-all view

    def share(self, shared: bool) -> float:
        return self.bw / self.sharers if shared else self.bw


@dataclass(frozen=True)
class UplinkGroup:
    """The ranks (and NICs) below one PCIe switch: they share its uplink to the root complex."""

    host: str
    switch: str
    numa: int
    uplink_bw: float
    ranks: tuple[int, ...]
    nics: tuple[str, ...]


def path_bandwidth(links: list[Link], shared: bool = True) -> float:
    return min((link.share(shared) for link in links), default=math.inf)


def pair_bandwidth(topo: ClusterTopology, rank_a: int, rank_b: int, *, shared: bool = True) -> float:
    """Bandwidth (bytes/s, one direction) from rank_a to rank_b: the bottleneck of their path."""
    return path_bandwidth(pair_path(topo, rank_a, rank_b), shared)


def bandwidth_matrix(topo: ClusterTopology, *, shared: bool = True) -> np.ndarray:
    """``[world, world]`` float64 matrix of :func:`pair_bandwidth` (symmetric; diagonal = memory bw)."""
    w = topo.world_size
    out = np.empty((w, w), dtype=np.float64)
    for a in range(w):
        out[a, a] = pair_bandwidth(topo, a, a, shared=shared)
        for b in range(a + 1, w):
            out[a, b] = out[b, a] = pair_bandwidth(topo, a, b, shared=shared)
    return out


def pair_path(topo: ClusterTopology, rank_a: int, rank_b: int) -> list[Link]:
    """The physical links between two ranks (``paths.route``, each link once); a rank with
    itself: its device's memory."""
    if rank_a == rank_b:
        h, i = topo.locate(rank_a)
        g = topo.hosts[h].gpus[i]
        if topo.compute_device == "cpu":
            return _links(host_memory_route(topo, rank_a, g.numa))
        return [Link(f"{host_label(topo, h)}/gpu{i}.hbm", g.hbm_bw)]
    return _links(route(topo, rank_a, rank_b))


def host_to_gpu_bandwidth(topo: ClusterTopology, rank: int, numa: int | None = None, *, shared: bool = True) -> float:
    """Bandwidth between a rank's device and host memory on NUMA node ``numa`` (default: its own),
    as UVM / DDR-offloaded embeddings see it: the GPU's port, its switches' uplinks, the
    inter-socket link when the memory is on the other socket, and the NUMA node's DDR. For CPU
    ranks the device memory is DDR, so it is the DDR bandwidth (+ the socket link)."""
    h, i = topo.locate(rank)
    host = topo.hosts[h]
    numa = host.gpus[i].numa if numa is None else numa
    try:
        host.numa(numa)
    except KeyError:
        raise ValueError(f"host {host.name} has no NUMA node {numa}") from None
    return path_bandwidth(_links(host_memory_route(topo, rank, numa)), shared)


def shared_uplink_groups(topo: ClusterTopology) -> list[UplinkGroup]:
    """One group per PCIe switch per host: the ranks (and NICs) whose traffic leaving the switch
    shares its uplink. Empty for CPU topologies."""
    out = []
    for h, host in enumerate(topo.hosts):
        for s in host.pcie_switches:
            below = [x for x in host.pcie_switches if s in host.switch_chain(x.name)]
            nics = tuple(n for x in below for n in x.nics)
            out.append(UplinkGroup(host.name, s.name, s.numa, s.uplink_bw, tuple(topo.rank(h, g) for g in host.gpus_below(s.name)), nics))
    return out


def _links(hops: list[Hop]) -> list[Link]:
    """Each physical link of a route once (a route may cross one both ways, e.g. a socket link)."""
    out: dict[str, Link] = {}
    for hop in hops:
        out.setdefault(hop.link, Link(hop.link, hop.bw, hop.sharers))
    return list(out.values())
