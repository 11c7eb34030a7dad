"""Directed (full-duplex) links of a :class:`ClusterTopology` and the path of every rank pair.

A link carries bytes in each direction at once: a GPU's NVLink port sends 300 GB/s *and* receives
300 GB/s, a NIC sends and receives at line rate. So each physical link is two resources here
(``...>out`` / ``...>in``, ``up`` / ``down``), and the time a collective spends on the wire is that
of its busiest directed link: bytes on it / its bandwidth. Memory (a NUMA node's DDR, through
which CPU ranks exchange data) is one resource for both directions: reads and writes share it.

The path of a transfer ``a -> b`` (the rules of ``sharding/topology/bandwidth.py``, with direction):

- same host, NVSwitch or an NVLink island: ``a``'s NVLink egress, ``b``'s NVLink ingress (each
  GPU's links to the switch: ``links_per_gpu x link_bw`` per direction);
- same host, point-to-point NVLink (``pairs``): the link ``a>b``;
- same host, PCIe: ``a``'s switch port up; if the switches differ, ``a``'s switch uplink up, the
  inter-socket link in the direction ``numa(a) > numa(b)`` if the sockets differ, ``b``'s switch
  uplink down; ``b``'s port down;
- other host in the same NVLink domain (``network.nvlink_domain_hosts``, e.g. an NVL72 rack):
  ``a``'s NVLink egress, ``b``'s NVLink ingress, as inside an NVSwitch host;
- other host: to ``a``'s NIC the same way (PCIe, the NIC is the far endpoint), the NIC's send side,
  the fabric's port of that NIC (``network.bw_per_nic``) out, the far NIC's fabric port in, the
  far NIC's receive side, down to ``b``;
- CPU ranks: the DDR of each side's NUMA node (+ the socket link between them, directed), NICs
  between hosts.

Unlike ``bandwidth.py``'s ``shared=True`` view, nothing is divided by a count of sharers: the
loads of all transfers add up on the links they cross, which is where sharing shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sharding.topology.bandwidth import nearest_nic
from sharding.topology.cluster import ClusterTopology, Host


@dataclass
class LinkSet:
    """Directed links (``names``, ``bw`` in bytes/s) and, for every ordered rank pair, the links
    its transfer crosses (``path[a][b]``, an index array; empty for ``a == b``).

    ``out_inv[a]`` = sum over peers ``b != a`` of ``1/bw`` on the links of ``a -> b`` (seconds per
    byte sent to *every* peer), ``in_inv[b]`` the same for the transfers into ``b``: the load an
    all-to-all owner adds to each link per byte per peer. ``edge_weight``: how many transfers'
    first or last hop each link is (see ``edge_links``), for the lower bound."""

    names: list[str]
    bw: np.ndarray
    path: list[list[np.ndarray]]
    out_inv: np.ndarray  # [world, links]
    in_inv: np.ndarray  # [world, links]
    first_hop: np.ndarray  # [world, world] link index of a -> b's first hop (-1 on the diagonal)
    last_hop: np.ndarray  # [world, world]
    out_off_inv: np.ndarray  # [world, links]: out_inv over the peers outside its NVLink domain (host) only
    in_off_inv: np.ndarray  # [world, links]
    inv_bw: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.inv_bw = 1.0 / self.bw

    @property
    def count(self) -> int:
        return len(self.names)

    def pair_inv(self, a: int, b: int) -> np.ndarray:
        """Seconds per byte on each link for one byte sent a -> b (dense, [links])."""
        v = np.zeros(self.count)
        idx = self.path[a][b]
        v[idx] = self.inv_bw[idx]
        return v

    def edge_links(self) -> np.ndarray:
        """Multiplicity of each link among the first and last hops of all rank pairs' paths (a
        link that is the first hop of one path and the last of another counts once per role)."""
        mult = np.zeros(self.count)
        for arr in (self.first_hop, self.last_hop):
            mult[np.unique(arr[arr >= 0])] += 1
        return mult


class _Builder:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.bw: list[float] = []
        self.index: dict[str, int] = {}

    def link(self, name: str, bw: float) -> int:
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.names)
            self.names.append(name)
            self.bw.append(float(bw))
        return i


def _pcie(b: _Builder, hn: str, host: Host, a_end: tuple[str, str | None, int], b_end: tuple[str, str | None, int]) -> list[int]:
    """PCIe from endpoint a to endpoint b (name, switch, numa) on one host, directed."""
    (na, sa, ma), (nb, sb, mb) = a_end, b_end
    out = []
    if sa is not None:
        out.append(b.link(f"{hn}/{sa}.port.{na}>up", host.switch(sa).port_bw))
    if sa is None or sa != sb:
        if sa is not None:
            out.append(b.link(f"{hn}/{sa}.uplink>up", host.switch(sa).uplink_bw))
        if ma != mb and math.isfinite(host.inter_socket_bw):
            out.append(b.link(f"{hn}/socket{ma}>{mb}", host.inter_socket_bw))
        if sb is not None:
            out.append(b.link(f"{hn}/{sb}.uplink>down", host.switch(sb).uplink_bw))
    if sb is not None:
        out.append(b.link(f"{hn}/{sb}.port.{nb}>down", host.switch(sb).port_bw))
    return out


def _ddr(b: _Builder, hn: str, host: Host, numa: int) -> int:
    return b.link(f"{hn}/numa{numa}.ddr", host.numa(numa).ddr_bw)


def _to_nic(b: _Builder, topo: ClusterTopology, hn: str, host: Host, local: int, nic, up: bool) -> list[int]:
    """A rank's path to (``up``) or from its NIC, NIC included, directed."""
    g = host.gpus[local]
    nic_end = (nic.name, nic.pcie_switch, nic.numa)
    if topo.compute_device == "cpu":
        mem = [_ddr(b, hn, host, g.numa)]
        if up:
            path = mem + (
                [b.link(f"{hn}/socket{g.numa}>{nic.numa}", host.inter_socket_bw)]
                if nic.numa != g.numa and math.isfinite(host.inter_socket_bw)
                else []
            )
            if nic.pcie_switch is not None:
                s = host.switch(nic.pcie_switch)
                path += [b.link(f"{hn}/{s.name}.uplink>down", s.uplink_bw), b.link(f"{hn}/{s.name}.port.{nic.name}>down", s.port_bw)]
        else:
            path = []
            if nic.pcie_switch is not None:
                s = host.switch(nic.pcie_switch)
                path += [b.link(f"{hn}/{s.name}.port.{nic.name}>up", s.port_bw), b.link(f"{hn}/{s.name}.uplink>up", s.uplink_bw)]
            path += (
                [b.link(f"{hn}/socket{nic.numa}>{g.numa}", host.inter_socket_bw)]
                if nic.numa != g.numa and math.isfinite(host.inter_socket_bw)
                else []
            ) + mem
    else:
        gpu_end = (f"gpu{local}", g.pcie_switch, g.numa)
        path = _pcie(b, hn, host, gpu_end, nic_end) if up else _pcie(b, hn, host, nic_end, gpu_end)
    nic_link = b.link(f"{hn}/{nic.name}>{'out' if up else 'in'}", nic.bw)
    fabric = []
    if math.isfinite(topo.network.bw_per_nic):
        fabric = [b.link(f"network/{hn}/{nic.name}>{'out' if up else 'in'}", topo.network.bw_per_nic)]
    return path + [nic_link] + fabric if up else fabric + [nic_link] + path


