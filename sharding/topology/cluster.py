"""Hardware description of a training cluster: hosts, GPUs, NVLink, the PCIe tree, NUMA memory, NICs.

The dataclasses here hold bytes and bytes/s; bandwidths are one direction. The YAML file format,
in the units people write (GB, GB/s, Gb/s), is read by ``sharding/topology/topology_file.py``
(``load_topology``) and written by ``sharding/topology/topology_dump.py`` (``dump_topology``).

Ranks are numbered host-major: host ``h``, local GPU ``i`` -> rank ``h * local_world_size + i``.

Every problem in a file is a :class:`TopologyError` with a one-line message naming the file and the
key, e.g. ``dgx.yaml: key 'hosts[0].gpus[3].hbm_gb': expected a positive number, got 'abc'``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GB = 2**30  # capacities: "80 GB" of HBM is 80 GiB
GB_S = 1e9  # bandwidths: spec-sheet GB/s
GBIT_S = 1e9 / 8  # NIC line rates: Gb/s -> bytes/s

COMPUTE_DEVICES = ("cuda", "cpu")
NVLINK_KINDS = ("none", "nvswitch", "islands", "pairs")


class TopologyError(ValueError):
    """A bad topology file or nvidia-smi output; the message is one line and names the key or line."""


@dataclass(frozen=True)
class Gpu:
    """One rank's device. For ``compute_device: cpu`` the "GPU" is a CPU rank: no HBM (0), no PCIe
    switch; its memory is its NUMA node's DDR."""

    index: int  # local index on its host
    hbm_bytes: int
    hbm_bw: float  # bytes/s
    pcie_switch: str | None  # name of the switch it hangs from (None for CPU ranks)
    numa: int
    model: str = ""


@dataclass(frozen=True)
class PcieSwitch:
    """A PCIe switch (or a CPU root port, for a device attached directly: a switch of one).

    ``port_bw`` is each downstream port (the GPU's / NIC's own link), ``uplink_bw`` the link to the
    socket's root complex, which every device below the switch shares for traffic leaving it.
    ``parent`` names the switch its uplink plugs into (a two-level tree: ``PIX`` pairs behind a
    leaf switch inside a ``PXB`` group); None: the uplink goes to the root complex."""

    name: str
    numa: int
    uplink_bw: float
    port_bw: float
    gpus: tuple[int, ...] = ()
    nics: tuple[str, ...] = ()
    parent: str | None = None


@dataclass(frozen=True)
class NumaNode:
    index: int
    ddr_bytes: int
    ddr_bw: float


@dataclass(frozen=True)
class Nic:
    """A NIC used for the inter-host (compute) network. ``bw`` is its line rate in bytes/s."""

    name: str
    bw: float
    pcie_switch: str | None
    numa: int


@dataclass(frozen=True)
class NvlinkSpec:
    """NVLink connectivity inside one host.

    - ``nvswitch``: every GPU reaches every other through NVSwitch at ``links_per_gpu * link_bw``.
    - ``islands``: disjoint groups, each its own NVSwitch domain (or, for a group of two, a bridge),
      at ``links_per_gpu * link_bw``; nothing between islands.
    - ``pairs``: explicit point-to-point links ``(a, b, links)`` at ``links * link_bw``.
    - ``none``: no NVLink.
    """

    kind: str = "none"
    link_bw: float = 0.0  # one link, one direction, bytes/s
    links_per_gpu: int = 0
    islands: tuple[tuple[int, ...], ...] = ()
    pairs: tuple[tuple[int, int, int], ...] = ()

    def links(self, a: int, b: int) -> int:
        """Number of NVLink links usable between local GPUs a != b (0 if none)."""
        if a == b or self.kind == "none":
            return 0
        if self.kind == "nvswitch":
            return self.links_per_gpu
        if self.kind == "islands":
            return self.links_per_gpu if any(a in isl and b in isl for isl in self.islands) else 0
        return sum(n for x, y, n in self.pairs if {x, y} == {a, b})

    def bandwidth(self, a: int, b: int) -> float:
        return self.links(a, b) * self.link_bw


@dataclass(frozen=True)
class SsdSpec:
    """A host's SSD tier (NVMe drives holding embedding rows for FBGEMM's SSD kernels, torchrec's
    ``key_value`` kernel). One per host, shared by the host's ranks like its DDR: ``capacity``
    bytes in all, ``read_bw`` / ``write_bw`` bytes/s of the host's drives together. Reads and
    writes are separate figures because NVMe writes are typically half as fast as reads."""

    capacity: int  # bytes
    read_bw: float  # bytes/s
    write_bw: float  # bytes/s


