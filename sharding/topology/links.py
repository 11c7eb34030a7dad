"""Directed (full-duplex) links of a :class:`ClusterTopology` and the path of every rank pair.

A link carries bytes in each direction at once: a GPU's NVLink port sends 300 GB/s *and* receives
300 GB/s, a NIC sends and receives at line rate. So each physical link is two resources here
(``...>out`` / ``...>in``, ``up`` / ``down``), and the time a collective spends on the wire is that
of its busiest directed link: bytes on it / its bandwidth. Memory (a NUMA node's DDR, through
which CPU ranks exchange data) is one resource for both directions: reads and writes share it.

Which links a transfer crosses is ``sharding/topology/paths.py``'s ``route``, the one path model
(``bandwidth.py``'s rank-pair bandwidths are derived from it too). Unlike ``bandwidth.py``'s
``shared=True`` view, nothing is divided by a count of sharers here: the loads of all transfers
add up on the links they cross, which is where sharing shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sharding.topology.cluster import ClusterTopology
from sharding.topology.paths import route


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


def build_links(topo: ClusterTopology) -> LinkSet:
    """Every rank pair's directed path (``paths.route``), as indices into one list of links."""
    b = _Builder()
    w = topo.world_size
    loc = [topo.locate(r) for r in range(w)]
    path: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.int64)] * w for _ in range(w)]
    for a in range(w):
        for c in range(w):
            if c != a:
                p = [b.link(h.name, h.bw) for h in route(topo, a, c)]
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
