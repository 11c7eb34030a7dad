"""A torchrec ``Topology`` as a ClusterTopology (sharding/topology/from_torchrec.py): exactly what
torchrec's uniform cluster says, its bandwidths from bytes per millisecond to bytes per second."""

from __future__ import annotations

import math

import pytest
from torchrec.distributed.planner.types import Topology

from sharding.topology.bandwidth import host_to_gpu_bandwidth, pair_bandwidth
from sharding.topology.cluster import ClusterTopology, Gpu, Host, Network, Nic, NumaNode, NvlinkSpec, PcieSwitch
from sharding.topology.from_torchrec import cluster_from_torchrec

GIB = 2**30
PER_MS = 1000.0  # torchrec: bytes/ms


def _cuda(world: int, local: int) -> Topology:
    return Topology(
        world_size=world,
        local_world_size=local,
        compute_device="cuda",
        hbm_cap=16 * GIB,
        ddr_cap=64 * GIB,
        hbm_mem_bw=2e9,  # bytes/ms: 2 TB/s
        ddr_mem_bw=5e7,  # 50 GB/s
        intra_host_bw=3e8,  # 300 GB/s
        inter_host_bw=2.5e7,  # 25 GB/s
    )


def test_two_cuda_hosts_worked_by_hand():
    t = cluster_from_torchrec(_cuda(4, 2))

    def host(h: int) -> Host:
        return Host(
            name=f"host{h}",
            gpus=tuple(Gpu(i, 16 * GIB, 2e12, f"pcie{i}", 0, "torchrec") for i in range(2)),
            nvlink=NvlinkSpec("nvswitch", 3e11, 1),
            pcie_switches=tuple(PcieSwitch(f"pcie{i}", 0, 5e10, 5e10, (i,), (f"nic{i}",)) for i in range(2)),
            numa_nodes=(NumaNode(0, 2 * 64 * GIB, 5e10),),  # the ranks' DDR together
            inter_socket_bw=math.inf,
            nics=tuple(Nic(f"nic{i}", 2.5e10, f"pcie{i}", 0) for i in range(2)),
        )

    assert t == ClusterTopology((host(0), host(1)), Network(), "cuda", "torchrec-topology-4xcuda", "a torchrec Topology")
    # the bandwidths torchrec would use: intra-host, inter-host (its NIC per GPU), host memory to a device
    assert pair_bandwidth(t, 0, 1) == 300e9 and pair_bandwidth(t, 0, 2) == 25e9
    assert host_to_gpu_bandwidth(t, 3, shared=False) == 50e9


def test_one_host_has_no_nics():
    t = cluster_from_torchrec(_cuda(2, 2))
    assert len(t.hosts) == 1 and t.hosts[0].nics == ()
    assert [s.nics for s in t.hosts[0].pcie_switches] == [(), ()]


def test_cpu_ranks_have_no_hbm_pcie_or_nvlink():
    t = cluster_from_torchrec(Topology(world_size=2, compute_device="cpu", ddr_cap=8 * GIB, ddr_mem_bw=1e7))
    h = t.hosts[0]
    assert h.gpus == (Gpu(0, 0, 0.0, None, 0, "cpu"), Gpu(1, 0, 0.0, None, 0, "cpu"))
    assert (h.pcie_switches, h.nics, h.nvlink) == ((), (), NvlinkSpec())
    assert h.numa_nodes == (NumaNode(0, 16 * GIB, 1e10),)
    assert (t.compute_device, t.name) == ("cpu", "torchrec-topology-2xcpu")


def test_world_size_must_be_whole_hosts():
    with pytest.raises(ValueError, match=r"^torchrec Topology: world_size 3 is not a multiple of local_world_size 2$"):
        cluster_from_torchrec(_cuda(3, 2))
