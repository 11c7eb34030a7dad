"""A ClusterTopology back to the topology file's YAML (sharding/topology/topology_dump.py): the
units people write, and what loads back to the same topology (fast: no torch)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import yaml

from sharding.topology.cluster import GB, ClusterTopology, Gpu, Host, Network, Nic, NumaNode, NvlinkSpec, PcieSwitch, SsdSpec
from sharding.topology.topology_dump import _num, dump_topology, topology_to_dict
from sharding.topology.topology_file import load_topology

GBs = 1e9


def _two_socket(ssd: SsdSpec | None = None) -> ClusterTopology:
    """Two hosts of 4 GPUs (two models), a nested PCIe tree on socket 0, a NIC on a switch and one
    on socket 1, NVLink pairs, a socket link; built from the dataclasses, not from a file."""
    switches = (
        PcieSwitch("top", 0, 32 * GBs, 25 * GBs),
        PcieSwitch("leaf", 0, 16 * GBs, 25 * GBs, (0, 1), ("ib0",), "top"),
        PcieSwitch("s1", 1, 16 * GBs, 25 * GBs, (2, 3)),
    )
    gpus = (
        Gpu(0, 40 * GB, 1555 * GBs, "leaf", 0, "A100-SXM4-40GB"),
        Gpu(1, 40 * GB, 1555 * GBs, "leaf", 0, "A100-SXM4-40GB"),
        Gpu(2, 80 * GB, 2039 * GBs, "s1", 1, "A100-SXM4-80GB"),
        Gpu(3, 80 * GB, 2039 * GBs, "s1", 1, "A100-SXM4-80GB"),
    )
    host = Host(
        "h",
        gpus,
        NvlinkSpec("pairs", 14.0625 * GBs, pairs=((0, 1, 4), (2, 3, 4))),
        switches,
        (NumaNode(0, 256 * GB, 100 * GBs), NumaNode(1, 256 * GB, 100 * GBs)),
        40 * GBs,
        (Nic("ib0", 25 * GBs, "leaf", 0), Nic("eth0", 12.5 * GBs, None, 1)),
        ssd,
    )
    hosts = (host, replace(host, name="h2"))
    return ClusterTopology(hosts, Network(bw_per_nic=25 * GBs, latency=2e-6), "cuda", "rack", "rack.yaml")


def test_numbers_are_written_as_people_read_them():
    assert (_num(80.0), type(_num(80.0))) == (80, int)
    assert _num(14.0625) == 14.0625
    assert _num(1 / 3) == 0.333333  # six decimals: a round trip of GB/s to bytes/s is exact to well below that


def test_to_dict_in_the_file_units():
    d = topology_to_dict(_two_socket(SsdSpec(1024 * GB, 12 * GBs, 6 * GBs)))
    host = {
        "name": "h",
        "gpus": [
            {"model": "A100-SXM4-40GB", "hbm_gb": 40, "hbm_bw_gb_s": 1555},
            {"model": "A100-SXM4-40GB", "hbm_gb": 40, "hbm_bw_gb_s": 1555},
            {"model": "A100-SXM4-80GB", "hbm_gb": 80, "hbm_bw_gb_s": 2039},
            {"model": "A100-SXM4-80GB", "hbm_gb": 80, "hbm_bw_gb_s": 2039},
        ],
        "nvlink": {"kind": "pairs", "link_gb_s": 14.0625, "pairs": [[0, 1, 4], [2, 3, 4]]},
        "pcie": {
            "switches": [
                {"name": "top", "numa": 0, "uplink_gb_s": 32, "port_gb_s": 25, "gpus": [], "nics": []},
                {"name": "leaf", "numa": 0, "uplink_gb_s": 16, "port_gb_s": 25, "gpus": [0, 1], "nics": ["ib0"], "parent": "top"},
                {"name": "s1", "numa": 1, "uplink_gb_s": 16, "port_gb_s": 25, "gpus": [2, 3], "nics": []},
            ]
        },
        "numa_nodes": [{"index": 0, "ddr_gb": 256, "ddr_bw_gb_s": 100}, {"index": 1, "ddr_gb": 256, "ddr_bw_gb_s": 100}],
        "inter_socket_gb_s": 40,
        "nics": [{"name": "ib0", "speed_gbit_s": 200}, {"name": "eth0", "speed_gbit_s": 100, "numa": 1}],
        "ssd": {"capacity_gb": 1024, "read_gb_s": 12, "write_gb_s": 6},
    }
    assert d == {
        "name": "rack",
        "compute_device": "cuda",
        "hosts": [host, {**host, "name": "h2"}],
        "network": {"bw_per_nic_gbit_s": 200, "latency_us": 2},
    }


def test_identical_devices_are_a_count_and_defaults_are_left_out():
    cpu = ClusterTopology(
        (Host("c", (Gpu(0, 0, 0.0, None, 0), Gpu(1, 0, 0.0, None, 0)), NvlinkSpec(), (), (NumaNode(0, 16 * GB, 6 * GBs),), math.inf),),
        compute_device="cpu",
        name="cpu",
    )
    assert topology_to_dict(cpu) == {
        "name": "cpu",
        "compute_device": "cpu",
        "hosts": [
            {
                "name": "c",
                "gpus": {"count": 2, "numa": 0},
                "nvlink": {"kind": "none"},
                "numa_nodes": [{"index": 0, "ddr_gb": 16, "ddr_bw_gb_s": 6}],
            }
        ],
    }


@pytest.mark.parametrize(
    "nvlink, written",
    [
        (NvlinkSpec("nvswitch", 25 * GBs, 12), {"kind": "nvswitch", "link_gb_s": 25, "links_per_gpu": 12}),
        (
            NvlinkSpec("islands", 25 * GBs, 4, islands=((0, 1), (2, 3))),
            {"kind": "islands", "link_gb_s": 25, "links_per_gpu": 4, "islands": [[0, 1], [2, 3]]},
        ),
    ],
)
def test_nvlink_kinds_are_written_with_their_keys(nvlink, written):
    t = _two_socket()
    t = ClusterTopology((replace(t.hosts[0], nvlink=nvlink),), name="one")
    assert topology_to_dict(t)["hosts"][0]["nvlink"] == written


@pytest.mark.parametrize("ssd", [None, SsdSpec(1024 * GB, 12 * GBs, 6 * GBs)])
def test_dump_then_load_gives_the_same_topology(tmp_path, ssd):
    t = _two_socket(ssd)
    p = tmp_path / "rack.yaml"
    p.write_text(dump_topology(t))
    assert load_topology(p) == t


def test_header_lines_are_comments_that_load_ignores(tmp_path):
    text = dump_topology(_two_socket(), header="imported from topo.txt\nsecond line")
    assert text.splitlines()[:3] == ["# imported from topo.txt", "# second line", "name: rack"]
    assert yaml.safe_load(text) == topology_to_dict(_two_socket())
    p = tmp_path / "rack.yaml"
    p.write_text(text)
    assert load_topology(p) == _two_socket()
