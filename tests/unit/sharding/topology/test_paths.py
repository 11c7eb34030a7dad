"""The one path model (sharding/topology/paths.py): which links a transfer crosses, in which
direction, and that the cost model's directed links and the rank-pair bandwidths both follow it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from sharding.topology.bandwidth import pair_bandwidth
from sharding.topology.cluster import ClusterTopology, Gpu, Host, NumaNode, NvlinkSpec, PcieSwitch
from sharding.topology.links import build_links
from sharding.topology.paths import Hop, host_label, host_memory_route, nearest_nic, nic_users, route
from sharding.topology.topology_file import load_topology

GBs = 1e9

# Two hosts, each a two-level PCIe tree: leaf switches (2 GPUs each) inside one group switch per
# socket, as `nvidia-smi topo -m` shows PIX pairs inside PXB groups; one NIC per socket.
TREE = """
name: tree
compute_device: cuda
hosts:
  - name: h
    repeat: 2
    gpus: {count: 8, hbm_gb: 80, hbm_bw_gb_s: 2000}
    pcie:
      port_gb_s: 25
      switches:
        - {name: g0, numa: 0, uplink_gb_s: 32}
        - {name: g1, numa: 1, uplink_gb_s: 32}
        - {name: l0, numa: 0, uplink_gb_s: 20, parent: g0, gpus: [0, 1], nics: [ib0]}
        - {name: l1, numa: 0, uplink_gb_s: 20, parent: g0, gpus: [2, 3]}
        - {name: l2, numa: 1, uplink_gb_s: 20, parent: g1, gpus: [4, 5]}
        - {name: l3, numa: 1, uplink_gb_s: 20, parent: g1, gpus: [6, 7], nics: [ib1]}
    numa_nodes: {count: 2, ddr_gb: 512, ddr_bw_gb_s: 150}
    inter_socket_gb_s: 64
    nics: [{name: ib0, speed_gbit_s: 200}, {name: ib1, speed_gbit_s: 200}]
network: {bw_per_nic_gbit_s: 200}
"""


# CPU ranks (gloo) on two sockets of two hosts, one NIC on socket 1: shared memory, the socket
# link and the NIC (CPU topologies have no PCIe tree).
CPU_HOSTS = """
name: cpu-hosts
compute_device: cpu
hosts:
  - name: c
    repeat: 2
    gpus: [{numa: 0}, {numa: 0}, {numa: 1}, {numa: 1}]
    numa_nodes: {count: 2, ddr_gb: 256, ddr_bw_gb_s: 100}
    inter_socket_gb_s: 40
    nics: [{name: eth0, speed_gbit_s: 100, numa: 1}]
