"""Rank-pair bandwidths from the path between two devices in a :class:`ClusterTopology`.

A path is a list of :class:`Link` s; its bandwidth is that of its bottleneck. Bandwidths are
bytes/s, one direction, nominal (from the topology file).

Two views:

- ``shared=True`` (default): every rank sends at once, as in the embedding all-to-all. A link used
  by ``k`` ranks' traffic gives each ``bw / k`` (a switch uplink: the ranks below the switch; the
  inter-socket link: the ranks of the busier socket; a NIC: the ranks that use it). The slowest,
  most shared link dominates.
- ``shared=False``: one pair alone on an idle machine; the slowest link dominates.

NVLink (per-GPU links through NVSwitch, or point-to-point links) and a device's own PCIe port are
not shared in either view: per-device egress limits are for the caller (the planner) to apply.

The rules, in order (``a``, ``b`` ranks; ``ga``, ``gb`` their devices):

1. ``a == b``: the device's memory bandwidth (HBM; DDR of its NUMA node for CPU ranks).
2. same host, NVLink between them: links x per-link bandwidth (NVSwitch: links per GPU x per link).
3. same host, same PCIe switch: the switch's ports (peer-to-peer through the switch).
4. same host, different switches: both ports and the uplinks of each side's switches up to the
   first switch they share (a leaf switch inside a parent switch), else up to the root complex;
   on different sockets also the inter-socket link.
5a. different hosts of one NVLink domain (``network.nvlink_domain_hosts`` > 1, e.g. GB200 NVL72):
   NVLink, each GPU's links x per-link bandwidth (the smaller side's), no NIC.
5. other different hosts: each side's path to its nearest NIC (rules 3-4 with the NIC as endpoint), both
   NICs, and the network's per-NIC bandwidth.

CPU ranks (``compute_device: cpu``) talk through shared memory: the DDR of each side's NUMA node,
the inter-socket link between sockets, and NICs between hosts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sharding.topology.cluster import ClusterTopology, Host, Nic


@dataclass(frozen=True)
class Link:
    name: str  # e.g. "host0/sw1.uplink", "host0/nvlink(0,3)"
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
    """The links between two ranks, following the rules in the module docstring."""
    (ha, ia), (hb, ib) = topo.locate(rank_a), topo.locate(rank_b)
    host_a, host_b = topo.hosts[ha], topo.hosts[hb]
    cpu = topo.compute_device == "cpu"
    if rank_a == rank_b:
        # rule 1: local memory
        g = host_a.gpus[ia]
        if cpu:
            return [_ddr(host_a, ha, g.numa)]
        return [Link(f"{host_a.name}/gpu{ia}.hbm", g.hbm_bw)]
    if ha == hb:
        if cpu:
            # CPU ranks on one host: shared memory on each side's NUMA node (+ the socket link)
            ga, gb = host_a.gpus[ia], host_a.gpus[ib]
            links = [_ddr(host_a, ha, ga.numa), _ddr(host_a, ha, gb.numa)]
            if ga.numa != gb.numa:
                links.append(_inter_socket(host_a, ga.numa, gb.numa))
            return _dedup(links)
        nv = host_a.nvlink.bandwidth(ia, ib)
        if nv > 0:
            # rule 2: NVLink (direct links or NVSwitch); PCIe is not used
            return [Link(f"{host_a.name}/nvlink({ia},{ib})", nv)]
        # rules 3-4: PCIe between the two GPUs
        return _pcie_path(host_a, _gpu_end(host_a, ia), _gpu_end(host_a, ib))
    if topo.same_nvlink_domain(rank_a, rank_b):
        # rule 5a: one NVLink domain across hosts (NVL72-style): each GPU's NVLink ports
        bw = min(host_a.nvlink.links_per_gpu * host_a.nvlink.link_bw, host_b.nvlink.links_per_gpu * host_b.nvlink.link_bw)
        return [Link(f"nvlink-domain({ha}:{ia},{hb}:{ib})", bw)]
    # rule 5: across hosts through each side's nearest NIC and the network
    nic_a, nic_b = nearest_nic(host_a, ia), nearest_nic(host_b, ib)
    if nic_a is None or nic_b is None:
        raise ValueError(f"{topo.source or topo.name}: a host without NICs in a multi-host topology")
    links = _to_nic(topo, host_a, ha, ia, nic_a) + _to_nic(topo, host_b, hb, ib, nic_b)
    if math.isfinite(topo.network.bw_per_nic):
        links.append(Link(f"network@{ha}", topo.network.bw_per_nic, _nic_users(host_a, nic_a)))
        links.append(Link(f"network@{hb}", topo.network.bw_per_nic, _nic_users(host_b, nic_b)))
    return _dedup(links)


def host_to_gpu_bandwidth(topo: ClusterTopology, rank: int, numa: int | None = None, *, shared: bool = True) -> float:
    """Bandwidth between a rank's device and host memory on NUMA node ``numa`` (default: its own),
    as UVM / DDR-offloaded embeddings see it: the GPU's port, its switch uplink, the inter-socket
    link when the memory is on the other socket, and the NUMA node's DDR bandwidth. For CPU ranks
    the device memory is DDR, so it is the DDR bandwidth (+ the socket link)."""
    h, i = topo.locate(rank)
    host = topo.hosts[h]
    g = host.gpus[i]
    numa = g.numa if numa is None else numa
    try:
        host.numa(numa)
    except KeyError:
        raise ValueError(f"host {host.name} has no NUMA node {numa}") from None
    links = [] if topo.compute_device == "cpu" else _up_to_socket(host, g.pcie_switch)
    if numa != g.numa:
        links.append(_inter_socket(host, g.numa, numa))
    links.append(_ddr(host, h, numa))
    return path_bandwidth(links, shared)


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


def nearest_nic(host: Host, local: int) -> Nic | None:
    """The NIC a device uses for inter-host traffic: one on its own PCIe switch if any, else one
    under the same top-level switch, else one on its socket, else any. Ties are spread: the k-th
    device among those choosing from the same candidates takes candidate k mod len (as NCCL pairs
    GPU i with NIC i on a DGX)."""
    if not host.nics:
        return None
    g = host.gpus[local]

    def top(switch: str | None) -> str | None:
        return None if switch is None else host.switch_chain(switch)[-1].name

    tiers = [
        (
            [n for n in host.nics if g.pcie_switch is not None and n.pcie_switch == g.pcie_switch],
            [x.index for x in host.gpus if x.pcie_switch == g.pcie_switch],
        ),
        (
            [n for n in host.nics if g.pcie_switch is not None and top(n.pcie_switch) == top(g.pcie_switch)],
            [x.index for x in host.gpus if top(x.pcie_switch) == top(g.pcie_switch)],
        ),
        ([n for n in host.nics if n.numa == g.numa], [x.index for x in host.gpus if x.numa == g.numa]),
        (list(host.nics), [x.index for x in host.gpus]),
    ]
    for candidates, peers in tiers:
        if candidates:
            return candidates[peers.index(local) % len(candidates)]
    return None  # unreachable


# --- helpers -----------------------------------------------------------------------------------


def _dedup(links: list[Link]) -> list[Link]:
    seen, out = set(), []
    for link in links:
        if link.name not in seen:
            seen.add(link.name)
            out.append(link)
    return out


def _ddr(host: Host, h: int, numa: int) -> Link:
    # a NUMA node's DDR, shared by the devices on it
    return Link(f"{host.name}/numa{numa}.ddr", host.numa(numa).ddr_bw, max(1, len(host.gpus_on_numa(numa))))


def _inter_socket(host: Host, a: int, b: int) -> Link:
    # the socket link, shared by the devices of the busier socket (one direction each)
    users = max(len(host.gpus_on_numa(a)), len(host.gpus_on_numa(b)), 1)
    return Link(f"{host.name}/inter_socket", host.inter_socket_bw, users)


def _up_to_socket(host: Host, switch: str | None, stop: str | None = None) -> list[Link]:
    # a device's own port, then the uplinks of its switch and those above it (each shared by the
    # GPUs below that switch), up to the root complex or to the switch ``stop``
    if switch is None:
        return []
    links = [Link(f"{host.name}/{switch}.port", host.switch(switch).port_bw)]
    for s in host.switch_chain(switch):
        if s.name == stop:
            break
        links.append(Link(f"{host.name}/{s.name}.uplink", s.uplink_bw, max(1, len(host.gpus_below(s.name)))))
    return links


def _gpu_end(host: Host, local: int) -> tuple[str, str | None, int]:
    g = host.gpus[local]
    return (f"gpu{local}", g.pcie_switch, g.numa)


def _pcie_path(host: Host, a: tuple[str, str | None, int], b: tuple[str, str | None, int]) -> list[Link]:
    """PCIe between two endpoints (name, switch, numa) on one host."""
    (na, sa, ma), (nb, sb, mb) = a, b
    if sa is not None and sa == sb:
        # rule 3: peer-to-peer inside one switch: each endpoint's own port, no uplink
        s = host.switch(sa)
        return [Link(f"{host.name}/{sa}.port.{na}", s.port_bw), Link(f"{host.name}/{sa}.port.{nb}", s.port_bw)]
    # rule 4: up through each switch to the first switch both sit below, else to the root
    # complex and across sockets if needed
    if sa is not None and sb is not None:
        above_b = {s.name for s in host.switch_chain(sb)}
        common = next((s.name for s in host.switch_chain(sa) if s.name in above_b), None)
        if common is not None:
            return _dedup(_up_to_socket(host, sa, common) + _up_to_socket(host, sb, common))
    links = _up_to_socket(host, sa) + _up_to_socket(host, sb)
    if ma != mb:
        links.append(_inter_socket(host, ma, mb))
    return _dedup(links)


_NIC_USERS: dict[int, tuple[Host, dict[str, int]]] = {}


def _nic_users(host: Host, nic: Nic) -> int:
    # how many devices of the host use this NIC (cached per Host object: hosts are immutable)
    hit = _NIC_USERS.get(id(host))
    if hit is None or hit[0] is not host:
        counts: dict[str, int] = {}
        for g in host.gpus:
            n = nearest_nic(host, g.index)
            if n is not None:
                counts[n.name] = counts.get(n.name, 0) + 1
        if len(_NIC_USERS) > 64:
            _NIC_USERS.clear()
        hit = _NIC_USERS[id(host)] = (host, counts)
    return max(1, hit[1].get(nic.name, 0))


def _to_nic(topo: ClusterTopology, host: Host, h: int, local: int, nic: Nic) -> list[Link]:
    """A device's path to its NIC, then the NIC (shared by the devices that use it)."""
    g = host.gpus[local]
    if topo.compute_device == "cpu":
        links = [_ddr(host, h, g.numa)]
        if nic.numa != g.numa:
            links.append(_inter_socket(host, g.numa, nic.numa))
        if nic.pcie_switch is not None:
            links += _up_to_socket(host, nic.pcie_switch)
    else:
        links = _pcie_path(host, _gpu_end(host, local), (nic.name, nic.pcie_switch, nic.numa))
    links.append(Link(f"{host.name}/{nic.name}", nic.bw, _nic_users(host, nic)))
    return [Link(f"{host.name}#{h}:{x.name}", x.bw, x.sharers) for x in links]
