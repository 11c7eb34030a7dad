"""The hardware dataclasses (sharding/topology/cluster.py): NVLink link counts, the PCIe tree of a
host, rank numbering and NVLink domains, the one-line summary (fast: no torch)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sharding.topology.cluster import GB, ClusterTopology, Gpu, Host, Network, Nic, NumaNode, NvlinkSpec, PcieSwitch, SsdSpec

GBs = 1e9


@pytest.mark.parametrize(
    "spec, pairs",
    [
        (NvlinkSpec(), {(0, 1): 0, (2, 3): 0}),
        (NvlinkSpec("nvswitch", 25 * GBs, 12), {(0, 1): 12, (0, 3): 12, (2, 2): 0}),
        (NvlinkSpec("islands", 25 * GBs, 4, islands=((0, 1), (2, 3))), {(0, 1): 4, (3, 2): 4, (1, 2): 0, (0, 0): 0}),
        (NvlinkSpec("pairs", 25 * GBs, pairs=((0, 1, 2), (1, 2, 4))), {(0, 1): 2, (1, 0): 2, (2, 1): 4, (0, 2): 0}),
    ],
)
def test_nvlink_links_and_bandwidth(spec, pairs):
    for (a, b), links in pairs.items():
        assert spec.links(a, b) == links, (a, b)
        assert spec.bandwidth(a, b) == links * spec.link_bw


def _host(name: str = "h") -> Host:
    """Two sockets; switch ``top`` holds leaves ``l0`` (GPUs 0, 1 and a NIC) and ``l1`` (GPU 2);
    ``s1`` on socket 1 holds GPU 3."""
    switches = (
        PcieSwitch("top", 0, 32 * GBs, 25 * GBs),
        PcieSwitch("l0", 0, 16 * GBs, 25 * GBs, (0, 1), ("ib0",), "top"),
        PcieSwitch("l1", 0, 16 * GBs, 25 * GBs, (2,), (), "top"),
        PcieSwitch("s1", 1, 16 * GBs, 25 * GBs, (3,)),
    )
    gpus = tuple(Gpu(i, 80 * GB, 2e12, sw, numa) for i, (sw, numa) in enumerate([("l0", 0), ("l0", 0), ("l1", 0), ("s1", 1)]))
    numa = (NumaNode(0, 512 * GB, 100 * GBs), NumaNode(1, 256 * GB, 100 * GBs))
    return Host(name, gpus, NvlinkSpec("nvswitch", 25 * GBs, 12), switches, numa, 40 * GBs, (Nic("ib0", 25 * GBs, "l0", 0),))


def test_host_pcie_tree():
    h = _host()
    assert h.switch("l1").uplink_bw == 16 * GBs
    assert [s.name for s in h.switch_chain("l0")] == ["l0", "top"]
    assert [s.name for s in h.switch_chain("s1")] == ["s1"]
    assert h.gpus_below("top") == (0, 1, 2)  # the leaves' GPUs share the top switch's uplink
    assert h.gpus_below("l0") == (0, 1) and h.gpus_below("s1") == (3,)
    with pytest.raises(KeyError, match="nope"):
        h.switch("nope")


def test_host_memory_nics_and_numa():
    h = _host()
    assert h.ddr_bytes == 768 * GB and h.numa(1).ddr_bytes == 256 * GB
    assert h.gpus_on_numa(0) == (0, 1, 2) and h.gpus_on_numa(1) == (3,) and h.gpus_on_numa(5) == ()
    assert h.nic("ib0").bw == 25 * GBs
    assert h.ssd_bytes == 0
    assert Host("s", (), NvlinkSpec(), (), (), math.inf, ssd=SsdSpec(2 * GB, 1.0, 1.0)).ssd_bytes == 2 * GB
    with pytest.raises(KeyError, match="2"):
        h.numa(2)
    with pytest.raises(KeyError, match="eth0"):
        h.nic("eth0")


def test_ranks_are_host_major():
    t = ClusterTopology(tuple(_host(f"h{i}") for i in range(3)))
    assert (t.world_size, t.local_world_size) == (12, 4)
    assert t.locate(0) == (0, 0) and t.locate(7) == (1, 3) and t.locate(11) == (2, 3)
    assert all(t.rank(*t.locate(r)) == r for r in range(12))
    assert t.host_of(5).name == "h1" and t.gpu(7).pcie_switch == "s1"
    assert t.ranks_on_numa(2, 0) == (8, 9, 10) and t.ranks_on_numa(1, 1) == (7,)
    for bad in (-1, 12):
        with pytest.raises(IndexError, match=rf"^rank {bad} out of range for world size 12$"):
            t.locate(bad)


def test_nvlink_domains_group_consecutive_hosts():
    t = ClusterTopology(tuple(_host(f"h{i}") for i in range(4)), Network(nvlink_domain_hosts=2))
    assert t.ranks_per_nvlink_domain == 8
    assert [t.nvlink_domain(h) for h in range(4)] == [0, 0, 1, 1]
    assert t.same_nvlink_domain(0, 4)  # host 0 and host 1
    assert not t.same_nvlink_domain(0, 1)  # one host: NVLink inside it, not the domain across hosts
    assert not t.same_nvlink_domain(3, 8)  # host 0 and host 2
    alone = ClusterTopology((_host("a"), _host("b")))
    assert alone.ranks_per_nvlink_domain == 4 and not alone.same_nvlink_domain(0, 4)


def test_summary():
    t = ClusterTopology((_host("a"), _host("b")), name="pair")
    assert t.summary() == (
        "pair: 2 host(s) x 4 cuda device(s) = world 8, nvlink nvswitch, 4 PCIe switch(es), "
        "2 NUMA node(s), 768 GB DDR per host, 1 NIC(s) per host"
    )
    ssd = ClusterTopology((replace(_host(), ssd=SsdSpec(1536 * GB, 12 * GBs, 6.5 * GBs)),))
    assert ssd.summary().startswith("topology: 1 host(s)")
    assert ssd.summary().endswith(", 1536 GB SSD per host (read 12 GB/s, write 6.5 GB/s)")