network: {bw_per_nic_gbit_s: 100}
"""


def _tree(device: str = "cuda"):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "tree.yaml"
        p.write_text(CPU_HOSTS if device == "cpu" else TREE)
        return load_topology(p)


def _names(hops) -> list[str]:
    return [h.name.split("/", 1)[1] for h in hops]  # without the host prefix


def test_route_climbs_to_the_first_shared_switch_and_no_further():
    t = _tree()
    # same leaf: the two ports
    assert _names(route(t, 0, 1)) == ["l0.port.gpu0>up", "l0.port.gpu1>down"]
    # leaves of one group: each leaf's uplink, not the group's
    assert _names(route(t, 0, 2)) == ["l0.port.gpu0>up", "l0.uplink>up", "l1.uplink>down", "l1.port.gpu2>down"]
    # other socket: up through the group to the root complex, across, and down the other tree
    assert _names(route(t, 0, 6)) == [
        "l0.port.gpu0>up", "l0.uplink>up", "g0.uplink>up", "socket0>1", "g1.uplink>down", "l3.uplink>down", "l3.port.gpu6>down",
    ]  # fmt: skip


def test_cost_model_links_and_pair_bandwidths_follow_the_route():
    t = _tree()
    links = build_links(t)
    directed = sorted(links.names[i].split("/", 1)[1] for i in links.path[0][6])
    assert directed == sorted(_names(route(t, 0, 6)))  # the group uplinks are loaded too
    # bandwidth views of the same route: alone, the slowest link (a leaf uplink, 20 GB/s); all
    # ranks sending, the group uplink shared by the 4 GPUs below it (32/4) or the socket link by a
    # socket's 4 GPUs (64/4)
    assert pair_bandwidth(t, 0, 6, shared=False) == pytest.approx(20 * GBs)
    assert pair_bandwidth(t, 0, 6) == pytest.approx(min(20 / 2, 32 / 4, 64 / 4) * GBs)
    assert pair_bandwidth(t, 0, 2) == pytest.approx(20 / 2 * GBs)  # no group uplink inside a group


def test_cross_host_route_goes_through_the_nearest_nic_and_the_fabric():
    t = _tree()
    hops = route(t, 2, 8 + 6)  # host 0 GPU 2 (leaf l1, no NIC: ib0 under the same group) -> host 1 GPU 6
    named = [h.name.replace(f"{t.hosts[h.host].name}#{h.host}", f"H{h.host}") for h in hops]
    assert named == [
        "H0/l1.port.gpu2>up", "H0/l1.uplink>up", "H0/l0.uplink>down", "H0/l0.port.ib0>down", "H0/ib0>out", "network/H0/ib0>out",
        "network/H1/ib1>in", "H1/ib1>in", "H1/l3.port.ib1>up", "H1/l3.port.gpu6>down",
    ]  # fmt: skip
    assert [h.kind for h in hops if h.kind in ("nic", "fabric")] == ["nic", "fabric", "fabric", "nic"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_route_crosses_the_links_of_its_reverse_the_other_way(device):
    """Full duplex: b -> a uses the same physical links as a -> b, each in the other direction
    (memory, shared by both directions, excepted) - across sockets, switches, NICs and hosts."""
    t = _tree(device)
    for a in range(t.world_size):
        for b in range(t.world_size):
            there, back = route(t, a, b), route(t, b, a)
            assert sorted(h.link for h in there) == sorted(h.link for h in back), (a, b)
            one_way = {h.name for h in there if h.kind != "memory"}
            assert not one_way & {h.name for h in back}, (a, b)


@pytest.mark.parametrize("name", ["dgx-a100-2host", "gb200-nvl72", "workstation-4gpu-nvlink-pairs", "cpu-gloo"])
def test_shipped_routes_are_full_duplex(name):
    t = load_topology(name)
    for a in range(min(t.world_size, 40)):
        for b in range(min(t.world_size, 40)):
            assert sorted(h.link for h in route(t, a, b)) == sorted(h.link for h in route(t, b, a)), (a, b)


# --- the rules one by one ------------------------------------------------------------------------


def test_a_rank_to_itself_crosses_nothing_and_hosts_are_labelled_by_index():
    t = _tree()
    assert route(t, 3, 3) == []
    assert [host_label(t, h) for h in range(2)] == ["h-0#0", "h-1#1"]


def test_hops_carry_kind_bandwidth_sharers_and_switch():
    t = _tree()
    assert route(t, 0, 6)[:5] == [
        Hop("h-0#0/l0.port.gpu0>up", "h-0#0/l0.port.gpu0", "pcie_port", 25 * GBs, 1, 0, "l0"),
        Hop("h-0#0/l0.uplink>up", "h-0#0/l0.uplink", "pcie_uplink", 20 * GBs, 2, 0, "l0"),
        Hop("h-0#0/g0.uplink>up", "h-0#0/g0.uplink", "pcie_uplink", 32 * GBs, 4, 0, "g0"),
        Hop("h-0#0/socket0>1", "h-0#0/inter_socket", "socket", 64 * GBs, 4, 0),
        Hop("h-0#0/g1.uplink>down", "h-0#0/g1.uplink", "pcie_uplink", 32 * GBs, 4, 0, "g1"),
    ]


def test_cpu_ranks_exchange_through_memory():
    """Rule 1: the DDR of each side's NUMA node, the socket link between sockets."""
    t = _tree("cpu")
    assert route(t, 0, 1) == [Hop("c-0#0/numa0.ddr", "c-0#0/numa0.ddr", "memory", 100 * GBs, 2, 0)]
    assert [(h.name, h.sharers) for h in route(t, 0, 2)] == [("c-0#0/numa0.ddr", 2), ("c-0#0/socket0>1", 2), ("c-0#0/numa1.ddr", 2)]


def test_cpu_ranks_reach_another_host_through_the_nic_socket():
    """Rule 6 for CPU ranks: memory and the socket link to the NIC's socket, the NIC, the fabric;
    the way down on the other host is the same links crossed the other way."""
    t = _tree("cpu")
    assert [h.name for h in route(t, 0, 4)] == [
        "c-0#0/numa0.ddr", "c-0#0/socket0>1", "c-0#0/eth0>out", "network/c-0#0/eth0>out",
        "network/c-1#1/eth0>in", "c-1#1/eth0>in", "c-1#1/socket1>0", "c-1#1/numa0.ddr",
    ]  # fmt: skip
    nic = [h for h in route(t, 0, 4) if h.kind in ("nic", "fabric")]
    assert {(h.bw, h.sharers) for h in nic} == {(100 * GBs / 8, 4)}  # 100 Gb/s, all 4 ranks of a host use eth0