def build_links(topo: ClusterTopology) -> LinkSet:
    """Every rank pair's directed path (see the module docstring)."""
    b = _Builder()
    w = topo.world_size
    cpu = topo.compute_device == "cpu"
    loc = [topo.locate(r) for r in range(w)]
    hname = [f"{h.name}#{i}" for i, h in enumerate(topo.hosts)]
    up_cache: dict[int, list[int]] = {}
    down_cache: dict[int, list[int]] = {}

    def nic_path(r: int, up: bool) -> list[int]:
        cache = up_cache if up else down_cache
        hit = cache.get(r)
        if hit is None:
            h, i = loc[r]
            host = topo.hosts[h]
            nic = nearest_nic(host, i)
            if nic is None:
                raise ValueError(f"{topo.source or topo.name}: a host without NICs in a multi-host topology")
            hit = cache[r] = _to_nic(b, topo, hname[h], host, i, nic, up)
        return hit

    path: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.int64)] * w for _ in range(w)]
    for a in range(w):
        ha, ia = loc[a]
        host = topo.hosts[ha]
        hn = hname[ha]
        for c in range(w):
            if c == a:
                continue
            hc, ic = loc[c]
            if ha == hc:
                ga, gc = host.gpus[ia], host.gpus[ic]
                if cpu:
                    p = [_ddr(b, hn, host, ga.numa)]
                    if ga.numa != gc.numa:
                        if math.isfinite(host.inter_socket_bw):
                            p.append(b.link(f"{hn}/socket{ga.numa}>{gc.numa}", host.inter_socket_bw))
                        p.append(_ddr(b, hn, host, gc.numa))
                elif host.nvlink.bandwidth(ia, ic) > 0:
                    nv = host.nvlink.bandwidth(ia, ic)
                    if host.nvlink.kind == "pairs":
                        p = [b.link(f"{hn}/nvlink{ia}>{ic}", nv)]
                    else:
                        p = [b.link(f"{hn}/gpu{ia}.nvlink>out", nv), b.link(f"{hn}/gpu{ic}.nvlink>in", nv)]
                else:
                    p = _pcie(b, hn, host, (f"gpu{ia}", ga.pcie_switch, ga.numa), (f"gpu{ic}", gc.pcie_switch, gc.numa))
            elif topo.same_nvlink_domain(a, c):  # one NVLink domain across hosts: GPU ports, no NIC
                hostc = topo.hosts[hc]
                p = [
                    b.link(f"{hn}/gpu{ia}.nvlink>out", host.nvlink.links_per_gpu * host.nvlink.link_bw),
                    b.link(f"{hname[hc]}/gpu{ic}.nvlink>in", hostc.nvlink.links_per_gpu * hostc.nvlink.link_bw),
                ]
            else:
                p = nic_path(a, True) + nic_path(c, False)
            path[a][c] = np.asarray(list(dict.fromkeys(p)), dtype=np.int64)
    if not b.names:  # one rank: no transfers; one idle link keeps every load vector non-empty
        b.link("none", math.inf)
    bw = np.asarray(b.bw, dtype=np.float64)
    inv = 1.0 / bw
    k = len(bw)
    out_inv = np.zeros((w, k))
    in_inv = np.zeros((w, k))
    out_off = np.zeros((w, k))
    in_off = np.zeros((w, k))
    first = np.full((w, w), -1, dtype=np.int64)
    last = np.full((w, w), -1, dtype=np.int64)
    for a in range(w):
        for c in range(w):
            idx = path[a][c]
            if not len(idx):
                continue
            out_inv[a, idx] += inv[idx]
            in_inv[c, idx] += inv[idx]
            if topo.nvlink_domain(loc[a][0]) != topo.nvlink_domain(loc[c][0]):
                out_off[a, idx] += inv[idx]
                in_off[c, idx] += inv[idx]
            first[a, c], last[a, c] = idx[0], idx[-1]
    return LinkSet(b.names, bw, path, out_inv, in_inv, first, last, out_off, in_off)
