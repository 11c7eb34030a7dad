"""The one path model (sharding/topology/paths.py): which links a transfer crosses, in which
direction, and that the cost model's directed links and the rank-pair bandwidths both follow it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from sharding.topology.bandwidth import pair_bandwidth
from sharding.topology.topology_file import load_topology
from sharding.topology.links import build_links
from sharding.topology.paths import route

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