def _host(name: str, nvlink: NvlinkSpec) -> Host:
    """Two GPUs on one switch, one NUMA node, no NIC."""
    gpus = tuple(Gpu(i, 80 * 2**30, 2e12, "sw", 0) for i in range(2))
    return Host(name, gpus, nvlink, (PcieSwitch("sw", 0, 25 * GBs, 25 * GBs, (0, 1)),), (NumaNode(0, 2**30, 1e11),), float("inf"))


def test_nvlink_inside_a_host_replaces_pcie():
    """Rule 2: a point-to-point link for NVLink pairs (one link both ways), each GPU's port into
    the NVSwitch otherwise."""
    pairs = ClusterTopology((_host("p", NvlinkSpec("pairs", 25 * GBs, pairs=((0, 1, 4),))),))
    assert route(pairs, 0, 1) == [Hop("p#0/nvlink0>1", "p#0/nvlink(0,1)", "nvlink", 100 * GBs, 1, 0)]
    assert route(pairs, 1, 0) == [Hop("p#0/nvlink1>0", "p#0/nvlink(0,1)", "nvlink", 100 * GBs, 1, 0)]
    switch = ClusterTopology((_host("s", NvlinkSpec("nvswitch", 25 * GBs, 12)),))
    assert route(switch, 1, 0) == [
        Hop("s#0/gpu1.nvlink>out", "s#0/gpu1.nvlink", "nvlink", 300 * GBs, 1, 0),
        Hop("s#0/gpu0.nvlink>in", "s#0/gpu0.nvlink", "nvlink", 300 * GBs, 1, 0),
    ]


def test_hosts_without_nics_cannot_reach_each_other():
    none = NvlinkSpec()
    t = ClusterTopology((_host("a", none), _host("b", none)), source="two.yaml")
    assert [h.kind for h in route(t, 0, 1)] == ["pcie_port", "pcie_port"]
    with pytest.raises(ValueError, match=r"^two\.yaml: a host without NICs in a multi-host topology$"):
        route(t, 0, 2)


def test_host_memory_route_climbs_to_the_root_complex():
    t = _tree()
    assert _names(host_memory_route(t, 0, 0)) == ["l0.port.gpu0>up", "l0.uplink>up", "g0.uplink>up", "numa0.ddr"]
    assert _names(host_memory_route(t, 0, 1)) == ["l0.port.gpu0>up", "l0.uplink>up", "g0.uplink>up", "socket0>1", "numa1.ddr"]
    assert _names(host_memory_route(_tree("cpu"), 2, 0)) == ["socket1>0", "numa0.ddr"]


def test_nearest_nic_prefers_the_switch_then_the_group_then_the_socket():
    t = _tree()
    h = t.hosts[0]
    # GPUs 0-1: ib0 on their own leaf; 2-3: ib0 under the same group switch; 4-7: ib1 likewise
    assert [nearest_nic(h, i).name for i in range(8)] == ["ib0"] * 4 + ["ib1"] * 4
    assert nic_users(h, h.nic("ib0")) == 4 and nic_users(h, h.nic("ib1")) == 4
    cpu = _tree("cpu").hosts[0]  # one NIC on socket 1: socket 0's ranks take it too
    assert [nearest_nic(cpu, i).name for i in range(4)] == ["eth0"] * 4 and nic_users(cpu, cpu.nic("eth0")) == 4
    assert nearest_nic(_host("x", NvlinkSpec()), 0) is None


def test_nearest_nic_spreads_ties():
    """Two NICs on a socket, no PCIe tree: the k-th rank of the socket takes NIC k mod 2."""
    text = CPU_HOSTS.replace(
        "[{name: eth0, speed_gbit_s: 100, numa: 1}]", "[{name: e0, speed_gbit_s: 100, numa: 0}, {name: e1, speed_gbit_s: 100, numa: 0}]"
    )
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.yaml"
        p.write_text(text)
        h = load_topology(p).hosts[0]
    assert [nearest_nic(h, i).name for i in range(4)] == ["e0", "e1", "e0", "e1"]
    assert nic_users(h, h.nic("e0")) == 2
