"""Topology files, the nvidia-smi importer and rank-pair bandwidths (fast: no torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sharding.topology.bandwidth import (
    bandwidth_matrix,
    host_to_gpu_bandwidth,
    nearest_nic,
    pair_bandwidth,
    shared_uplink_groups,
)
from sharding.topology.cluster import GB, TopologyError
from sharding.topology.topology_dump import dump_topology
from sharding.topology.topology_file import load_topology, shipped_topologies

GBs = 1e9

# name -> (world size, local world size, compute device, diagonal bandwidth GB/s)
SHIPPED = {
    "cpu-gloo": (2, 2, "cpu", 3),  # 6 GB/s of (effective, calibrated) DDR shared by 2 ranks
    "dgx-a100": (8, 8, "cuda", 2039),
    "dgx-a100-2host": (16, 8, "cuda", 2039),
    "dgx-a100-16host": (128, 8, "cuda", 2039),
    "dgx-a100-ssd": (8, 8, "cuda", 2039),  # dgx-a100 with an SSD tier (tests/unit/test_ssd_tier.py)
    "dgx-h100": (8, 8, "cuda", 3350),
    "dgx-h100-2host": (16, 8, "cuda", 3350),
    "dgx-h100-16host": (128, 8, "cuda", 3350),
    "gb200-nvl72": (72, 4, "cuda", 8000),
    "pcie-8gpu-2socket": (8, 8, "cuda", 864),
    "workstation-4gpu-nvlink-pairs": (4, 4, "cuda", 768),
}


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


def load_topology_text(text: str, name: str):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"{name}.yaml"
        p.write_text(text)
        return load_topology(p)


def test_nvlink_domain_across_hosts_gb200_nvl72():
    """GB200 NVL72: 18 trays in one NVLink domain. Every pair, across trays too, is NVLink at
    900 GB/s per direction and crosses no NIC; the same trays as two racks (two domains of 9)
    go through the NICs between racks; torchrec's Topology gets pod_size = 18."""
    from sharding.topology.links import build_links
    from sharding.planner.topology_planner import torchrec_topology

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


@pytest.mark.parametrize(
    "network,message",
    [
        ("{nvlink_domain_hosts: 4}", "key 'network.nvlink_domain_hosts': 4 does not divide the 18 hosts into whole NVLink domains"),
        ("{nvlink_domain_hosts: 0}", "key 'network.nvlink_domain_hosts'"),
    ],
)
def test_nvlink_domain_errors_name_the_key(network, message):
    text = (Path(__file__).resolve().parents[2] / "sharding/topologies/gb200-nvl72.yaml").read_text()
    text = text.split("network:")[0] + f"network: {network}\n"
    with pytest.raises(TopologyError, match=message):
        load_topology_text(text, "bad")


def test_nvlink_domain_needs_nvswitch_hosts():
    text = dump_topology(load_topology("dgx-a100-2host"))
    ok = load_topology_text(text.replace("latency_us: 2}", "latency_us: 2, nvlink_domain_hosts: 2}"), "ok")
    assert ok.same_nvlink_domain(0, 8)
    pcie = (Path(__file__).resolve().parents[2] / "sharding/topologies/pcie-8gpu-2socket.yaml").read_text()
    bad = pcie.replace("hosts:\n  - name: ", "hosts:\n  - repeat: 2\n    name: ", 1) + "network: {nvlink_domain_hosts: 2}\n"
    with pytest.raises(TopologyError, match="an NVLink domain across hosts needs NVSwitch hosts, but host"):
        load_topology_text(bad, "bad")


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
        (("compute_device: cuda", "compute_device: tpu"), "key 'compute_device': expected one of cuda, cpu, got 'tpu'"),
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
        (("hosts:", "hosts:\n  - {from: nope.yaml, repeat: 2}"), "key 'hosts[0].from': no such file 'nope.yaml'"),
        (("name: h", "name: h\n    repeat: 0"), "key 'hosts[0].repeat': expected an integer >= 1, got 0"),
        (("hosts:", "hosts: [\n"), "invalid YAML: line"),
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


def test_good_base_file_loads(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("name: t\ncompute_device: cuda\nhosts:" + GOOD_HOST)
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


@pytest.mark.parametrize("domain_hosts", [18, 9])
def test_table_row_wise_groups_follow_the_nvlink_domain(domain_hosts):
    """On an NVL72 (one domain of 18 trays, or two of 9) a table-row-wise table is cut over one
    domain's ranks (72 or 36 shards, as torchrec's pod_size makes it) and placed on them; its
    cross-group all-to-all is charged only between domains."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import ParameterConstraints

    from sharding.planner.topology_planner import TopologyAwarePlanner

    text = dump_topology(load_topology("gb200-nvl72")).replace("nvlink_domain_hosts: 18", f"nvlink_domain_hosts: {domain_hosts}")
    t = load_topology_text(text, "nvl")
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=2_000_000, feature_names=[f"f{i}"]) for i in range(3)],
        device=torch.device("meta"),
    )
    cons = {f"t{i}": ParameterConstraints(sharding_types=["table_row_wise"]) for i in range(3)}
    planner = TopologyAwarePlanner(t, batch_size=512, constraints=cons)
    plan = planner.plan(ebc, [planner_sharder()])
    group = 4 * domain_hosts
    for name, ps in plan.plan[""].items():
        ranks = sorted(int(p.placement.rank()) for p in ps.sharding_spec.shards)
        assert ps.sharding_type == "table_row_wise" and len(ranks) == group, (name, len(ranks))
        assert ranks == list(range(ranks[0], ranks[0] + group)) and ranks[0] % group == 0
    off = planner.cost_model.links.out_off_inv  # peers "off" a rank's group: other domains' only
    assert (float(off.sum()) == 0.0) == (domain_hosts == 18)
    assert planner.cost_model.twrw_groups[0] == tuple(range(group))


def planner_sharder():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder()


def test_a_host_group_inside_a_larger_domain_still_pays_its_all_to_all():
    """A table-row-wise group smaller than the NVLink domain (one tray, as a plan made without
    pod_size has it) sends its slices to the other 68 GPUs: charged on their NVLink ports; the
    whole-domain group has no peer outside and pays no all-to-all."""
    from sharding.planner.cost.model import TopologyCostModel

    m = TopologyCostModel(load_topology("gb200-nvl72"), 512)
    out, inn = m.off_group_inv((0, 1, 2, 3), 0)
    port = m.links.names.index("gb200-tray-0#0/gpu0.nvlink>out")
    assert out[port] == pytest.approx(68 / (900 * GBs)) and inn.sum() > 0
    whole, _ = m.off_group_inv(tuple(range(72)), 0)
    assert float(whole.sum()) == 0.0


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
