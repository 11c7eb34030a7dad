"""A torchrec ``Topology`` as a :class:`ClusterTopology`, so ``TopologyAwarePlanner`` takes what
torchrec's ``EmbeddingShardingPlanner`` takes.

torchrec's ``Topology`` describes a uniform cluster: ``world_size`` ranks, ``local_world_size``
per host, each with its ``Storage`` (HBM, DDR, SSD) and one set of bandwidths in bytes per
millisecond: ``hbm_mem_bw``, ``ddr_mem_bw`` (host memory to a device), ``intra_host_bw`` (device
to device on a host) and ``inter_host_bw`` (per device across hosts: torchrec counts one NIC per
GPU). The cluster built here has exactly that and nothing more: per host, one GPU per rank with
its HBM, an NVSwitch-like fabric at ``intra_host_bw``, one PCIe switch per GPU at ``ddr_mem_bw``
holding that GPU's NIC at ``inter_host_bw`` (on multi-host clusters), one NUMA node with the
ranks' DDR, and a non-blocking network. CPU topologies have no HBM, PCIe or NVLink, as our own
CPU topologies. The torchrec ``Topology`` itself is what torchrec's planner plans on (its
capacities and reservations as given); the cluster only feeds our cost model.
"""

from __future__ import annotations

import math

from torchrec.distributed.planner.types import Topology

from sharding.topology.cluster import ClusterTopology, Gpu, Host, Network, Nic, NumaNode, NvlinkSpec, PcieSwitch

PER_MS = 1000.0  # torchrec's bandwidths are bytes per millisecond, ours bytes per second


def cluster_from_torchrec(topology: Topology) -> ClusterTopology:
    local = topology.local_world_size
    if local < 1 or topology.world_size % local:
        raise ValueError(f"torchrec Topology: world_size {topology.world_size} is not a multiple of local_world_size {local}")
    n_hosts = topology.world_size // local
    cpu = topology.compute_device == "cpu"
    hbm_bw, ddr_bw = topology.hbm_mem_bw * PER_MS, topology.ddr_mem_bw * PER_MS
    hosts = []
    for h in range(n_hosts):
        devices = topology.devices[h * local : (h + 1) * local]
        nics = () if cpu or n_hosts == 1 else tuple(Nic(f"nic{i}", topology.inter_host_bw * PER_MS, f"pcie{i}", 0) for i in range(local))
        gpus = tuple(
            Gpu(
                index=i,
                hbm_bytes=0 if cpu else int(d.storage.hbm),
                hbm_bw=0.0 if cpu else hbm_bw,
                pcie_switch=None if cpu else f"pcie{i}",
                numa=0,
                model="cpu" if cpu else "torchrec",
            )
            for i, d in enumerate(devices)
        )
        switches = (
            ()
            if cpu
            else tuple(
                PcieSwitch(name=f"pcie{i}", numa=0, uplink_bw=ddr_bw, port_bw=ddr_bw, gpus=(i,), nics=(f"nic{i}",) if nics else ())
                for i in range(local)
            )
        )
        nvlink = NvlinkSpec() if cpu else NvlinkSpec(kind="nvswitch", link_bw=topology.intra_host_bw * PER_MS, links_per_gpu=1)
        numa = (NumaNode(0, int(sum(d.storage.ddr for d in devices)), ddr_bw),)
        hosts.append(
            Host(name=f"host{h}", gpus=gpus, nvlink=nvlink, pcie_switches=switches, numa_nodes=numa, inter_socket_bw=math.inf, nics=nics)
        )
    return ClusterTopology(
        hosts=tuple(hosts),
        network=Network(),
        compute_device=topology.compute_device,
        name=f"torchrec-topology-{topology.world_size}x{topology.compute_device}",
        source="a torchrec Topology",
    )
