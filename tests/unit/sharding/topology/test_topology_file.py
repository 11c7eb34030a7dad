"""The topology file as a whole (sharding/topology/topology_file.py): the shipped files, names and
paths, the YAML, ``from:`` / ``repeat:`` entries, the network, the checks across hosts (fast: no torch)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from sharding.topology.bandwidth import bandwidth_matrix
from sharding.topology.cluster import GB, TopologyError
from sharding.topology.topology_dump import dump_topology
from sharding.topology.topology_file import TOPOLOGY_DIR, load_topology, shipped_topologies

GBs = 1e9
REPO = Path(__file__).resolve().parents[4]

# name -> (world size, local world size, compute device, diagonal bandwidth GB/s)
SHIPPED = {
    "cpu-gloo": (2, 2, "cpu", 3),  # 6 GB/s of (effective, calibrated) DDR shared by 2 ranks
    "dgx-a100": (8, 8, "cuda", 2039),
    "dgx-a100-2host": (16, 8, "cuda", 2039),
    "dgx-a100-16host": (128, 8, "cuda", 2039),
    "dgx-a100-ssd": (8, 8, "cuda", 2039),  # dgx-a100 with an SSD tier (tests/unit/sharding/planner/test_ssd_tier.py)
    "dgx-h100": (8, 8, "cuda", 3350),
    "dgx-h100-2host": (16, 8, "cuda", 3350),
    "dgx-h100-16host": (128, 8, "cuda", 3350),
    "gb200-nvl72": (72, 4, "cuda", 8000),
    "pcie-8gpu-2socket": (8, 8, "cuda", 864),
    "workstation-4gpu-nvlink-pairs": (4, 4, "cuda", 768),
}


def load_topology_text(text: str, name: str):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"{name}.yaml"
        p.write_text(text)
        return load_topology(p)


def test_shipped_list_is_complete():
    assert sorted(p.stem for p in shipped_topologies()) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_loads_symmetric_matrix(name):
    world, local, device, diag = SHIPPED[name]
    t = load_topology(name)
    assert (t.world_size, t.local_world_size, t.compute_device) == (world, local, device)
    m = bandwidth_matrix(t)
    assert m.shape == (world, world)
    assert np.array_equal(m, m.T)
    assert np.allclose(np.diag(m), diag * GBs)
    assert (m > 0).all()
    # the file format round-trips
    again = load_topology_text(dump_topology(t), name)
    assert again.world_size == world
    assert np.allclose(bandwidth_matrix(again), m)


@pytest.mark.parametrize(
    "network,message",
    [
        ("{nvlink_domain_hosts: 4}", "key 'network.nvlink_domain_hosts': 4 does not divide the 18 hosts into whole NVLink domains"),
        ("{nvlink_domain_hosts: 0}", "key 'network.nvlink_domain_hosts'"),
    ],
)
def test_nvlink_domain_errors_name_the_key(network, message):
    text = (REPO / "sharding/topologies/gb200-nvl72.yaml").read_text()
    text = text.split("network:")[0] + f"network: {network}\n"
    with pytest.raises(TopologyError, match=message):
        load_topology_text(text, "bad")


def test_nvlink_domain_needs_nvswitch_hosts():
    text = dump_topology(load_topology("dgx-a100-2host"))
    ok = load_topology_text(text.replace("latency_us: 2}", "latency_us: 2, nvlink_domain_hosts: 2}"), "ok")
    assert ok.same_nvlink_domain(0, 8)
    pcie = (REPO / "sharding/topologies/pcie-8gpu-2socket.yaml").read_text()
    bad = pcie.replace("hosts:\n  - name: ", "hosts:\n  - repeat: 2\n    name: ", 1) + "network: {nvlink_domain_hosts: 2}\n"
    with pytest.raises(TopologyError, match="an NVLink domain across hosts needs NVSwitch hosts, but host"):
        load_topology_text(bad, "bad")


# --- bad files -------------------------------------------------------------------------------

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
GOOD = "name: t\ncompute_device: cuda\nhosts:" + GOOD_HOST


@pytest.mark.parametrize(
    "edit, needle",
    [
        (("compute_device: cuda", "compute_device: tpu"), "key 'compute_device': expected one of cuda, cpu, got 'tpu'"),
        (("hosts:", "hosts:\n  - {from: nope.yaml, repeat: 2}"), "key 'hosts[0].from': no such file 'nope.yaml'"),
        (("name: h", "name: h\n    repeat: 0"), "key 'hosts[0].repeat': expected an integer >= 1, got 0"),
        (("hosts:", "hosts: [\n"), "invalid YAML: line"),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path, edit, needle):
    text = GOOD
    assert edit[0] in text
    p = tmp_path / "bad.yaml"
    p.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("bad.yaml: ") and needle in msg, msg


def test_good_base_file_loads(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text(GOOD)
    assert load_topology(p).world_size == 2


def test_multi_host_needs_nics(tmp_path):
    base = tmp_path / "one.yaml"
    base.write_text(
        "compute_device: cuda\nhosts:" + GOOD_HOST.replace("    nics: [{name: ib0, speed_gbit_s: 200}]\n", "").replace(", nics: [ib0]", "")
    )
    two = tmp_path / "two.yaml"
    two.write_text("hosts:\n  - {from: one.yaml, repeat: 2}\n")
    with pytest.raises(TopologyError, match=r"^two.yaml: key 'hosts': host 'h-0' has no NICs but the cluster has 2 hosts$"):
        load_topology(two)


def test_binary_topology_file_is_one_line_naming_it(tmp_path):
    """A binary file given as a topology once said only "'utf-8' codec can't decode"."""
    f = tmp_path / "topo.yaml"
    f.write_bytes(b"hosts:\n  - \xff\xfe\x00binary")
    with pytest.raises(TopologyError) as e:
        load_topology(f)
    msg = str(e.value)
    assert msg == "topo.yaml: not a UTF-8 text file (byte 0xff at offset 11); is it a topology YAML?"


@pytest.mark.parametrize(
    "given, hint", [("dgx-a10", "; did you mean 'dgx-a100'?"), ("dgx_h100", "; did you mean 'dgx-h100'?"), ("zzz-nothing-like-it", "")]
)
def test_unknown_topology_name_lists_the_shipped_ones(tmp_path, monkeypatch, given, hint):
    monkeypatch.chdir(tmp_path)
    names = [p.stem for p in shipped_topologies()]
    with pytest.raises(TopologyError) as e:
        load_topology(given)
    assert str(e.value) == (f"{given}: no such topology file, nor a shipped topology name (shipped: {', '.join(names)}){hint}")
    with pytest.raises(TopologyError, match=r"^/no/such/dir/t\.yaml: no such topology file"):
        load_topology("/no/such/dir/t.yaml")


# --- names and paths ---------------------------------------------------------------------------


def test_shipped_files_are_the_package_data_directory():
    assert TOPOLOGY_DIR == REPO / "sharding" / "topologies"
    assert shipped_topologies() == sorted((REPO / "sharding" / "topologies").glob("*.yaml"))


def test_a_file_in_the_current_directory_wins_over_a_shipped_name(tmp_path, monkeypatch):
    """``dgx-a100`` is the shipped file, unless the current directory holds a file of that name."""
    assert load_topology("dgx-a100").source == "dgx-a100.yaml"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dgx-a100").write_text(GOOD.replace("name: t\n", ""))
    mine = load_topology("dgx-a100")
    assert (mine.source, mine.name, mine.world_size) == ("dgx-a100", "dgx-a100", 2)


def test_name_defaults_to_the_file_stem_and_description_is_checked(tmp_path):
    p = tmp_path / "my-cluster.yaml"
    p.write_text(GOOD.replace("name: t\n", "description: two GPUs\n"))
    t = load_topology(p)
    assert (t.name, t.source) == ("my-cluster", "my-cluster.yaml")
    p.write_text(GOOD.replace("name: t\n", "description: 12\n"))
    with pytest.raises(TopologyError, match=r"^my-cluster\.yaml: key 'description': expected a non-empty string, got 12$"):
        load_topology(p)


def test_unreadable_path_is_one_line(tmp_path):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(TopologyError, match=r"^dir\.yaml: cannot read: Is a directory$"):
        load_topology(d)


@pytest.mark.parametrize(
    "text, message",
    [
        ("- just\n- a list\n", "t.yaml: expected a mapping, got ['just', 'a list']"),
        ("name: t\n", "t.yaml: key 'hosts': missing required key"),
        ("hosts: []\n", "t.yaml: key 'hosts': expected at least one host"),
        (GOOD + "colour: red\n", "t.yaml: key 'colour': unknown key (known: hosts, name, description, compute_device, network)"),
        (GOOD + "netwrk: {}\n", "t.yaml: key 'netwrk': unknown key (did you mean 'network'?)"),
    ],
)
def test_top_level_errors(tmp_path, text, message):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert str(e.value) == message


# --- hosts across the file: from, repeat, names, counts -----------------------------------------


def test_from_and_repeat_number_the_copies_and_ssd_replaces_the_tier(tmp_path):
    (tmp_path / "base.yaml").write_text(GOOD)
    p = tmp_path / "pod.yaml"
    p.write_text(
        "hosts:\n"
        "  - {from: base.yaml, repeat: 3, name: node}\n"
        "  - {from: base.yaml, ssd: {capacity_gb: 1024, read_gb_s: 12, write_gb_s: 6}}\n"
        "network: {bw_per_nic_gbit_s: 100, latency_us: 3}\n"
    )
    t = load_topology(p)
    assert [h.name for h in t.hosts] == ["node-0", "node-1", "node-2", "h"]
    assert [h.ssd for h in t.hosts[:3]] == [None] * 3
    ssd = t.hosts[3].ssd
    assert (ssd.capacity, ssd.read_bw, ssd.write_bw) == (1024 * GB, 12 * GBs, 6 * GBs)
    base = load_topology(tmp_path / "base.yaml").hosts[0]
    assert t.hosts[1].gpus == base.gpus and t.hosts[1].pcie_switches == base.pcie_switches
    assert (t.world_size, t.network.bw_per_nic, t.network.latency) == (8, 100e9 / 8, pytest.approx(3e-6))


def test_network_defaults_to_non_blocking_with_no_latency(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(GOOD)
    net = load_topology(p).network
    assert (net.bw_per_nic, net.latency, net.nvlink_domain_hosts) == (math.inf, 0.0, 1)


def test_from_cycle_names_the_chain(tmp_path):
    (tmp_path / "a.yaml").write_text("hosts:\n  - {from: b.yaml}\n")
    (tmp_path / "b.yaml").write_text("hosts:\n  - {from: a.yaml}\n")
    with pytest.raises(TopologyError) as e:
        load_topology(tmp_path / "a.yaml")
    assert str(e.value) == "a.yaml: 'from' cycle: a.yaml -> b.yaml -> a.yaml"


@pytest.mark.parametrize(
    "hosts, message",
    [
        ("  - {from: cpu.yaml}\n", "t.yaml: key 'hosts[0].from': 'cpu.yaml' is a cpu topology, this file is cuda"),
        ("  - {from: two.yaml, name: x}\n", "t.yaml: key 'hosts[0].name': 'two.yaml' has 2 hosts; 'name' needs exactly one"),
        (
            "  - {from: base.yaml}\n  - {from: base.yaml}\n",
            "t.yaml: key 'hosts': host name 'h' appears twice (use 'repeat' to number copies)",
        ),
        (
            "  - {from: base.yaml}\n  - {from: one-gpu.yaml}\n",
            "t.yaml: key 'hosts': host 'h1' has 1 devices but 'h' has 2; ranks are numbered host-major, so every host needs the same count",
        ),
        ("  - {from: base.yaml, color: red}\n", "t.yaml: key 'hosts[0].color': unknown key (known: from, name, repeat, ssd)"),
    ],
)
def test_host_entry_errors_across_files(tmp_path, hosts, message):
    (tmp_path / "base.yaml").write_text(GOOD)
    (tmp_path / "two.yaml").write_text("hosts:\n  - {from: base.yaml, repeat: 2}\n")
    (tmp_path / "one-gpu.yaml").write_text(GOOD.replace("name: h\n", "name: h1\n").replace("count: 2", "count: 1").replace("[0, 1]", "[0]"))
    (tmp_path / "cpu.yaml").write_text("compute_device: cpu\nhosts:\n  - {gpus: {count: 2}, numa_nodes: [{ddr_gb: 8, ddr_bw_gb_s: 10}]}\n")
    p = tmp_path / "t.yaml"
    p.write_text("hosts:\n" + hosts)
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert str(e.value) == message
