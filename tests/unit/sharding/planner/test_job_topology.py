"""sharding/planner/job_topology.py: the cluster a plan is for, torchrec's Topology of it, and a one-host plan moved
to another host's ranks."""

from __future__ import annotations

import logging

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from sharding.planner.job_topology import cluster_for, cluster_to_plan, cpu_topology_like, remap_plan_to_host, torchrec_topology
from sharding.planner.topology_planner import TopologyAwarePlanner
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
GIB = 1024**3


def test_torchrec_topology_of_a_dgx_a100_from_its_file():
    topology = torchrec_topology(load_topology("dgx-a100"))
    assert (topology.world_size, topology.local_world_size, topology.compute_device) == (8, 8, "cuda")
    # per rank: one A100's 80 GiB, an eighth of the host's 2 x 1 TiB, no SSD tier
    assert {(d.storage.hbm, d.storage.ddr, d.storage.ssd) for d in topology.devices} == {(80 * GIB, 256 * GIB, 0)}
    # bandwidths in bytes/ms: HBM 2039 GB/s, a NUMA node's DDR 204.8 GB/s, NVSwitch 300 GB/s,
    # host to GPU 12.5 GB/s (two GPUs share a 25 GB/s PCIe uplink)
    assert (topology.hbm_mem_bw, topology.ddr_mem_bw, topology.intra_host_bw, topology.hbm_to_ddr_mem_bw) == pytest.approx(
        (2039e6, 204.8e6, 300e6, 12.5e6)
    )
    # across hosts: one 200 Gb/s NIC per GPU
    assert torchrec_topology(load_topology("dgx-a100-2host")).inter_host_bw == pytest.approx(25e6)
    # capacities given by the caller win
    given = torchrec_topology(load_topology("dgx-a100"), hbm_bytes=10 * GIB, ddr_bytes=20 * GIB)
    assert {(d.storage.hbm, d.storage.ddr) for d in given.devices} == {(10 * GIB, 20 * GIB)}


def test_torchrec_topology_of_cpu_ranks_has_no_hbm():
    topology = torchrec_topology(load_topology("cpu-gloo"))
    assert (topology.world_size, topology.compute_device) == (2, "cpu")
    # the host's 16 GiB NUMA node shared by its 2 ranks; 6 GB/s
    assert {(d.storage.hbm, d.storage.ddr, d.storage.ssd) for d in topology.devices} == {(0, 8 * GIB, 0)}
    assert topology.ddr_mem_bw == pytest.approx(6e6)


def test_a_cpu_topology_resized_to_a_runs_ranks():
    three = cpu_topology_like(load_topology("cpu-gloo"), 3)
    assert (three.name, three.world_size, three.local_world_size, len(three.hosts)) == ("cpu-gloo-3", 3, 3, 1)
    assert [g.index for g in three.hosts[0].gpus] == [0, 1, 2]
    assert three.hosts[0].numa_nodes == load_topology("cpu-gloo").hosts[0].numa_nodes


def test_the_cluster_one_plan_is_for():
    two_hosts = load_topology("dgx-a100-2host")
    one = cluster_to_plan(two_hosts, hosts=2, world_size=None, from_job=False)
    assert (one.name, one.world_size, len(one.hosts)) == ("dgx-a100-2host-1host", 8, 1)
    assert cluster_to_plan(two_hosts, hosts=1, world_size=None, from_job=False) is two_hosts
    with pytest.raises(ValueError, match=r"^topology dgx-a100-2host: 2 hosts, the planner was given hosts=4$"):
        cluster_to_plan(two_hosts, hosts=4, world_size=None, from_job=False)
    cpu = load_topology("cpu-gloo")
    assert cluster_to_plan(cpu, hosts=1, world_size=4, from_job=False).name == "cpu-gloo-4"
    assert cluster_to_plan(cpu, hosts=1, world_size=2, from_job=False) is cpu
    # no process group here: a topology given by name keeps its size
    assert cluster_to_plan(cpu, hosts=1, world_size=None, from_job=True) is cpu
    # a GPU topology is never resized
    assert cluster_to_plan(load_topology("dgx-a100"), hosts=1, world_size=4, from_job=False).world_size == 8


def test_the_cluster_a_training_run_plans_for():
    assert cluster_for("", "cpu", 3, 3).name == "cpu-gloo-3"
    assert cluster_for("dgx-a100", "cuda", 8, 8).name == "dgx-a100"
    with pytest.raises(
        ValueError, match=r"^sharding.planner=topology on cuda needs sharding.topology \(a topology file or shipped name\)$"
    ):
        cluster_for("", "cuda", 8, 8)
    with pytest.raises(ValueError, match=r"^topology dgx-a100 is for cuda, the run is on cpu$"):
        cluster_for("dgx-a100", "cpu", 8, 8)
    with pytest.raises(ValueError, match=r"^topology dgx-a100 has 8 ranks \(8 per host\), the run has 16 \(8 per host\)$"):
        cluster_for("dgx-a100", "cuda", 16, 8)
    with pytest.raises(ValueError, match=r"^topology cpu-gloo has 2 ranks \(2 per host\), the run has 4 \(2 per host\)$"):
        cluster_for("cpu-gloo", "cpu", 4, 2)  # two CPU hosts: not one host resized


def _placements(plan) -> dict[str, list[str]]:
    return {t: [str(s.placement) for s in ps.sharding_spec.shards] for m in plan.plan.values() for t, ps in m.items()}


def test_a_one_host_plan_moved_to_host_1():
    plan = TopologyAwarePlanner("cpu-gloo", batch_size=64).plan(meta_ebc([(100, 16), (100, 16)]), [EmbeddingBagCollectionSharder()])
    before = _placements(plan)
    ranks = {t: ps.ranks for m in plan.plan.values() for t, ps in m.items()}
    assert sorted(p for ps in before.values() for p in ps) == ["rank:0/cpu", "rank:1/cpu"]
    moved = remap_plan_to_host(plan, host=1, ranks_per_host=2, device_type="cpu")
    assert sorted(p for ps in _placements(moved).values() for p in ps) == ["rank:2/cpu", "rank:3/cpu"]
    assert {t: ps.ranks for m in moved.plan.values() for t, ps in m.items()} == ranks  # host-local, for the sharders
    assert _placements(plan) == before  # a copy
    # on GPUs the device is the rank's local one
    on_gpu = remap_plan_to_host(plan, host=3, ranks_per_host=2, device_type="cuda")
    assert sorted(p for ps in _placements(on_gpu).values() for p in ps) == ["rank:6/cuda:0", "rank:7/cuda:1"]
