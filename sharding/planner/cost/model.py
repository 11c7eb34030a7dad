"""A rank-aware step-time model of a placed embedding plan on a :class:`ClusterTopology`.

TorchRec's shard estimators do not know ranks; this model does. The embedding collectives are
synchronous (every rank waits for the slowest), so a step is the slowest rank's local work plus
the collectives, each phase as long as its busiest directed link:

    step = max_r (lookup[r] + host_io[r] + ssd_io[r]) + sum_phases max_links load[phase, link] + latency

- ``lookup``: bytes a rank's HBM-resident shards read and write (forward lookups, backward
  gradient + fused optimizer update: ``LOOKUP_PASSES`` x rows looked up x the row's bytes in
  whole 32-byte sectors, 64-byte cache lines on CPU; on GPUs plus ``GPU_INDEX_BYTES_PER_LOOKUP``
  per id and shard for the backward's id sort and the row-wise optimizer state, which a table cut
  into k column shards pays k times) over the device's memory bandwidth (HBM; DDR of its NUMA node
  on CPU ranks).
- ``host_io``: the rows' traffic for ``fused_uvm`` shards (all of it) and ``fused_uvm_caching``
  shards (the miss fraction: ``stats.expected_miss_rate(load_factor)`` when the table's
  ``CacheParams`` carry ``CacheStatistics``, e.g. measured from a data sample by
  ``sharding/planner/cache_sizing.py``; else ``1 - load_factor``, as torchrec's estimator assumes) goes to
  host memory over the GPU's PCIe path. Every link on that path is a shared resource: the GPU's port,
  its switch uplink (shared by the GPUs below the switch), the NUMA node's DDR and, when the
  memory lives on the other socket (its own node is full), the inter-socket link. A rank's
  ``host_io`` is the busiest resource on its paths (bytes on it / its bandwidth).
- ``ssd_io``: ``key_value`` shards (FBGEMM's SSD kernels, ``sharding/planner/ssd_tier.py``) keep their
  rows on the host's SSD behind an HBM cache. Hits are lookups as above (the hit fraction of
  the lookup bytes, over the device's memory bandwidth); every miss reads its row from SSD and,
  the cache being write-back and every looked-up row updated, evicts one updated row to SSD.
  With the miss rate ``m`` (``stats.expected_miss_rate(load_factor)`` when measured, else
  ``1 - load_factor``, as for ``fused_uvm_caching``), ``n`` rows looked up per step by the shard
  (``B x world x pooling x rows / table_rows``; ``B`` the batch per rank) and a row's bytes on
  SSD ``rb = cols x 4 + 4`` (fp32 weights + row-wise Adagrad's float, as memory is counted
  here), a host's SSD time is

      ssd[h] = sum_{key_value shards on h} m n rb / read_bw[h]  +  sum_{...} m n rb / write_bw[h]

  (the host's drives serve all its ranks: reads and writes of every shard on the host add up,
  like a NUMA node's DDR). ``ssd_io[r] = ssd[host(r)]`` for ranks holding a key_value shard, 0
  for the others. The missed rows' trip over PCIe and host memory is not charged (the SSD is
  the slower link), nor the SSD's page granularity (a row read costs a whole 4 KiB page).
- the collectives, on **directed, full-duplex links** (``sharding/topology/links.py``: a GPU's NVLink
  egress and ingress, each PCIe port and switch uplink up and down, each NIC's send and receive
  side and its fabric port, the socket link per direction; DDR is one resource). Every transfer
  adds bytes / bandwidth to each directed link of its path; a phase (one collective of one
  sharding type: torchrec shards each type separately) costs its busiest link. So a rank that
  sends and receives the same volume pays once, not twice. The transfers:
  table-/column-wise: every rank sends the owner its ids (input dist: int64 ids + int32
  lengths), the owner sends every rank its pooled slice (forward all-to-all), every rank sends
  the owner the slice's gradient (backward); a column-wise split sends the ids to every column
  shard, so splitting a table finer pays in ids what it saves in balance. Row-wise: ids
  bucketized over the group, a ring reduce-scatter (forward) and all-gather (backward) of the
  pooled partial sums ``[B x world, cols]``, each member sending ``(n-1)/n`` of it to the next.
  Table-row-wise: ids bucketized over the host's ranks, the ring inside the host, then each
  rank's slice to every rank off the host (forward) and back (backward). Data-parallel: a ring
  all-reduce of the gradient (``2 (n-1)/n`` x table bytes to the next member). Rings run as NCCL
  runs them (nccl-tests' doc/PERFORMANCE.md: an all-reduce of S bytes moves ``2 (n-1)/n x S``
  through every rank, reduce-scatter and all-gather ``(n-1)/n x S``, so ``t = that / busBW``):
  inside a host one ring over NVLink; across hosts one channel per NIC (``ring_channels``), each
  crossing between hosts through another GPU's NIC, so the bus bandwidth across hosts is the
  host's NICs together.
  Plus a fixed latency per collective: each sharding type present in the plan is its own group of
  collectives (input dist, forward and backward output dist) that every rank joins, so a plan
  mixing types pays for each (``collective_latency``).

Reading a plan, ``PlanCost.comm`` attributes the collectives to ranks (each phase's busiest link
among the rank's own first and last hops) and names each phase's busiest link.

Entry points: :class:`TopologyCostModel` (``score(sharding_options)``,
``score_sharding_plan(plan, tables)``, ``new_state()`` for incremental placement) and
:class:`TopologyPerfModel`, a torchrec ``PerfModel`` whose ``rate(plan)`` is the modeled step
time in milliseconds (the unit of torchrec's ``Perf``).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from torchrec.distributed.planner.types import PerfModel, ShardingOption
from torchrec.distributed.types import ShardingPlan

from sharding.topology.bandwidth import bandwidth_matrix
from sharding.topology.links import build_links
from sharding.constants import (
    A2A_TYPES,
    BYTES_PER_WEIGHT,
    ID_BYTES,
    LENGTH_BYTES,
    SSD_KERNELS,
    UNIFORM_TYPES,
    UVM_KERNELS,
)
from sharding.topology.cluster import ClusterTopology
from sharding.planner.cost.placement import PlacedShard, placed_from_option, placed_from_plan
from sharding.planner.cost.result import PlanCost
from sharding.planner.cost.contribution import Contribution
from sharding.planner.cost.state import CostState


BYTES = BYTES_PER_WEIGHT
# Latency of one collective (launch + synchronisation), not calibrated here (no GPU): nccl-tests'
# small-message all-to-all / all-reduce latencies are ~10-30 us inside a host; a collective that
# spans hosts adds the network's latency (topology ``network.latency_us``) and NIC/proxy overhead.
COLLECTIVE_LATENCY_S = 15e-6
CROSS_HOST_LATENCY_S = 10e-6
# gloo over loopback TCP: tools/bench/calibrate_cost_model.py measured 144-197 us for a tiny
# all-to-all between 2 ranks on the 2-core CI VM
CPU_COLLECTIVE_LATENCY_S = 170e-6
# A looked-up row moves at least one memory access granule: a 32-byte sector on a GPU, a 64-byte
# cache line on a CPU, so a 4-column fp32 shard (16 bytes a row) costs as much per lookup as an
# 8- or 16-column one. Measured on CPU (tools/bench/calibrate_cost_model.py, one rank, 26 dim-16 tables):
# the same tables cut into 2 and 4 column shards took 2.1x and 4.0x the time of whole tables.
GPU_ACCESS_GRANULE = 32
CPU_ACCESS_GRANULE = 64
# collectives per training step of one sharding type (input dist: splits, lengths, ids; output)
COLLECTIVES_PER_STEP = {
    "table_wise": 5,
    "column_wise": 5,
    "table_column_wise": 5,  # 3 input + fwd a2a + bwd a2a
    "row_wise": 5,  # 3 input + reduce-scatter + all-gather
    "table_row_wise": 7,  # 3 input + RS and AG in the host + fwd/bwd a2a across hosts
    "data_parallel": 1,  # the gradient all-reduce
}
LOOKUP_PASSES = 3  # forward read, backward gradient, optimizer read-modify-write (fused)
# Bytes per looked-up id and shard that FBGEMM's CUDA TBE moves whatever the shard's width (its
# kernels' structure, not calibrated here: no GPU on the CI machine). The forward reads the id
# (8 B); the backward linearizes the ids (8 B read, 8 + 4 B written), radix-sorts the (id,
# position) pairs (CUB, 8 bits a pass: about 4 passes of 12 B read and 12 B written for tables up
# to 2^32 rows), run-length encodes them (~16 B), and reads and writes each row's row-wise
# optimizer state (one float, a 32-byte sector each way). A table cut into k column shards does
# all of it k times, which is what makes fine column cuts of narrow tables cost more than their
# rows' bytes say.
GPU_INDEX_BYTES_PER_LOOKUP = 8 + 20 + 4 * 24 + 16 + 2 * GPU_ACCESS_GRANULE
_A2A = A2A_TYPES


class TopologyCostModel:
    def __init__(self, topo: ClusterTopology, batch_size_per_rank: int) -> None:
        self.topo = topo
        self.batch = int(batch_size_per_rank)
        self.world = w = topo.world_size
        self.cpu = topo.compute_device == "cpu"
        self.bw = bw = bandwidth_matrix(topo, shared=True)
        self.mem_bw = np.diag(bw).copy()  # the pair bandwidths (bandwidth.py, shared view) are for reading only
        self.host_of = np.array([topo.locate(r)[0] for r in range(w)])
        # table-row-wise groups: the ranks of one NVLink domain (one host unless hosts share one)
        g = topo.ranks_per_nvlink_domain
        self.twrw_groups = [tuple(range(d * g, (d + 1) * g)) for d in range(w // g)]
        base = CPU_COLLECTIVE_LATENCY_S if self.cpu else COLLECTIVE_LATENCY_S
        self.collective_latency = base + (CROSS_HOST_LATENCY_S + topo.network.latency if len(topo.hosts) > 1 else 0.0)
        self._placed_cache: dict[tuple, tuple] = {}
        self._contribution_cache: dict[tuple, tuple] = {}
        # the directed (full-duplex) links of every rank pair's path, for the collectives
        self.links = links = build_links(topo)
        mult = links.edge_links()
        # weightings of the links for the lower bound (bounds.py), each summing to 1: the links that
        # are some transfer's first or last hop; and, per bandwidth class, the links of that class
        # that some path crosses (on two DGX hosts: the 25 GB/s PCIe ports, NICs and fabric ports)
        used = np.zeros(links.count, dtype=bool)
        for row in links.path:
            for idx in row:
                used[idx] = True
        weights = [mult / mult.sum()] if mult.sum() else []
        for bw_class in np.unique(links.bw[used]):
            sel = used & (links.bw == bw_class)
            weights.append(sel / sel.sum())
        self.bound_weights = np.stack(weights, axis=1) if weights else np.zeros((links.count, 0))  # [links, n]
        self.attached = [
            np.unique(np.concatenate([links.first_hop[r][links.first_hop[r] >= 0], links.last_hop[:, r][links.last_hop[:, r] >= 0]]))
            for r in range(w)
        ]
        self._ring_cache: dict[tuple[int, ...], np.ndarray] = {}
        self._group_cache: dict[tuple[int, ...], tuple] = {}
        self._off_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._rows_cache: dict[bytes, dict[str, np.ndarray]] = {}  # insertion order = use order
        self._rows_bytes = 0
        self._norm2 = {"in": (links.in_inv**2).sum(axis=1), "out": (links.out_inv**2).sum(axis=1)}
        self._gram: dict[str, np.ndarray] = {}
        # host-memory resources: per GPU port, per switch uplink, per NUMA DDR, per socket link
        self.res_bw: list[float] = []
        self._res_index: dict[str, int] = {}
        self.local_path: list[list[int]] = []  # resources a rank's local-NUMA host traffic crosses
        self.numa_of: list[tuple[int, int]] = []
        for r in range(w):
            h, i = topo.locate(r)
            host, g = topo.hosts[h], topo.gpu(r)
            self.numa_of.append((h, g.numa))
            path = []
            if not self.cpu and g.pcie_switch is not None:
                s = host.switch(g.pcie_switch)
                path.append(self._res(f"{h}/port{i}", s.port_bw))
                path.append(self._res(f"{h}/{s.name}.uplink", s.uplink_bw))
            path.append(self._res(f"{h}/numa{g.numa}", host.numa(g.numa).ddr_bw))
            self.local_path.append(path)
        self.numa_cap = {(h, n.index): n.ddr_bytes for h, host in enumerate(topo.hosts) for n in host.numa_nodes}
        # the SSD tier per host (0: none; a key_value shard there costs infinite time)
        self.ssd_read_bw = np.array([h.ssd.read_bw if h.ssd else 0.0 for h in topo.hosts])
        self.ssd_write_bw = np.array([h.ssd.write_bw if h.ssd else 0.0 for h in topo.hosts])

    def _res(self, name: str, bw: float) -> int:
        if name not in self._res_index:
            self._res_index[name] = len(self.res_bw)
            self.res_bw.append(float(bw))
        return self._res_index[name]

    def remote_path(self, rank: int, numa: int) -> list[int]:
        """Resources for a rank's traffic to host memory on another NUMA node of its host."""
        h, i = self.topo.locate(rank)
        host = self.topo.hosts[h]
        path = self.local_path[rank][:-1]
        path.append(self._res(f"{h}/inter_socket", host.inter_socket_bw))
        path.append(self._res(f"{h}/numa{numa}", host.numa(numa).ddr_bw))
        return path

    @staticmethod
    def ssd_row_bytes(cols: int) -> int:
        """Bytes one row of a ``cols``-wide key_value shard moves to or from SSD: fp32 weights and
        row-wise Adagrad's one float of state (what ``CostState._memory`` counts per row)."""
        return cols * BYTES + BYTES

    def row_bytes(self, cols: int) -> int:
        """Bytes one lookup of a ``cols``-wide fp32 row moves: whole access granules."""
        g = CPU_ACCESS_GRANULE if self.cpu else GPU_ACCESS_GRANULE
        return -(-cols * BYTES // g) * g

    def lookup_bytes(self, cols: int) -> float:
        """Bytes of memory traffic per looked-up id of a ``cols``-wide shard in one training step:
        ``LOOKUP_PASSES`` passes over the row, plus the id handling of a CUDA TBE
        (``GPU_INDEX_BYTES_PER_LOOKUP``; FBGEMM's CPU kernels: counted in the row's passes, as
        measured by tools/bench/calibrate_cost_model.py)."""
        return LOOKUP_PASSES * self.row_bytes(cols) + (0 if self.cpu else GPU_INDEX_BYTES_PER_LOOKUP)

    def row_share(self, cols: int) -> float:
        """The share of ``lookup_bytes`` that is the rows themselves (what a UVM table's misses
        take to host memory; the id handling stays in HBM)."""
        return LOOKUP_PASSES * self.row_bytes(cols) / self.lookup_bytes(cols)

    def ids_bytes(self, pooling: float) -> float:
        """Input-dist bytes one rank sends per table shard: its batch's ids and bag lengths."""
        return self.batch * (pooling * ID_BYTES + LENGTH_BYTES)

    def type_latency(self, sharding_type: str) -> float:
        """Seconds per step that one sharding type's collectives add to every rank. Table-row-wise
        on a cluster that is one NVLink domain has no other domain to exchange slices with: its
        cross-domain all-to-alls run on one-rank groups (a local copy), so it pays row-wise's
        collectives, and the two price the same there."""
        if sharding_type == "table_row_wise" and len(self.twrw_groups) == 1:
            sharding_type = "row_wise"
        return COLLECTIVES_PER_STEP.get(sharding_type, 0) * self.collective_latency

    def ring_channels(self, group: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The rings NCCL runs a ring collective over ``group`` on, one per channel, each carrying
        an equal share of the data. Inside one host (or NVLink domain) a ring's links are the same
        whichever GPU it starts at: one ring. Across hosts NCCL builds one channel per NIC
        ("rail"), each ring crossing between hosts through a different NIC, so the cross-host
        part of the collective is spread over every NIC instead of the one NIC of a single ring.
        Here: with ``c`` members in the host (NVLink domain) holding fewest, channel ``k`` visits each host's
        members rotated by ``k`` (it enters a host at its ``k``-th member and leaves it from the
        one before), so the ``c`` channels leave each host from ``c`` different GPUs, i.e. over
        their nearest NICs (``sharding/topology/links.py``)."""
        per_domain = max(1, int(self.topo.network.nvlink_domain_hosts or 1))
        by_domain: dict[int, list[int]] = {}
        for r in group:
            by_domain.setdefault(int(self.host_of[r]) // per_domain, []).append(r)
        if len(by_domain) <= 1:
            return [group]
        c = min(len(m) for m in by_domain.values())
        return [tuple(r for members in by_domain.values() for r in members[k:] + members[:k]) for k in range(c)]

    def ring_rank_inv(self, group: tuple[int, ...], rank: int) -> np.ndarray:
        """Seconds per byte on each directed link when ``rank`` sends one byte to the ring's next
        member, averaged over the channels (``ring_channels``): its share of ``ring_inv``."""
        key = (group, rank)
        hit = self._ring_cache.get(key)
        if hit is None:
            rings = self.ring_channels(group)
            hit = np.zeros(self.links.count)
            for ring in rings:
                i = ring.index(rank)
                hit += self.links.pair_inv(rank, ring[(i + 1) % len(ring)])
            hit /= len(rings)
            self._ring_cache[key] = hit
        return hit

    def ring_inv(self, group: tuple[int, ...]) -> np.ndarray:
        """Seconds per byte on each directed link when every member of ``group`` sends one byte to
        the next member of the ring (the channels' average: ``ring_channels``)."""
        hit = self._ring_cache.get(group)
        if hit is None:
            hit = np.zeros(self.links.count)
            if len(group) > 1:
                for r in group:
                    hit += self.ring_rank_inv(group, r)
            self._ring_cache[group] = hit
        return hit

    def off_group_inv(self, group: tuple[int, ...], rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(out, in) seconds per byte per link of ``rank``'s transfers to / from every rank outside
        ``group``: the precomputed ``out_off_inv`` / ``in_off_inv`` when the group is a whole NVLink
        domain (the planner's table-row-wise groups), else summed for this group (a saved or
        torchrec-made plan whose groups are hosts inside a larger domain)."""
        L = self.links
        gs = len(self.twrw_groups[0])
        if len(group) == gs and group[0] % gs == 0 and group == self.twrw_groups[group[0] // gs]:
            return L.out_off_inv[rank], L.in_off_inv[rank]
        key = (group, rank)
        hit = self._off_cache.get(key)
        if hit is None:
            members = set(group)
            out, inn = np.zeros(L.count), np.zeros(L.count)
            for c in range(self.world):
                if c not in members:
                    out += L.pair_inv(rank, c)
                    inn += L.pair_inv(c, rank)
            hit = self._off_cache[key] = (out, inn)
        return hit

    def link_rows(self, cand: np.ndarray) -> dict[str, np.ndarray]:
        """``in_inv`` and ``out_inv`` restricted to the candidate ranks, transposed (``in`` /
        ``out``: [links, candidates], so the links a score reads are contiguous rows), with their
        maxima per link (``in_max`` / ``out_max``), for the greedy placement's vectorized scores:
        the same candidate list comes back shard after shard, and copying two [ranks, links]
        matrices was a large part of a big search's time. Read-only copies."""
        key = cand.tobytes()
        cache = self._rows_cache
        hit = cache.pop(key, None)
        if hit is None:
            L = self.links
            hit = {"in": np.ascontiguousarray(L.in_inv[cand].T), "out": np.ascontiguousarray(L.out_inv[cand].T)}
            # per link, the most any candidate adds to it per byte: bounds which links can set a
            # phase's new maximum (candidates.candidate_scores)
            hit["in_max"], hit["out_max"] = hit["in"].max(axis=1), hit["out"].max(axis=1)
            for a in hit.values():
                a.flags.writeable = False
            # least recently used out, within a byte budget: the lists of one host's ranks (a
            # table-column-wise table's later shards) alternate with the whole world's
            self._rows_bytes += sum(a.nbytes for a in hit.values())
            while cache and self._rows_bytes > ROWS_CACHE_BYTES:
                self._rows_bytes -= sum(a.nbytes for a in cache.pop(next(iter(cache))).values())
        cache[key] = hit  # now the most recent
        return hit

    def gram(self, which: str) -> np.ndarray:
        """``in_inv @ in_inv.T`` (``"in"``) or ``out_inv @ out_inv.T`` (``"out"``), [ranks, ranks]:
        what a shard on rank r adds to every rank's product with a phase's loads
        (``CostState.dots``). Computed when first asked for (the greedy placement's states)."""
        g = self._gram.get(which)
        if g is None:
            m = self.links.in_inv if which == "in" else self.links.out_inv
            g = self._gram[which] = m @ m.T
            g.flags.writeable = False
        return g

    def group_sums(self, group: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sums over ``group`` of ``in_inv``, ``out_off_inv`` and ``in_off_inv`` (memoized)."""
        hit = self._group_cache.get(group)
        if hit is None:
            idx = np.asarray(group)
            L = self.links
            hit = self._group_cache[group] = (L.in_inv[idx].sum(axis=0), L.out_off_inv[idx].sum(axis=0), L.in_off_inv[idx].sum(axis=0))
        return hit

    def a2a_loads(self, sharding_type: str, rank: int, cols: int, pooling: float) -> list[tuple[str, np.ndarray]]:
        """Directed-link loads (seconds) of a table-/column-wise shard owned by ``rank``: every
        other rank sends it its ids (input dist), it sends each its pooled slice (forward), each
        sends it the slice's gradient (backward)."""
        b = self.batch * cols * BYTES
        L = self.links
        return [
            (f"{sharding_type}:ids", self.ids_bytes(pooling) * L.in_inv[rank]),
            (f"{sharding_type}:fwd", b * L.out_inv[rank]),
            (f"{sharding_type}:bwd", b * L.in_inv[rank]),
        ]

    def new_state(self) -> CostState:
        return CostState(self)

    # --- scoring whole plans ------------------------------------------------------------------

    def score_shards(self, shards: Iterable[PlacedShard], bulk: Iterable[Contribution] = ()) -> PlanCost:
        """Whole-plan score. Table-/column-wise device-resident shards (the bulk) are summed per
        owner and their all-to-all applied as one matrix product; the rest go through ``add``;
        ``bulk``: row-wise / data-parallel tables already reduced to what they add."""
        st = self.new_state()
        ids_bytes = {t: np.zeros(self.world) for t in _A2A}  # per owner, by sharding type
        pooled_bytes = {t: np.zeros(self.world) for t in _A2A}
        lookup_bytes = np.zeros(self.world)
        pending: list[PlacedShard] = []  # consecutive shards of one non-A2A table, added together
        for s in shards:
            if s.sharding_type in _A2A and s.kernel not in SSD_KERNELS and (self.cpu or s.kernel not in UVM_KERNELS):
                st.mark_type(s.sharding_type)
                ids_bytes[s.sharding_type][s.rank] += self.ids_bytes(s.pooling)
                pooled_bytes[s.sharding_type][s.rank] += self.batch * s.cols * BYTES
                lookup_bytes[s.rank] += st._lookup_bytes(s)
                dev, host = st._memory(s)
                st.hbm_bytes[s.rank] += dev
                st.host_bytes[s.rank] += host
                if host:
                    st.numa_used[self.numa_of[s.rank]] += host
            else:
                if pending and (s.table != pending[0].table or s.sharding_type != pending[0].sharding_type):
                    st.add_many(pending)
                    pending = []
                pending.append(s)
        st.add_many(pending)
        for c in bulk:
            c.add_to(st)
        st.lookup += lookup_bytes / self.mem_bw
        L = self.links
        for t in _A2A:
            if ids_bytes[t].any() or pooled_bytes[t].any():
                st.add_load(f"{t}:ids", ids_bytes[t] @ L.in_inv)
                st.add_load(f"{t}:fwd", pooled_bytes[t] @ L.out_inv)
                st.add_load(f"{t}:bwd", pooled_bytes[t] @ L.in_inv)
        return st.cost()

    def score(self, plan: list[ShardingOption]) -> PlanCost:
        shards: list[PlacedShard] = []
        bulk: list[Contribution] = []
        for so in plan:
            c = self.contribution(so) if so.sharding_type in UNIFORM_TYPES else None
            if c is None:
                shards.extend(self.placed(so))
            else:
                bulk.append(c)
        return self.score_shards(shards, bulk)

    def forget_options(self) -> None:
        """Drops what ``placed`` and ``contribution`` keep per option (and the options with it)."""
        self._placed_cache.clear()
        self._contribution_cache.clear()

    def contribution(self, so: ShardingOption, in_order: bool = False) -> Contribution | None:
        """What a row-wise or data-parallel option adds to a state as placed now
        (``Contribution.of``; None where it depends on the state), memoized per option and
        ranks: 500 tables data-parallel on 128 ranks are 64,000 shards in every proposal."""
        cp = so.cache_params
        key = (id(so), so.name, so.sharding_type, so.compute_kernel, tuple(so.tensor.shape), len(so.shards))
        key += (tuple(so.input_lengths) if so.input_lengths else None,)
        key += (None if cp is None else (cp.load_factor, id(getattr(cp, "stats", None))),)
        # in_order: the caller just put shard i on rank i (the partitioner), no need to look
        ranks = list(range(len(so.shards))) if in_order else [sh.rank for sh in so.shards]
        hit = self._contribution_cache.get(key)
        if hit is None or hit[1] != ranks:
            if len(self._contribution_cache) > 100_000:
                self._contribution_cache.clear()
            hit = self._contribution_cache[key] = (Contribution.of(self, self.placed(so)), ranks, so, getattr(cp, "stats", None))
        return hit[0]

    def placed(self, so: ShardingOption) -> list[PlacedShard]:
        """``placed_from_option(so)``, memoized: a search scores the same options (a row-wise one
        has a shard per rank) with the same ranks again and again. The key holds everything the
        conversion reads; the option itself is kept referenced so its id is not reused."""
        cp = so.cache_params
        key = (
            id(so),
            so.name,
            so.sharding_type,
            so.compute_kernel,
            tuple(so.tensor.shape),
            tuple(so.input_lengths) if so.input_lengths else None,
            None if cp is None else (cp.load_factor, id(getattr(cp, "stats", None))),
            tuple((sh.rank, sh.size[0], sh.size[1]) for sh in so.shards),
        )
        hit = self._placed_cache.get(key)
        if hit is None:
            if len(self._placed_cache) > 200_000:
                self._placed_cache.clear()
            hit = self._placed_cache[key] = (placed_from_option(so), so, getattr(cp, "stats", None))
        return hit[0]

    def score_sharding_plan(self, plan: ShardingPlan, tables: dict[str, dict], pooling: dict[str, float] | None = None) -> PlanCost:
        """A ShardingPlan + ``{table: {num_embeddings, embedding_dim}}`` (plan_io.model_tables)."""
        return self.score_shards(placed_from_plan(plan, tables, pooling or {}))


ROWS_CACHE_BYTES = 64 * 2**20  # link_rows' copies kept (24 on 128 ranks x 1,280 links)


class TopologyPerfModel(PerfModel):
    """torchrec PerfModel: the modeled step time (ms) of a partitioned plan."""

    def __init__(self, cost_model: TopologyCostModel) -> None:
        self.cost_model = cost_model

    def rate(self, plan: list[ShardingOption]) -> float:
        return self.cost_model.score(plan).step_time * 1e3