@dataclass(frozen=True)
class Host:
    name: str
    gpus: tuple[Gpu, ...]
    nvlink: NvlinkSpec
    pcie_switches: tuple[PcieSwitch, ...]
    numa_nodes: tuple[NumaNode, ...]
    inter_socket_bw: float  # the socket-to-socket link (UPI / xGMI), one direction; inf if one socket
    nics: tuple[Nic, ...] = ()
    ssd: SsdSpec | None = None  # None: no SSD tier

    @property
    def ssd_bytes(self) -> int:
        """SSD capacity of the whole host (0 without an SSD tier): a per-host budget, like DDR."""
        return 0 if self.ssd is None else self.ssd.capacity

    def switch(self, name: str) -> PcieSwitch:
        for s in self.pcie_switches:
            if s.name == name:
                return s
        raise KeyError(name)

    def switch_chain(self, name: str) -> tuple[PcieSwitch, ...]:
        """The switch ``name`` and the switches above it (its parent, ...), leaf first."""
        out = [self.switch(name)]
        while out[-1].parent is not None:
            out.append(self.switch(out[-1].parent))
        return tuple(out)

    def gpus_below(self, name: str) -> tuple[int, ...]:
        """The GPUs on switch ``name`` or on a switch below it: they share its uplink."""
        if all(s.parent != name for s in self.pcie_switches):
            return self.switch(name).gpus
        return tuple(
            g.index for g in self.gpus if g.pcie_switch is not None and any(s.name == name for s in self.switch_chain(g.pcie_switch))
        )

    def numa(self, index: int) -> NumaNode:
        for n in self.numa_nodes:
            if n.index == index:
                return n
        raise KeyError(index)

    def nic(self, name: str) -> Nic:
        for n in self.nics:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def ddr_bytes(self) -> int:
        """Host memory of the whole host (all NUMA nodes): a per-host, not per-rank, budget."""
        return sum(n.ddr_bytes for n in self.numa_nodes)

    def gpus_on_numa(self, index: int) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus if g.numa == index)


@dataclass(frozen=True)
class Network:
    """The fabric between hosts. ``bw_per_nic`` caps what each NIC port gets through the fabric
    (inf: non-blocking, the NIC line rate rules); ``latency`` in seconds.

    ``nvlink_domain_hosts``: consecutive groups of this many hosts share one NVLink domain (an
    NVLink switch fabric between hosts, as in a GB200 NVL72 rack: 18 trays of 4 GPUs); GPUs of
    one domain reach each other over their NVLink ports, not the NICs. 1: NVLink ends at the host.
    torchrec's planner calls the same thing ``pod_size`` (hosts per pod)."""

    bw_per_nic: float = math.inf
    latency: float = 0.0
    nvlink_domain_hosts: int = 1


@dataclass(frozen=True)
class ClusterTopology:
    """A cluster's hardware: hosts (GPUs with HBM and links, NUMA nodes, NICs) and the network
    between them, as read from a topology YAML file (docs/topology.md). Ranks are host-major.

    Example::

        from sharding import TopologyAwarePlanner, load_topology
        cluster = load_topology("dgx-a100-2host")      # a shipped name or a YAML path
        cluster.world_size, cluster.local_world_size   # (16, 8)
        planner = TopologyAwarePlanner(cluster, batch_size=512)
    """

    hosts: tuple[Host, ...]
    network: Network = field(default_factory=Network)
    compute_device: str = "cuda"
    name: str = ""
    source: str = ""  # the file it came from, for messages

    @property
    def local_world_size(self) -> int:
        return len(self.hosts[0].gpus)

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.local_world_size

    def locate(self, rank: int) -> tuple[int, int]:
        """rank -> (host index, local GPU index); host-major numbering."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world size {self.world_size}")
        return divmod(rank, self.local_world_size)

    def rank(self, host: int, local: int) -> int:
        return host * self.local_world_size + local

    def host_of(self, rank: int) -> Host:
        return self.hosts[self.locate(rank)[0]]

    def gpu(self, rank: int) -> Gpu:
        h, i = self.locate(rank)
        return self.hosts[h].gpus[i]

    @property
    def ranks_per_nvlink_domain(self) -> int:
        """Ranks of one NVLink domain: a host's, or ``nvlink_domain_hosts`` hosts' (table-row-wise
        groups follow it, as torchrec's do with ``pod_size``)."""
        return self.local_world_size * self.network.nvlink_domain_hosts

    def nvlink_domain(self, host: int) -> int:
        """Index of the NVLink domain (pod) host ``host`` belongs to (hosts are grouped in order)."""
        return host // self.network.nvlink_domain_hosts

    def same_nvlink_domain(self, rank_a: int, rank_b: int) -> bool:
        """Whether two ranks on *different* hosts reach each other over NVLink (one domain)."""
        ha, hb = self.locate(rank_a)[0], self.locate(rank_b)[0]
        return ha != hb and self.nvlink_domain(ha) == self.nvlink_domain(hb)

    def ranks_on_numa(self, host: int, numa: int) -> tuple[int, ...]:
        """The ranks whose device sits on NUMA node ``numa`` of host ``host`` (they share its DDR)."""
        return tuple(self.rank(host, i) for i in self.hosts[host].gpus_on_numa(numa))

    def summary(self) -> str:
        h = self.hosts[0]
        parts = [
            f"{self.name or 'topology'}: {len(self.hosts)} host(s) x {self.local_world_size} "
            f"{self.compute_device} device(s) = world {self.world_size}",
            f"nvlink {h.nvlink.kind}",
            f"{len(h.pcie_switches)} PCIe switch(es)",
            f"{len(h.numa_nodes)} NUMA node(s), {h.ddr_bytes / GB:g} GB DDR per host",
            f"{len(h.nics)} NIC(s) per host",
        ]
        if h.ssd is not None:
            parts.append(
                f"{h.ssd.capacity / GB:g} GB SSD per host (read {h.ssd.read_bw / GB_S:g} GB/s, write {h.ssd.write_bw / GB_S:g} GB/s)"
            )
        return ", ".join(parts)
