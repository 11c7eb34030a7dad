"""Clusters small enough to price by hand, with round bandwidths: two hosts of two GPUs (one PCIe
switch with the host's NIC, NVSwitch between the GPUs, one NUMA node), and one host of two
sockets. The cost model's unit tests (tests/unit/sharding/planner/cost/) work their expected
figures out from these constants."""

from __future__ import annotations

import math

from sharding.planner.cost.placement import PlacedShard
from sharding.topology.cluster import ClusterTopology, Gpu, Host, Network, Nic, NumaNode, NvlinkSpec, PcieSwitch, SsdSpec

GB = 1e9
GIB = 2**30
HBM_BW = 1000 * GB
NVLINK_BW = 100 * GB  # one link per GPU, per direction
PORT_BW = 50 * GB  # each device's PCIe port, per direction
UPLINK_BW = 25 * GB  # the switch's uplink to the socket, shared by both GPUs
NIC_BW = 25 * GB  # one NIC per host, on the GPUs' switch
DDR_BW = 100 * GB
SSD_READ_BW, SSD_WRITE_BW = 4 * GB, 2 * GB


def host(name: str, *, nvlink: bool = True, ddr_bytes: float = 2**40, ssd: bool = False) -> Host:
    """Two 80 GiB GPUs on one PCIe switch with the host's NIC, NVSwitch between them (or no NVLink),
    one NUMA node of ``ddr_bytes``; with ``ssd`` a 1 TiB SSD tier."""
    sw = PcieSwitch("sw", 0, UPLINK_BW, PORT_BW, (0, 1), ("n0",))
    gpus = tuple(Gpu(i, 80 * GIB, HBM_BW, "sw", 0) for i in range(2))
    links = NvlinkSpec("nvswitch", NVLINK_BW, 1) if nvlink else NvlinkSpec()
    tier = SsdSpec(2**40, SSD_READ_BW, SSD_WRITE_BW) if ssd else None
    return Host(name, gpus, links, (sw,), (NumaNode(0, ddr_bytes, DDR_BW),), math.inf, (Nic("n0", NIC_BW, "sw", 0),), tier)


def two_hosts(
    *, latency: float = 0.0, ssd_on: tuple[bool, bool] = (False, False), ddr_bytes: float = 2**40, name: str = ""
) -> ClusterTopology:
    """Ranks 0, 1 on host a, 2, 3 on host b."""
    hosts = tuple(host(h, ddr_bytes=ddr_bytes, ssd=s) for h, s in zip("ab", ssd_on))
    return ClusterTopology(hosts, Network(latency=latency), **({"name": name} if name else {}))


def two_sockets(ddr_bytes: float = 2**30) -> ClusterTopology:
    """One host, GPU i on socket i behind its own switch; 10 GB/s between the sockets."""
    switches = tuple(PcieSwitch(f"sw{i}", i, UPLINK_BW, PORT_BW, (i,)) for i in range(2))
    gpus = tuple(Gpu(i, 80 * GIB, HBM_BW, f"sw{i}", i) for i in range(2))
    numa = tuple(NumaNode(i, ddr_bytes, DDR_BW) for i in range(2))
    return ClusterTopology((Host("h", gpus, NvlinkSpec(), switches, numa, 10 * GB),))


def shard(rank: int, rows: int = 1000, cols: int = 25, st: str = "table_wise", kernel: str = "fused", **kw) -> PlacedShard:
    """A shard of a 1000-row table (``table_rows`` to change it) of width ``cols`` (the whole table
    unless ``rows`` says less)."""
    kw.setdefault("table_rows", 1000)
    return PlacedShard(kw.pop("table", "t"), st, kernel, rank, rows, cols, kw.pop("table_rows"), cols, **kw)
