"""One host of a topology file (sharding/topology/host_section.py): the values read into a Host and
the one-line error, naming the key, for every broken cross-reference (fast: no torch)."""

from __future__ import annotations

import math

import pytest

from sharding.topology.cluster import GB, Gpu, Nic, NumaNode, NvlinkSpec, PcieSwitch, SsdSpec, TopologyError
from sharding.topology.topology_file import load_topology

GBs = 1e9

GOOD_HOST = """
  - name: h
    gpus: {count: 2, hbm_gb: 80, hbm_bw_gb_s: 2039}
    pcie:
      port_gb_s: 25
      switches:
        - {name: sw0, numa: 0, uplink_gb_s: 25, gpus: [0, 1], nics: [ib0]}
    numa_nodes: [{ddr_gb: 512, ddr_bw_gb_s: 200}]
    nics: [{name: ib0, speed_gbit_s: 200}]
"""


@pytest.mark.parametrize(
    "edit, needle",
    [
        (("hbm_gb: 80", "hbm_gb: abc"), "key 'hosts[0].gpus.hbm_gb': expected a positive number, got 'abc'"),
        (("hbm_gb: 80", "hbm_gbb: 80"), "key 'hosts[0].gpus.hbm_gbb': unknown key (did you mean 'hosts[0].gpus.hbm_gb'?)"),
        (("gpus: [0, 1]", "gpus: [0, 5]"), "key 'hosts[0].pcie.switches[0].gpus[1]': GPU 5 does not exist"),
        (("gpus: [0, 1]", "gpus: [0, 0]"), "key 'hosts[0].pcie.switches[0].gpus[1]': GPU 0 is already on switch 'sw0'"),
        (("gpus: [0, 1]", "gpus: [0]"), "key 'hosts[0].pcie.switches': GPU 1 is on no switch"),
        (
            ("nics: [ib0]", "nics: [ib1]"),
            "key 'hosts[0].pcie.switches[0].nics[0]': NIC 'ib1' is not in hosts[0].nics (did you mean 'ib0'?)",
        ),
        (("numa: 0,", "numa: 3,"), "key 'hosts[0].pcie.switches[0].numa': NUMA node 3 does not exist"),
        (("    numa_nodes: [{ddr_gb: 512, ddr_bw_gb_s: 200}]\n", ""), "key 'hosts[0].numa_nodes': missing required key"),
        (("ddr_gb: 512, ", ""), "key 'hosts[0].numa_nodes[0].ddr_gb': missing required key"),
        (
            (
                "    nics: [{name: ib0, speed_gbit_s: 200}]\n",
                "    nvlink: {kind: pairs, link_gb_s: 25, pairs: [[0, 2, 4]]}\n    nics: [{name: ib0, speed_gbit_s: 200}]\n",
            ),
            "key 'hosts[0].nvlink.pairs[0][1]': GPU 2 does not exist",
        ),
        (
            (
                "    nics: [{name: ib0, speed_gbit_s: 200}]\n",
                "    nvlink: {kind: nvswitch, link_gb_s: 25}\n    nics: [{name: ib0, speed_gbit_s: 200}]\n",
            ),
            "key 'hosts[0].nvlink.links_per_gpu': missing required key",
        ),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path, edit, needle):
    text = "name: t\ncompute_device: cuda\nhosts:" + GOOD_HOST
    assert edit[0] in text
    p = tmp_path / "bad.yaml"
    p.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("bad.yaml: ") and needle in msg, msg


@pytest.mark.parametrize(
    "edit, needle",
    [
        ("parent: sw0", "key 'hosts[0].pcie.switches[1].parent': 'nope' is not a switch listed before 'sw1'"),
        ("numa: 1", "key 'hosts[0].pcie.switches[1].numa': NUMA 1 disagrees with its parent switch 'sw0' (NUMA 0)"),
    ],
)
def test_parent_switch_errors(tmp_path, edit, needle):
    text = """name: t
hosts:
  - name: h
    gpus: {count: 2, hbm_gb: 80, hbm_bw_gb_s: 2000}
    pcie:
      port_gb_s: 25
      switches:
        - {name: sw0, numa: 0, uplink_gb_s: 25, gpus: [0]}
        - {name: sw1, numa: 0, uplink_gb_s: 25, gpus: [1], parent: sw0}
    numa_nodes: [{index: 0, ddr_gb: 64, ddr_bw_gb_s: 100}, {index: 1, ddr_gb: 64, ddr_bw_gb_s: 100}]
    inter_socket_gb_s: 50
"""
    p = tmp_path / "t.yaml"
    p.write_text(text)
    assert load_topology(p).hosts[0].switch("sw1").parent == "sw0"
    bad = (
        text.replace("parent: sw0", "parent: nope") if edit == "parent: sw0" else text.replace("{name: sw1, numa: 0", "{name: sw1, numa: 1")
    )
    p.write_text(bad)
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert str(e.value) == f"t.yaml: {needle}"


# --- every field read into the Host --------------------------------------------------------------

# two sockets; GPUs listed one by one (two models), a switch with its own port speed and one using
# the default, a NIC on a switch and one on a socket, NVLink islands and an SSD tier
FULL = """
name: full
hosts:
  - name: box
    gpus:
      - {model: A, hbm_gb: 40, hbm_bw_gb_s: 1555}
      - {model: A, hbm_gb: 40, hbm_bw_gb_s: 1555}
      - {model: B, hbm_gb: 80, hbm_bw_gb_s: 2039}
      - {hbm_gb: 80, hbm_bw_gb_s: 2039}
    numa_nodes: [{index: 0, ddr_gb: 256, ddr_bw_gb_s: 100}, {index: 1, ddr_gb: 128, ddr_bw_gb_s: 50}]
    inter_socket_gb_s: 40
    pcie:
      port_gb_s: 25
      switches:
        - {name: s0, numa: 0, uplink_gb_s: 16, gpus: [0, 1], nics: [ib0]}
        - {name: s1, numa: 1, uplink_gb_s: 32, port_gb_s: 50, gpus: [2, 3]}
    nics: [{name: ib0, speed_gbit_s: 200}, {name: eth0, speed_gbit_s: 100, numa: 1}]
    nvlink: {kind: islands, link_gb_s: 20, links_per_gpu: 2, islands: [[0, 1], [2, 3]]}
    ssd: {capacity_gb: 2048, read_gb_s: 14, write_gb_s: 7}
"""


def test_every_field_lands_in_the_host_in_bytes(tmp_path):
    p = tmp_path / "full.yaml"
    p.write_text(FULL)
    h = load_topology(p).hosts[0]
    assert h.name == "box"
    assert h.gpus == (
        Gpu(0, 40 * GB, 1555 * GBs, "s0", 0, "A"),
        Gpu(1, 40 * GB, 1555 * GBs, "s0", 0, "A"),
        Gpu(2, 80 * GB, 2039 * GBs, "s1", 1, "B"),
        Gpu(3, 80 * GB, 2039 * GBs, "s1", 1, ""),
    )
    assert h.numa_nodes == (NumaNode(0, 256 * GB, 100 * GBs), NumaNode(1, 128 * GB, 50 * GBs))
    assert h.inter_socket_bw == 40 * GBs
    assert h.pcie_switches == (
        PcieSwitch("s0", 0, 16 * GBs, 25 * GBs, (0, 1), ("ib0",)),
        PcieSwitch("s1", 1, 32 * GBs, 50 * GBs, (2, 3), ()),
    )
    assert h.nics == (Nic("ib0", 25 * GBs, "s0", 0), Nic("eth0", 12.5 * GBs, None, 1))  # 200 and 100 Gb/s
    assert h.nvlink == NvlinkSpec("islands", 20 * GBs, 2, islands=((0, 1), (2, 3)))
    assert h.ssd == SsdSpec(2048 * GB, 14 * GBs, 7 * GBs)


def test_one_socket_needs_no_socket_link_and_cpu_ranks_take_their_numa(tmp_path):
    p = tmp_path / "cpu.yaml"
    p.write_text(
        "compute_device: cpu\nhosts:\n  - gpus: [{numa: 0}, {numa: 1}, {model: big}]\n"
        "    numa_nodes: {count: 2, ddr_gb: 64, ddr_bw_gb_s: 30}\n    inter_socket_gb_s: 20\n"
    )
    h = load_topology(p).hosts[0]
    assert h.name == "host"  # a host written out in full without a name
    assert h.gpus == (Gpu(0, 0, 0.0, None, 0, ""), Gpu(1, 0, 0.0, None, 1, ""), Gpu(2, 0, 0.0, None, 0, "big"))
    assert h.numa_nodes == (NumaNode(0, 64 * GB, 30 * GBs), NumaNode(1, 64 * GB, 30 * GBs))
    p.write_text(GOOD_HOST.join(["compute_device: cuda\nhosts:", ""]))
    assert load_topology(p).hosts[0].inter_socket_bw == math.inf


@pytest.mark.parametrize(
    "nvlink, expected",
    [
        ("{kind: none}", NvlinkSpec()),
        ("{kind: nvswitch, link_gb_s: 25, links_per_gpu: 12}", NvlinkSpec("nvswitch", 25 * GBs, 12)),
        ("{kind: pairs, link_gb_s: 25, pairs: [[0, 1, 4]]}", NvlinkSpec("pairs", 25 * GBs, pairs=((0, 1, 4),))),
    ],
)
def test_nvlink_kinds(tmp_path, nvlink, expected):
    p = tmp_path / "t.yaml"
    p.write_text("hosts:" + GOOD_HOST + f"    nvlink: {nvlink}\n")
    assert load_topology(p).hosts[0].nvlink == expected


# --- broken cross-references: the exact line -----------------------------------------------------


@pytest.mark.parametrize(
    "old, new, message",
    [
        (
            "    inter_socket_gb_s: 40\n",
            "",
            "key 'hosts[0].inter_socket_gb_s': missing required key (2 NUMA nodes)",
        ),
        (
            "{index: 1, ddr_gb: 128",
            "{index: 0, ddr_gb: 128",
            "key 'hosts[0].numa_nodes[1].index': NUMA node 0 is listed twice",
        ),
        (
            "{name: eth0, speed_gbit_s: 100, numa: 1}",
            "{name: ib0, speed_gbit_s: 100, numa: 1}",
            "key 'hosts[0].nics[1].name': NIC 'ib0' is listed twice",
        ),
        ("numa: 1}]\n    nvlink", "numa: 4}]\n    nvlink", "key 'hosts[0].nics[1].numa': NUMA node 4 does not exist (have [0, 1])"),
        ("numa: 1}]\n    nvlink", "}]\n    nvlink", "key 'hosts[0].nics[1].numa': missing required key (the NIC is on no PCIe switch)"),
        (
            "{name: ib0, speed_gbit_s: 200}",
            "{name: ib0, speed_gbit_s: 200, numa: 1}",
            "key 'hosts[0].nics[0].numa': NUMA 1 disagrees with its switch 's0' (NUMA 0)",
        ),
        ("{name: s1, numa: 1", "{name: s0, numa: 1", "key 'hosts[0].pcie.switches[1].name': switch 's0' is listed twice"),
        (
            "gpus: [2, 3]}",
            "gpus: [2, 3], nics: [ib0]}",
            "key 'hosts[0].pcie.switches[1].nics[0]': NIC 'ib0' is already on switch 's0'",
        ),
        (
            "      port_gb_s: 25\n",
            "",
            "key 'hosts[0].pcie.switches[0].port_gb_s': missing required key (or set hosts[0].pcie.port_gb_s)",
        ),
        (
            "islands: [[0, 1], [2, 3]]",
            "islands: [[0, 1], [1, 3]]",
            "key 'hosts[0].nvlink.islands[1][0]': GPU 1 is already in island 0",
        ),
        ("islands: [[0, 1], [2, 3]]", "islands: [[0, 1], [2]]", "key 'hosts[0].nvlink.islands[1]': an island needs at least two GPUs"),
        ("islands: [[0, 1], [2, 3]]", "islands: [[0, 1], [2, 9]]", "key 'hosts[0].nvlink.islands[1][1]': GPU 9 does not exist"),
        ("{kind: islands, link_gb_s: 20,", "{kind: mesh, link_gb_s: 20,", "key 'hosts[0].nvlink.kind': expected one of none, nvswitch"),
        ("write_gb_s: 7}", "}", "key 'hosts[0].ssd.write_gb_s': missing required key"),
        ("read_gb_s: 14", "read_gb_s: 0", "key 'hosts[0].ssd.read_gb_s': expected a positive number, got 0"),
        ("    gpus:\n      - {model: A", "    gpus: []\n    x:\n      - {model: A", "key 'hosts[0].x': unknown key"),
    ],
)
def test_host_errors(tmp_path, old, new, message):
    assert old in FULL
    p = tmp_path / "full.yaml"
    p.write_text(FULL.replace(old, new, 1))
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert str(e.value).startswith(f"full.yaml: {message}"), str(e.value)


CPU_GPUS = "gpus: {count: 1}"
CPU_NUMA = "numa_nodes: [{ddr_gb: 8, ddr_bw_gb_s: 10}]"


@pytest.mark.parametrize(
    "host, message",
    [
        (["gpus: []", CPU_NUMA], "key 'hosts[0].gpus': expected at least one entry"),
        (["gpus: {count: 0}", CPU_NUMA], "key 'hosts[0].gpus.count': expected an integer >= 1, got 0"),
        (["gpus: [{numa: 3}]", CPU_NUMA], "key 'hosts[0].gpus': device 0: NUMA node 3 does not exist (have [0])"),
        (["gpus: {count: 1, hbm_gb: 8}", CPU_NUMA], "key 'hosts[0].gpus.hbm_gb': unknown key (known: count, model, numa)"),
        (
            [CPU_GPUS, "numa_nodes: {count: 1, index: 0, ddr_gb: 1, ddr_bw_gb_s: 1}"],
            "key 'hosts[0].numa_nodes.index': not allowed with 'count' (nodes are numbered 0..count-1)",
        ),
        (
            [CPU_GPUS, CPU_NUMA, "pcie: {switches: []}"],
            "key 'hosts[0].pcie': not used for compute_device cpu (CPU ranks have no PCIe path)",
        ),
        (
            [CPU_GPUS, CPU_NUMA, "nvlink: {kind: nvswitch, link_gb_s: 1, links_per_gpu: 1}"],
            "key 'hosts[0].nvlink.kind': NVLink needs compute_device cuda",
        ),
        ([CPU_GPUS, CPU_NUMA, "nvlink: nvswitch"], "key 'hosts[0].nvlink': expected a mapping, got 'nvswitch'"),
    ],
)
def test_cpu_host_errors(tmp_path, host, message):
    """A CPU host: ranks on NUMA nodes, no HBM, PCIe or NVLink."""
    p = tmp_path / "cpu.yaml"
    p.write_text("compute_device: cpu\nhosts:\n  - " + "\n    ".join(host) + "\n")
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert str(e.value) == f"cpu.yaml: {message}"


@pytest.mark.parametrize(
    "nvlink, message",
    [
        ("{kind: pairs, link_gb_s: 25, pairs: [[0, 1]]}", "key 'hosts[0].nvlink.pairs[0]': expected [gpu_a, gpu_b, links], got [0, 1]"),
        (
            "{kind: pairs, link_gb_s: 25, pairs: [[1, 1, 2]]}",
            "key 'hosts[0].nvlink.pairs[0]': a pair needs two different GPUs, got 1 twice",
        ),
        ("{kind: pairs, link_gb_s: 25, pairs: [[0, 1, 2], [1, 0, 4]]}", "key 'hosts[0].nvlink.pairs[1]': pair (1, 0) is listed twice"),
        ("{kind: pairs, link_gb_s: 25, pairs: [[0, 1, 0]]}", "key 'hosts[0].nvlink.pairs[0][2]': expected an integer >= 1, got 0"),
        ("{kind: none, link_gb_s: 25}", "key 'hosts[0].nvlink.link_gb_s': unknown key (known: kind)"),
    ],
)
def test_nvlink_pair_errors(tmp_path, nvlink, message):
    p = tmp_path / "t.yaml"
    p.write_text("hosts:" + GOOD_HOST + f"    nvlink: {nvlink}\n")
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert str(e.value) == f"t.yaml: {message}"


def test_cuda_host_needs_a_pcie_tree(tmp_path):
    p = tmp_path / "t.yaml"
    text = "hosts:\n  - gpus: {count: 1, hbm_gb: 8, hbm_bw_gb_s: 100}\n    numa_nodes: [{ddr_gb: 8, ddr_bw_gb_s: 10}]\n"
    p.write_text(text)
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert str(e.value) == "t.yaml: key 'hosts[0].pcie': missing required key (every GPU hangs from a PCIe switch or root port)"
