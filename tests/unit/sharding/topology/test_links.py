"""Directed links and every rank pair's path over them (sharding/topology/links.py): the cost
model's view of the path model, each physical link two resources."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from sharding.topology.bandwidth import bandwidth_matrix
from sharding.topology.cluster import ClusterTopology, Gpu, Host, Network, Nic, NumaNode, NvlinkSpec, PcieSwitch
from sharding.topology.links import build_links
from sharding.topology.topology_dump import dump_topology
from sharding.topology.topology_file import load_topology

GBs = 1e9


def load_topology_text(text: str, name: str):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"{name}.yaml"
        p.write_text(text)
        return load_topology(p)


def test_nvlink_domain_across_hosts_gb200_nvl72():
    """GB200 NVL72: 18 trays in one NVLink domain. Every pair, across trays too, is NVLink at
    900 GB/s per direction and crosses no NIC; the same trays as two racks (two domains of 9)
    go through the NICs between racks; torchrec's Topology gets pod_size = 18."""
    from sharding.planner.job_topology import torchrec_topology

    t = load_topology("gb200-nvl72")
    assert t.network.nvlink_domain_hosts == 18 and t.same_nvlink_domain(0, 71) and not t.same_nvlink_domain(0, 3)
    m = bandwidth_matrix(t)
    assert np.allclose(m[~np.eye(72, dtype=bool)], 900 * GBs)
    links = build_links(t)
    cross = [links.names[i] for i in links.path[0][70]]  # tray 0 GPU 0 -> tray 17 GPU 2
    assert cross == ["gb200-tray-0#0/gpu0.nvlink>out", "gb200-tray-17#17/gpu2.nvlink>in"]
    assert torchrec_topology(t)._pod_size == 18  # torchrec's name for it
    two_racks = load_topology_text(dump_topology(t).replace("nvlink_domain_hosts: 18", "nvlink_domain_hosts: 9"), "x")
    assert two_racks.same_nvlink_domain(0, 35) and not two_racks.same_nvlink_domain(0, 36)
    between = build_links(two_racks)
    names = [between.names[i] for i in between.path[0][36]]  # tray 0 -> tray 9: other rack
    assert any(">out" in n and "cx7_0" in n for n in names) and not any("nvlink" in n for n in names)
    assert bandwidth_matrix(two_racks)[0, 36] == pytest.approx(50 * GBs)  # 400 Gb/s NICs


# --- small clusters, worked by hand -------------------------------------------------------------


def _switch_host(name: str, n: int, nvlink: NvlinkSpec | None = None, nic: bool = False) -> Host:
    """``n`` GPUs on one switch with 25 GB/s ports (and a 50 GB/s NIC on it)."""
    nics = (Nic("n0", 50 * GBs, "sw", 0),) if nic else ()
    sw = PcieSwitch("sw", 0, 25 * GBs, 25 * GBs, tuple(range(n)), tuple(x.name for x in nics))
    gpus = tuple(Gpu(i, 2**30, 1e12, "sw", 0) for i in range(n))
    return Host(name, gpus, nvlink or NvlinkSpec(), (sw,), (NumaNode(0, 2**30, 1e11),), float("inf"), nics)


def test_three_gpus_on_a_switch():
    """Each port is two links (up, down); a rank's loads add up over its peers."""
    ls = build_links(ClusterTopology((_switch_host("h", 3),)))
    assert ls.names == [
        "h#0/sw.port.gpu0>up", "h#0/sw.port.gpu1>down", "h#0/sw.port.gpu2>down",
        "h#0/sw.port.gpu1>up", "h#0/sw.port.gpu0>down", "h#0/sw.port.gpu2>up",
    ]  # fmt: skip
    assert ls.count == 6 and np.array_equal(ls.bw, np.full(6, 25 * GBs))
    assert [list(ls.path[0][c]) for c in range(3)] == [[], [0, 1], [0, 2]]
    assert list(ls.path[2][1]) == [5, 1]
    inv = 1 / (25 * GBs)
    assert np.allclose(ls.out_inv[0], np.array([2, 1, 1, 0, 0, 0]) * inv)  # its up port carries both peers' bytes
    assert np.allclose(ls.in_inv[0], np.array([0, 0, 0, 1, 2, 1]) * inv)
    assert np.allclose(ls.pair_inv(2, 1), np.array([0, 1, 0, 0, 0, 1]) * inv)
    assert np.array_equal(ls.first_hop, [[-1, 0, 0], [3, -1, 3], [5, 5, -1]])
    assert np.array_equal(ls.last_hop, [[-1, 1, 2], [4, -1, 2], [4, 1, -1]])
    assert np.array_equal(ls.edge_links(), np.ones(6))  # each link is a first hop or a last hop, not both
    assert not ls.out_off_inv.any() and not ls.in_off_inv.any()  # one host: every peer is inside it


def test_a_point_to_point_nvlink_is_first_and_last_hop():
    ls = build_links(ClusterTopology((_switch_host("h", 2, NvlinkSpec("pairs", 25 * GBs, pairs=((0, 1, 2),))),)))
    assert ls.names == ["h#0/nvlink0>1", "h#0/nvlink1>0"] and np.array_equal(ls.bw, [50 * GBs, 50 * GBs])
    assert np.array_equal(ls.edge_links(), [2, 2])


def test_off_domain_loads_count_only_peers_on_other_hosts():
    """Two one-GPU hosts: through the NICs the whole load is off the host; in one NVLink domain
    the two GPUs' NVLink ports carry it and nothing is off the domain."""
    nvs = NvlinkSpec("nvswitch", 25 * GBs, 2)
    hosts = (_switch_host("a", 1, nvs, nic=True), _switch_host("b", 1, nvs, nic=True))
    apart = build_links(ClusterTopology(hosts))
    assert [apart.names[i] for i in apart.path[0][1]] == [
        "a#0/sw.port.gpu0>up", "a#0/sw.port.n0>down", "a#0/n0>out", "b#1/n0>in", "b#1/sw.port.n0>up", "b#1/sw.port.gpu0>down",
    ]  # fmt: skip
    assert np.array_equal(apart.out_off_inv, apart.out_inv) and np.array_equal(apart.in_off_inv, apart.in_inv)
    one = build_links(ClusterTopology(hosts, Network(nvlink_domain_hosts=2)))
    assert one.names == ["a#0/gpu0.nvlink>out", "b#1/gpu0.nvlink>in", "b#1/gpu0.nvlink>out", "a#0/gpu0.nvlink>in"]
    assert np.allclose(one.out_inv[0], [1 / (50 * GBs), 1 / (50 * GBs), 0, 0])
    assert not one.out_off_inv.any() and not one.in_off_inv.any()


def test_one_rank_has_one_idle_link():
    ls = build_links(ClusterTopology((_switch_host("h", 1),)))
    assert ls.names == ["none"] and ls.bw.tolist() == [float("inf")] and ls.inv_bw.tolist() == [0.0]
    assert ls.out_inv.shape == (1, 1) and not ls.out_inv.any() and ls.first_hop.tolist() == [[-1]]
