"""Rank-pair bandwidths (sharding/topology/bandwidth.py): the bottleneck link of a route, with every
rank sending or one pair alone, on the shipped topologies and on a small one worked by hand
(fast: no torch)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sharding.topology.bandwidth import (
    Link,
    UplinkGroup,
    bandwidth_matrix,
    host_to_gpu_bandwidth,
    nearest_nic,
    pair_bandwidth,
    pair_path,
    path_bandwidth,
    shared_uplink_groups,
)
from sharding.topology.cluster import GB
from sharding.topology.topology_file import load_topology

GBs = 1e9


def test_dgx_a100():
    t = load_topology("dgx-a100")
    m = bandwidth_matrix(t)
    off = m[~np.eye(8, dtype=bool)]
    assert np.allclose(off, 300 * GBs)  # NVLink3 via NVSwitch: 12 x 25 GB/s, any pair
    h = t.hosts[0]
    assert h.gpus[0].hbm_bytes == 80 * GB and h.ddr_bytes == 2048 * GB
    assert [g.numa for g in h.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [nearest_nic(h, i).name for i in range(8)] == [f"mlx5_{i}" for i in range(8)]
    # UVM: a GPU's switch uplink (shared by its 2 GPUs) vs. one GPU alone
    assert host_to_gpu_bandwidth(t, 0) == pytest.approx(12.5 * GBs)
    assert host_to_gpu_bandwidth(t, 0, shared=False) == pytest.approx(25 * GBs)
    assert host_to_gpu_bandwidth(t, 0, numa=1, shared=False) == pytest.approx(25 * GBs)
    groups = shared_uplink_groups(t)
    assert [(g.switch, g.ranks, g.nics) for g in groups][0] == ("sw0", (0, 1), ("mlx5_0", "mlx5_1"))


def test_dgx_h100():
    m = bandwidth_matrix(load_topology("dgx-h100"))
    assert m[0, 7] == pytest.approx(450 * GBs) and m[3, 4] == pytest.approx(450 * GBs)


def test_clusters_cross_host_is_nic_bandwidth():
    t = load_topology("dgx-a100-2host")
    assert t.hosts[0].name == "dgx-a100-0" and t.hosts[1].name == "dgx-a100-1"
    assert t.locate(9) == (1, 1) and t.rank(1, 1) == 9
    assert pair_bandwidth(t, 0, 1) == pytest.approx(300 * GBs)  # same host: NVLink
    assert pair_bandwidth(t, 0, 8) == pytest.approx(25 * GBs)  # HDR 200 Gb/s
    assert pair_bandwidth(t, 3, 12) == pytest.approx(25 * GBs)
    t16 = load_topology("dgx-h100-16host")
    assert t16.world_size == 128 and len({h.name for h in t16.hosts}) == 16
    assert pair_bandwidth(t16, 0, 127) == pytest.approx(50 * GBs)  # NDR 400 Gb/s
    assert pair_bandwidth(t16, 120, 127) == pytest.approx(450 * GBs)


def test_pcie_server_ordering():
    t = load_topology("pcie-8gpu-2socket")
    same_switch, same_socket, cross_socket = (pair_bandwidth(t, 0, b) for b in (1, 2, 4))
    assert same_switch > same_socket > cross_socket
    assert same_switch == pytest.approx(25 * GBs)  # Gen4 x16 ports
    assert same_socket == pytest.approx(12.5 * GBs)  # switch uplink shared by 2 GPUs
    assert cross_socket == pytest.approx(10.4 * GBs)  # 41.6 GB/s socket link shared by 4 GPUs
    # one pair alone: every path is a Gen4 x16 link
    assert {pair_bandwidth(t, 0, b, shared=False) for b in (1, 2, 4)} == {25 * GBs}
    h = t.hosts[0]
    assert nearest_nic(h, 1).name == "mlx5_0" and nearest_nic(h, 3).name == "mlx5_0"
    assert nearest_nic(h, 6).name == "mlx5_1"
    assert host_to_gpu_bandwidth(t, 0, numa=1) < host_to_gpu_bandwidth(t, 0, numa=0)


def test_workstation_nvlink_pairs():
    t = load_topology("workstation-4gpu-nvlink-pairs")
    assert pair_bandwidth(t, 0, 1) == pytest.approx(56.25 * GBs)
    assert pair_bandwidth(t, 2, 3) == pytest.approx(56.25 * GBs)
    assert pair_bandwidth(t, 1, 2) == pytest.approx(25 * GBs)


def test_cpu_topology():
    t = load_topology("cpu-gloo")
    g = t.gpu(1)
    assert g.hbm_bytes == 0 and g.pcie_switch is None
    assert t.hosts[0].ddr_bytes == 16 * GB and t.ranks_on_numa(0, 0) == (0, 1)
    assert pair_bandwidth(t, 0, 1, shared=False) == pytest.approx(6 * GBs)  # calibrated effective DDR


# --- a small topology, worked by hand ------------------------------------------------------------

# Two hosts of 4 GPUs: GPUs 0-1 on switch s0 (socket 0) with the host's only NIC, GPUs 2-3 on s1
# (socket 1). Ports 32 GB/s, switch uplinks 24 GB/s (2 GPUs each), socket link 20 GB/s (2 GPUs on
# each socket), DDR 90 GB/s per node, NIC 400 Gb/s = 50 GB/s and fabric port 200 Gb/s = 25 GB/s,
# both used by all 4 GPUs of the host.
SMALL = """
name: small
hosts:
  - name: h
    repeat: 2
    gpus: {count: 4, hbm_gb: 80, hbm_bw_gb_s: 2000}
    pcie:
      port_gb_s: 32
      switches:
        - {name: s0, numa: 0, uplink_gb_s: 24, gpus: [0, 1], nics: [ib0]}
        - {name: s1, numa: 1, uplink_gb_s: 24, gpus: [2, 3]}
    numa_nodes: {count: 2, ddr_gb: 256, ddr_bw_gb_s: 90}
    inter_socket_gb_s: 20
    nics: [{name: ib0, speed_gbit_s: 400}]
