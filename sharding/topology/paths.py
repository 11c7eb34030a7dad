"""The path of a transfer between two ranks: the one model of which links it crosses.

``route(topo, a, b)`` lists the physical links a transfer from rank ``a`` to rank ``b`` crosses,
in the order it crosses them and in the direction it crosses each. Every view of the hardware is
derived from it: the directed, full-duplex links the cost model loads (``links.py``), the rank-pair
bandwidths of the "all ranks send at once" and "one pair alone" views (``bandwidth.py``), and the
link kinds and PCIe switches a plan's bytes go through (``sharding/planner/cost/traffic.py``).

The rules, in order (``a``, ``b`` ranks; ``ga``, ``gb`` their devices):

1. same host, CPU ranks: shared memory, the DDR of each side's NUMA node (+ the inter-socket link
   between sockets);
2. same host, NVLink between them: point-to-point links (``nvlink.pairs``) or each GPU's NVLink
   ports into an NVSwitch; PCIe is not used;
3. same host, same PCIe switch: peer-to-peer through the switch, each endpoint's own port;
4. same host, different switches: each endpoint's port and the uplinks of its switches up to the
   first switch both sit below (a leaf switch inside a parent switch), else up to the root
   complex, plus the inter-socket link when the sockets differ;
5. other host in the same NVLink domain (``network.nvlink_domain_hosts`` > 1, e.g. GB200 NVL72):
   each GPU's NVLink ports, no NIC;
6. other host: each side's path to its nearest NIC (rules 3-4 with the NIC as an endpoint; CPU
   ranks: DDR, the socket link, the NIC's switch), both NICs, and the fabric's port of each NIC
   (``network.bw_per_nic``).

Each link carries its bandwidth (bytes/s, one direction, nominal, from the topology file) and how
many ranks' traffic crosses it at once when every rank sends (``sharers``): a switch uplink the
devices below the switch, a NIC and its fabric port the devices that use that NIC, a NUMA node's
DDR the devices on it, the socket link the devices of the busier socket; ports and NVLink 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from sharding.topology.cluster import ClusterTopology, Host, Nic

HopKind = Literal["memory", "nvlink", "pcie_port", "pcie_uplink", "socket", "nic", "fabric"]


@dataclass(frozen=True)
class Hop:
    """One physical link of a route, in the direction the transfer crosses it."""

    name: str  # the directed link, unique in the cluster: "dgx-0#0/sw1.uplink>up"
    link: str  # the physical link (both directions): "dgx-0#0/sw1.uplink"
    kind: HopKind
    bw: float  # bytes/s, one direction
    sharers: int  # ranks whose traffic crosses it at once when every rank sends
    host: int  # the host index the link is on (a fabric port: its NIC's host)
    switch: str | None = None  # the PCIe switch of a port or uplink


def host_label(topo: ClusterTopology, h: int) -> str:
    """The prefix of host ``h``'s link names: its name and index (repeated hosts share a name)."""
    return f"{topo.hosts[h].name}#{h}"


def route(topo: ClusterTopology, a: int, b: int) -> list[Hop]:
    """The links a transfer ``a -> b`` crosses (the rules of the module docstring); [] for a == b."""
    if a == b:
        return []
    (ha, ia), (hb, ib) = topo.locate(a), topo.locate(b)
    host = topo.hosts[ha]
    if ha == hb:
        ga, gb = host.gpus[ia], host.gpus[ib]
        if topo.compute_device == "cpu":  # rule 1
            hops = [_ddr(topo, ha, ga.numa)]
            if ga.numa != gb.numa:
                hops += _socket(topo, ha, ga.numa, gb.numa) + [_ddr(topo, ha, gb.numa)]
            return hops
        nv = host.nvlink.bandwidth(ia, ib)
        if nv > 0:  # rule 2
            hn = host_label(topo, ha)
            if host.nvlink.kind == "pairs":
                pair = f"{hn}/nvlink({min(ia, ib)},{max(ia, ib)})"
                return [Hop(f"{hn}/nvlink{ia}>{ib}", pair, "nvlink", nv, 1, ha)]
            return [_nvlink_port(topo, ha, ia, "out", nv), _nvlink_port(topo, ha, ib, "in", nv)]
        return _pcie(topo, ha, _gpu_end(host, ia), _gpu_end(host, ib))  # rules 3-4
    if topo.same_nvlink_domain(a, b):  # rule 5
        hb_ = topo.hosts[hb]
        return [
            _nvlink_port(topo, ha, ia, "out", host.nvlink.links_per_gpu * host.nvlink.link_bw),
            _nvlink_port(topo, hb, ib, "in", hb_.nvlink.links_per_gpu * hb_.nvlink.link_bw),
        ]
    return nic_leg(topo, a, up=True) + nic_leg(topo, b, up=False)  # rule 6