network: {bw_per_nic_gbit_s: 200}
"""


@pytest.fixture
def small(tmp_path):
    p = tmp_path / "small.yaml"
    p.write_text(SMALL)
    return load_topology(p)


@pytest.mark.parametrize(
    "a, b, shared, alone",
    [
        (0, 0, 2000, 2000),  # HBM
        (0, 1, 32, 32),  # one switch: the two ports
        (0, 2, min(32, 24 / 2, 20 / 2, 24 / 2, 32), min(32, 24, 20)),  # port, uplink, socket, uplink, port
        (0, 4, min(32, 50 / 4, 25 / 4), min(32, 50, 25)),  # port, NIC port, NIC, fabric port; the same on host 1
        (2, 4, min(32, 24 / 2, 20 / 2, 50 / 4, 25 / 4), min(32, 24, 20, 50, 25)),  # GPU 2 reaches the NIC across the socket link
        (6, 7, 32, 32),
    ],
)
def test_pair_bandwidth_is_the_bottleneck_link(small, a, b, shared, alone):
    assert pair_bandwidth(small, a, b) == pytest.approx(shared * GBs)
    assert pair_bandwidth(small, a, b, shared=False) == pytest.approx(alone * GBs)
    assert pair_bandwidth(small, b, a) == pytest.approx(shared * GBs)


def test_bandwidth_matrix_is_every_pair(small):
    m = bandwidth_matrix(small)
    expected = np.empty((8, 8))
    for a in range(8):
        for b in range(8):
            if a == b:
                expected[a, b] = 2000
            elif a // 4 != b // 4:
                expected[a, b] = 25 / 4  # every cross-host pair: the fabric port shared by 4 GPUs
            elif a // 2 == b // 2:
                expected[a, b] = 32  # same switch
            else:
                expected[a, b] = 10  # the socket link shared by 2 GPUs
    assert np.allclose(m, expected * GBs)
    assert np.allclose(bandwidth_matrix(small, shared=False)[0], np.array([2000, 32, 20, 20, 25, 25, 20, 20]) * GBs)


def test_pair_path_lists_each_link_once(small):
    assert pair_path(small, 0, 0) == [Link("h-0#0/gpu0.hbm", 2000 * GBs)]
    assert pair_path(small, 0, 2) == [
        Link("h-0#0/s0.port.gpu0", 32 * GBs, 1),
        Link("h-0#0/s0.uplink", 24 * GBs, 2),
        Link("h-0#0/inter_socket", 20 * GBs, 2),
        Link("h-0#0/s1.uplink", 24 * GBs, 2),
        Link("h-0#0/s1.port.gpu2", 32 * GBs, 1),
    ]


def test_host_to_gpu_bandwidth(small):
    # own socket: port, uplink (2 GPUs), DDR (2 GPUs on the node)
    assert host_to_gpu_bandwidth(small, 0) == pytest.approx(min(32, 24 / 2, 90 / 2) * GBs)
    assert host_to_gpu_bandwidth(small, 0, shared=False) == pytest.approx(24 * GBs)
    # the other socket: the socket link too
    assert host_to_gpu_bandwidth(small, 0, numa=1) == pytest.approx(min(32, 24 / 2, 20 / 2, 90 / 2) * GBs)
    assert host_to_gpu_bandwidth(small, 0, numa=1, shared=False) == pytest.approx(20 * GBs)
    with pytest.raises(ValueError, match=r"^host h-1 has no NUMA node 7$"):
        host_to_gpu_bandwidth(small, 5, numa=7)


def test_shared_uplink_groups(small):
    s = 24 * GBs
    assert shared_uplink_groups(small) == [
        UplinkGroup("h-0", "s0", 0, s, (0, 1), ("ib0",)),
        UplinkGroup("h-0", "s1", 1, s, (2, 3), ()),
        UplinkGroup("h-1", "s0", 0, s, (4, 5), ("ib0",)),
        UplinkGroup("h-1", "s1", 1, s, (6, 7), ()),
    ]
    assert shared_uplink_groups(load_topology("cpu-gloo")) == []


def test_path_bandwidth_and_link_share():
    link = Link("x", 30 * GBs, 3)
    assert (link.share(True), link.share(False)) == (10 * GBs, 30 * GBs)
    assert path_bandwidth([link, Link("y", 12 * GBs)]) == 10 * GBs
    assert path_bandwidth([link, Link("y", 12 * GBs)], shared=False) == 12 * GBs
    assert path_bandwidth([]) == math.inf