_LEGS: dict[int, tuple[ClusterTopology, dict[tuple[int, bool], list[Hop]]]] = {}


def nic_leg(topo: ClusterTopology, rank: int, *, up: bool) -> list[Hop]:
    """A rank's path to (``up``) or from its nearest NIC, the NIC and its fabric port included
    (cached per topology object: every cross-host pair of a rank starts or ends with it)."""
    hit = _LEGS.get(id(topo))
    if hit is None or hit[0] is not topo:
        if len(_LEGS) > 16:
            _LEGS.clear()
        hit = _LEGS[id(topo)] = (topo, {})
    legs = hit[1]
    if (rank, up) not in legs:
        legs[(rank, up)] = _nic_leg(topo, rank, up)
    return list(legs[(rank, up)])


def _nic_leg(topo: ClusterTopology, rank: int, up: bool) -> list[Hop]:
    h, local = topo.locate(rank)
    host = topo.hosts[h]
    nic = nearest_nic(host, local)
    if nic is None:
        raise ValueError(f"{topo.source or topo.name}: a host without NICs in a multi-host topology")
    g = host.gpus[local]
    nic_end = (nic.name, nic.pcie_switch, nic.numa)
    if topo.compute_device == "cpu":  # memory, the socket link, then down the NIC's switches
        to_nic = [_ddr(topo, h, g.numa)] + (_socket(topo, h, g.numa, nic.numa) if nic.numa != g.numa else [])
        to_nic += _down_from_root(topo, h, nic_end)
        path = to_nic if up else _reverse(topo, h, to_nic)
    else:
        gpu_end = _gpu_end(host, local)
        path = _pcie(topo, h, gpu_end, nic_end) if up else _pcie(topo, h, nic_end, gpu_end)
    hn, direction, users = host_label(topo, h), "out" if up else "in", nic_users(host, nic)
    nic_hop = Hop(f"{hn}/{nic.name}>{direction}", f"{hn}/{nic.name}", "nic", nic.bw, users, h)
    fabric = []
    if math.isfinite(topo.network.bw_per_nic):
        port = f"network/{hn}/{nic.name}"
        fabric = [Hop(f"{port}>{direction}", port, "fabric", topo.network.bw_per_nic, users, h)]
    return path + [nic_hop] + fabric if up else fabric + [nic_hop] + path


def host_memory_route(topo: ClusterTopology, rank: int, numa: int) -> list[Hop]:
    """From host memory on NUMA node ``numa`` to a rank's device, as UVM-offloaded embeddings
    read it: up the device's switches to the root complex (none for CPU ranks), the socket link
    when the memory is on the other socket, and the node's DDR."""
    h, local = topo.locate(rank)
    host = topo.hosts[h]
    g = host.gpus[local]
    hops = [] if topo.compute_device == "cpu" else _up(topo, h, _gpu_end(host, local), None, "up")
    if numa != g.numa:
        hops += _socket(topo, h, g.numa, numa)
    return hops + [_ddr(topo, h, numa)]


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


_NIC_USERS: dict[int, tuple[Host, dict[str, int]]] = {}


def nic_users(host: Host, nic: Nic) -> int:
    """How many devices of the host use this NIC (cached per Host object: hosts are immutable)."""
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


# --- the links -----------------------------------------------------------------------------------

Endpoint = tuple[str, "str | None", int]  # (name, PCIe switch or None, NUMA node)


def _gpu_end(host: Host, local: int) -> Endpoint:
    g = host.gpus[local]
    return (f"gpu{local}", g.pcie_switch, g.numa)


def _nvlink_port(topo: ClusterTopology, h: int, local: int, direction: str, bw: float) -> Hop:
    link = f"{host_label(topo, h)}/gpu{local}.nvlink"
    return Hop(f"{link}>{direction}", link, "nvlink", bw, 1, h)


def _ddr(topo: ClusterTopology, h: int, numa: int) -> Hop:
    """A NUMA node's DDR: one resource for both directions (reads and writes share it)."""
    host = topo.hosts[h]
    link = f"{host_label(topo, h)}/numa{numa}.ddr"
    return Hop(link, link, "memory", host.numa(numa).ddr_bw, max(1, len(host.gpus_on_numa(numa))), h)


def _socket(topo: ClusterTopology, h: int, src: int, dst: int) -> list[Hop]:
    """The inter-socket link from socket ``src`` to ``dst`` (none when unlimited)."""
    host = topo.hosts[h]
    if not math.isfinite(host.inter_socket_bw):
        return []
    hn = host_label(topo, h)
    users = max(len(host.gpus_on_numa(src)), len(host.gpus_on_numa(dst)), 1)
    return [Hop(f"{hn}/socket{src}>{dst}", f"{hn}/inter_socket", "socket", host.inter_socket_bw, users, h)]


def _port(topo: ClusterTopology, h: int, switch: str, endpoint: str, direction: str) -> Hop:
    link = f"{host_label(topo, h)}/{switch}.port.{endpoint}"
    return Hop(f"{link}>{direction}", link, "pcie_port", topo.hosts[h].switch(switch).port_bw, 1, h, switch)


def _uplink(topo: ClusterTopology, h: int, switch: str, direction: str) -> Hop:
    host = topo.hosts[h]
    link = f"{host_label(topo, h)}/{switch}.uplink"
    sharers = max(1, len(host.gpus_below(switch)))
    return Hop(f"{link}>{direction}", link, "pcie_uplink", host.switch(switch).uplink_bw, sharers, h, switch)


def _up(topo: ClusterTopology, h: int, end: Endpoint, stop: str | None, direction: str) -> list[Hop]:
    """An endpoint's port, then the uplinks of its switch and those above it, up to the root
    complex or to the switch ``stop``; in the order up (reverse it for the way down)."""
    name, switch, _ = end
    if switch is None:
        return []
    hops = [_port(topo, h, switch, name, direction)]
    for s in topo.hosts[h].switch_chain(switch):
        if s.name == stop:
            break
        hops.append(_uplink(topo, h, s.name, direction))
    return hops


def _down_from_root(topo: ClusterTopology, h: int, end: Endpoint) -> list[Hop]:
    return _up(topo, h, end, None, "down")[::-1]


def _pcie(topo: ClusterTopology, h: int, a: Endpoint, b: Endpoint) -> list[Hop]:
    """PCIe from endpoint ``a`` to endpoint ``b`` on one host (rules 3-4), directed."""
    (_, sa, ma), (_, sb, mb) = a, b
    host = topo.hosts[h]
    if sa is not None and sa == sb:  # rule 3: each endpoint's own port, no uplink
        return [_port(topo, h, sa, a[0], "up"), _port(topo, h, sb, b[0], "down")]
    common = None
    if sa is not None and sb is not None:
        above_b = {s.name for s in host.switch_chain(sb)}
        common = next((s.name for s in host.switch_chain(sa) if s.name in above_b), None)
    up = _up(topo, h, a, common, "up")
    down = _up(topo, h, b, common, "down")[::-1]
    across = _socket(topo, h, ma, mb) if common is None and ma != mb else []
    return up + across + down


def _reverse(topo: ClusterTopology, h: int, hops: list[Hop]) -> list[Hop]:
    """The same links crossed the other way (a CPU rank's way back from its NIC)."""
    out = []
    for hop in reversed(hops):
        if hop.kind == "socket":
            src, dst = hop.name.rsplit("/socket", 1)[1].split(">")
            out += _socket(topo, h, int(dst), int(src))
        elif hop.kind in ("pcie_port", "pcie_uplink"):
            flipped = "up" if hop.name.endswith(">down") else "down"
            out.append(Hop(f"{hop.link}>{flipped}", hop.link, hop.kind, hop.bw, hop.sharers, hop.host, hop.switch))
        else:
            out.append(hop)
    return out
