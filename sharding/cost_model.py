"""A rank-aware step-time model of a placed embedding plan on a :class:`ClusterTopology`.

TorchRec's shard estimators do not know ranks; this model does. It scores a set of placed shards
per rank and the step time is the slowest rank's:

    time[r] = lookup[r] + host_io[r] + comm[r]

- ``lookup``: bytes a rank's HBM-resident shards read and write (forward lookups, backward
  gradient + fused optimizer update: ``LOOKUP_PASSES`` x rows looked up x the row's bytes in
  whole 32-byte sectors, 64-byte cache lines on CPU) over the device's memory bandwidth (HBM; DDR
  of its NUMA node on CPU ranks).
- ``host_io``: the same traffic for ``fused_uvm`` shards (all of it) and ``fused_uvm_caching``
  shards (the miss fraction: ``stats.expected_miss_rate(load_factor)`` when the table's
  ``CacheParams`` carry ``CacheStatistics``, e.g. measured from a data sample by
  ``sharding/cache_sizing.py``; else ``1 - load_factor``, as torchrec's estimator assumes) goes to
  host memory over the GPU's PCIe path. Every link on that path is a shared resource: the GPU's port,
  its switch uplink (shared by the GPUs below the switch), the NUMA node's DDR and, when the
  memory lives on the other socket (its own node is full), the inter-socket link. A rank's
  ``host_io`` is the busiest resource on its paths (bytes on it / its bandwidth).
- ``comm``: the embedding collectives, from rank-pair bandwidths (``pair_bandwidth(shared=True)``).
  Table-/column-wise: every rank sends the owner its ids for the table (input dist: int64 ids +
  int32 lengths), the owner sends each other rank its pooled slice in the forward all-to-all and
  gets the gradient back in the backward; a pair's time is bytes / that pair's bandwidth and a
  rank's sends add up (its egress is shared). A column-wise split sends the ids to every column
  shard, so splitting a table finer pays in ids what it saves in balance. Row-wise: ids
  bucketized over the group, reduce-scatter (forward) + all-gather (backward) of the pooled output
  over a ring of the group, at the group's slowest pair. Table-row-wise: the same inside the
  host, then the host's slice to every other rank. Data-parallel: all-reduce of the gradient
  (ring, 2 (n-1)/n x table bytes) at the slowest pair.
  Plus a fixed latency per collective: each sharding type present in the plan is its own group of
  collectives (torchrec shards each type separately: input dist, forward and backward output
  dist) that every rank joins, so a plan mixing types pays for each (``collective_latency``).

Entry points: :class:`TopologyCostModel` (``score(sharding_options)``,
``score_sharding_plan(plan, tables)``, ``new_state()`` for incremental placement) and
:class:`TopologyPerfModel`, a torchrec ``PerfModel`` whose ``rate(plan)`` is the modeled step
time in milliseconds (the unit of torchrec's ``Perf``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

import numpy as np
from torchrec.distributed.planner.types import PerfModel, ShardingOption
from torchrec.distributed.types import ShardingPlan

from sharding.bandwidth import bandwidth_matrix
from sharding.constants import A2A_TYPES, BYTES_PER_WEIGHT, DEFAULT_LOAD_FACTOR, ID_BYTES, LENGTH_BYTES, UVM_KERNELS
from sharding.topology import ClusterTopology

BYTES = BYTES_PER_WEIGHT
# Latency of one collective (launch + synchronisation), not calibrated here (no GPU): nccl-tests'
# small-message all-to-all / all-reduce latencies are ~10-30 us inside a host; a collective that
# spans hosts adds the network's latency (topology ``network.latency_us``) and NIC/proxy overhead.
COLLECTIVE_LATENCY_S = 15e-6
CROSS_HOST_LATENCY_S = 10e-6
# gloo over loopback TCP: tools/calibrate_cost_model.py measured 144-197 us for a tiny
# all-to-all between 2 ranks on the 2-core CI VM
CPU_COLLECTIVE_LATENCY_S = 170e-6
# A looked-up row moves at least one memory access granule: a 32-byte sector on a GPU, a 64-byte
# cache line on a CPU, so a 4-column fp32 shard (16 bytes a row) costs as much per lookup as an
# 8- or 16-column one. Measured on CPU (tools/calibrate_cost_model.py, one rank, 26 dim-16 tables):
# the same tables cut into 2 and 4 column shards took 2.1x and 4.0x the time of whole tables.
GPU_ACCESS_GRANULE = 32
CPU_ACCESS_GRANULE = 64
# collectives per training step of one sharding type (input dist: splits, lengths, ids; output)
COLLECTIVES_PER_STEP = {
    "table_wise": 5, "column_wise": 5, "table_column_wise": 5,  # 3 input + fwd a2a + bwd a2a
    "row_wise": 5,  # 3 input + reduce-scatter + all-gather
    "table_row_wise": 7,  # 3 input + RS and AG in the host + fwd/bwd a2a across hosts
    "data_parallel": 1,  # the gradient all-reduce
}
LOOKUP_PASSES = 3  # forward read, backward gradient, optimizer read-modify-write (fused)
_A2A = A2A_TYPES


@dataclass(frozen=True)
class PlacedShard:
    """One shard of one table on one rank (the unit the model scores)."""

    table: str
    sharding_type: str  # torchrec ShardingType value
    kernel: str  # torchrec EmbeddingComputeKernel value
    rank: int
    rows: int
    cols: int
    table_rows: int
    table_cols: int
    pooling: float = 1.0  # sum of the table's features' pooling factors
    load_factor: float | None = None
    group: tuple[int, ...] = ()  # the ranks holding the table's shards (RW / TWRW / DP group)
    miss_rate: float | None = None  # fused_uvm_caching: measured miss rate at load_factor (None: 1 - load_factor)


@dataclass
class PlanCost:
    step_time: float  # seconds, max over ranks
    rank_time: np.ndarray  # seconds per rank
    lookup: np.ndarray
    host_io: np.ndarray
    comm: np.ndarray
    hbm_bytes: np.ndarray
    host_bytes: np.ndarray

    def as_dict(self) -> dict:
        return {
            "step_time_ms": self.step_time * 1e3,
            "rank_time_ms": [round(x * 1e3, 4) for x in self.rank_time],
            "max_hbm_bytes": int(self.hbm_bytes.max(initial=0)),
            "max_host_bytes_per_rank": int(self.host_bytes.max(initial=0)),
        }


class TopologyCostModel:
    def __init__(self, topo: ClusterTopology, batch_size_per_rank: int) -> None:
        self.topo = topo
        self.batch = int(batch_size_per_rank)
        self.world = w = topo.world_size
        self.cpu = topo.compute_device == "cpu"
        self.bw = bw = bandwidth_matrix(topo, shared=True)
        self.mem_bw = np.diag(bw).copy()
        inv = np.zeros_like(bw)
        off = ~np.eye(w, dtype=bool)
        inv[off] = 1.0 / bw[off]
        self.inv_bw = inv  # seconds per byte between distinct ranks, 0 on the diagonal
        self.inv_rowsum = inv.sum(axis=1)
        self.min_bw_all = float(bw[off].min()) if w > 1 else float("inf")
        self.host_ranks = [tuple(topo.rank(h, i) for i in range(topo.local_world_size)) for h in range(len(topo.hosts))]
        self.host_of = np.array([topo.locate(r)[0] for r in range(w)])
        base = CPU_COLLECTIVE_LATENCY_S if self.cpu else COLLECTIVE_LATENCY_S
        self.collective_latency = base + (CROSS_HOST_LATENCY_S + topo.network.latency if len(topo.hosts) > 1 else 0.0)
        self._min_bw_cache: dict[tuple[int, ...], float] = {}
        self._placed_cache: dict[tuple, tuple] = {}
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
        self.numa_cap = {
            (h, n.index): n.ddr_bytes for h, host in enumerate(topo.hosts) for n in host.numa_nodes
        }

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

    def group_min_bw(self, group: tuple[int, ...]) -> float:
        if len(group) <= 1:
            return float("inf")
        hit = self._min_bw_cache.get(group)
        if hit is None:
            if len(group) == self.world:
                hit = self.min_bw_all
            else:
                idx = np.array(group)
                sub = self.bw[np.ix_(idx, idx)]
                hit = float(sub[~np.eye(len(idx), dtype=bool)].min())
            self._min_bw_cache[group] = hit
        return hit

    def row_bytes(self, cols: int) -> int:
        """Bytes one lookup of a ``cols``-wide fp32 row moves: whole access granules."""
        g = CPU_ACCESS_GRANULE if self.cpu else GPU_ACCESS_GRANULE
        return -(-cols * BYTES // g) * g

    def ids_bytes(self, pooling: float) -> float:
        """Input-dist bytes one rank sends per table shard: its batch's ids and bag lengths."""
        return self.batch * (pooling * ID_BYTES + LENGTH_BYTES)

    def a2a_unit(self, cols: int, pooling: float) -> float:
        """Bytes between the owner of a table-/column-wise shard and each other rank per step:
        ids in, pooled slice out (forward), its gradient in (backward)."""
        return 2 * self.batch * cols * BYTES + self.ids_bytes(pooling)

    def type_latency(self, sharding_type: str) -> float:
        """Seconds per step that one sharding type's collectives add to every rank."""
        return COLLECTIVES_PER_STEP.get(sharding_type, 0) * self.collective_latency

    def new_state(self) -> "CostState":
        return CostState(self)

    # --- scoring whole plans ------------------------------------------------------------------

    def score_shards(self, shards: Iterable[PlacedShard]) -> PlanCost:
        """Whole-plan score. Table-/column-wise device-resident shards (the bulk) are summed per
        owner and their all-to-all applied as one matrix product; the rest go through ``add``."""
        st = self.new_state()
        owner_bytes = np.zeros(self.world)  # ids + 2 x pooled slice bytes per owner
        lookup_bytes = np.zeros(self.world)
        pending: list[PlacedShard] = []  # consecutive shards of one non-A2A table, added together
        for s in shards:
            if s.sharding_type in _A2A and (self.cpu or s.kernel not in UVM_KERNELS):
                st.mark_type(s.sharding_type)
                owner_bytes[s.rank] += self.a2a_unit(s.cols, s.pooling)
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
        st.lookup += lookup_bytes / self.mem_bw
        st.comm += self.inv_bw.T @ owner_bytes + owner_bytes * self.inv_rowsum
        return st.cost()

    def score(self, plan: list[ShardingOption]) -> PlanCost:
        return self.score_shards(p for so in plan for p in self.placed(so))

    def placed(self, so: ShardingOption) -> list[PlacedShard]:
        """``placed_from_option(so)``, memoized: a search scores the same options (a row-wise one
        has a shard per rank) with the same ranks again and again. The key holds everything the
        conversion reads; the option itself is kept referenced so its id is not reused."""
        cp = so.cache_params
        key = (id(so), so.name, so.sharding_type, so.compute_kernel, tuple(so.tensor.shape),
               tuple(so.input_lengths) if so.input_lengths else None,
               None if cp is None else (cp.load_factor, id(getattr(cp, "stats", None))),
               tuple((sh.rank, sh.size[0], sh.size[1]) for sh in so.shards))
        hit = self._placed_cache.get(key)
        if hit is None:
            if len(self._placed_cache) > 200_000:
                self._placed_cache.clear()
            hit = self._placed_cache[key] = (placed_from_option(so), so, getattr(cp, "stats", None))
        return hit[0]

    def score_sharding_plan(self, plan: ShardingPlan, tables: dict[str, dict], pooling: dict[str, float] | None = None) -> PlanCost:
        """A ShardingPlan + ``{table: {num_embeddings, embedding_dim}}`` (plan_io.model_tables)."""
        return self.score_shards(placed_from_plan(plan, tables, pooling or {}))


@dataclass
class CostState:
    """Per-rank accumulators, for scoring and for incremental (greedy) placement."""

    model: TopologyCostModel
    lookup: np.ndarray = field(init=False)
    comm: np.ndarray = field(init=False)
    res_bytes: np.ndarray = field(init=False)
    rank_res: list[set[int]] = field(init=False)
    hbm_bytes: np.ndarray = field(init=False)
    host_bytes: np.ndarray = field(init=False)
    numa_used: dict[tuple[int, int], int] = field(init=False)
    types: set[str] = field(init=False)  # sharding types present (their collectives' latency is in comm)

    def __post_init__(self) -> None:
        w = self.model.world
        self.lookup = np.zeros(w)
        self.comm = np.zeros(w)
        self.res_bytes = np.zeros(len(self.model.res_bw) + 8 * len(self.model.topo.hosts) + 8)
        self.rank_res = [set() for _ in range(w)]
        self.hbm_bytes = np.zeros(w)
        self.host_bytes = np.zeros(w)
        self.numa_used = {k: 0 for k in self.model.numa_cap}
        self.types = set()

    def mark_type(self, sharding_type: str) -> None:
        """The first shard of a sharding type brings its collectives' latency to every rank."""
        if sharding_type not in self.types:
            self.types.add(sharding_type)
            self.comm += self.model.type_latency(sharding_type)

    def new_type_latency(self, sharding_type: str) -> float:
        return 0.0 if sharding_type in self.types else self.model.type_latency(sharding_type)

    # traffic and comm of one shard ---------------------------------------------------------------

    def _lookup_bytes(self, s: PlacedShard) -> float:
        m = self.model
        if s.sharding_type == "data_parallel":
            return LOOKUP_PASSES * m.batch * s.pooling * m.row_bytes(s.cols)
        frac = s.rows / max(1, s.table_rows)  # row-wise shards see their share of the lookups
        return LOOKUP_PASSES * m.batch * m.world * s.pooling * m.row_bytes(s.cols) * frac

    def _host_fraction(self, s: PlacedShard) -> float:
        if self.model.cpu or s.kernel not in UVM_KERNELS:
            return 0.0
        if s.kernel == "fused_uvm":
            return 1.0
        if s.miss_rate is not None:
            return min(1.0, max(0.0, s.miss_rate))
        lf = DEFAULT_LOAD_FACTOR if s.load_factor is None else s.load_factor
        return max(0.0, 1.0 - lf)

    def _comm_vector(self, s: PlacedShard) -> np.ndarray | float:
        """Comm seconds this shard adds to every rank (vector) given its rank."""
        m, w, r = self.model, self.model.world, s.rank
        b = m.batch * s.cols * BYTES  # one rank's pooled slice of this shard, one direction
        idb = m.ids_bytes(s.pooling)  # one rank's ids for this table
        st = s.sharding_type
        if st in ("table_wise", "column_wise", "table_column_wise"):
            u = m.a2a_unit(s.cols, s.pooling)  # ids in, forward out, backward in, as seen by each peer
            v = u * m.inv_bw[r]
            v[r] = u * m.inv_rowsum[r]
            return v
        if st == "row_wise":
            g = s.group or tuple(range(w))
            n = len(g)
            # this shard's 1/n share of the ring reduce-scatter + all-gather of [B*W, cols], and of
            # the ids each rank bucketizes over the group (lengths go to every member)
            bw = m.group_min_bw(g)
            t = 2 * (m.batch * w * s.cols * BYTES) * (n - 1) / n / bw / n
            t += 2 * (idb - m.batch * LENGTH_BYTES + n * m.batch * LENGTH_BYTES) * (n - 1) / n / bw / n
            v = np.zeros(w)
            v[list(g)] = t
            return v
        if st == "table_row_wise":
            g = s.group or m.host_ranks[m.host_of[r]]
            n = len(g)
            # the whole ring reduce-scatter + all-gather inside the host, on this shard's rank
            t = 2 * (m.batch * w * s.cols * BYTES) * (n - 1) / n / m.group_min_bw(g)
            part = b / n  # this rank's slice of the host-reduced output, to every rank off-host
            off = m.host_of != m.host_of[r]
            v = (idb / n) * m.inv_bw[r]  # every rank's ids, bucketized over the host's n ranks
            v[r] = (idb / n) * m.inv_rowsum[r]
            v[off] += 2 * part * m.inv_bw[r][off]
            v[r] += t + 2 * part * m.inv_bw[r][off].sum()
            return v
        if st == "data_parallel":
            g = s.group or tuple(range(w))
            n = len(g)
            t = 2 * (n - 1) / n * s.rows * s.cols * BYTES / m.group_min_bw(g) if n > 1 else 0.0
            v = np.zeros(w)
            v[r] = t
            return v
        return 0.0

    def _memory(self, s: PlacedShard) -> tuple[float, float]:
        """(device bytes, host bytes): weights + row-wise optimizer state."""
        total = s.rows * s.cols * BYTES + s.rows * BYTES
        if self.model.cpu:
            return 0.0, float(total)
        if s.kernel == "fused_uvm":
            return 0.0, float(total)
        if s.kernel == "fused_uvm_caching":
            lf = DEFAULT_LOAD_FACTOR if s.load_factor is None else s.load_factor
            return s.rows * s.cols * BYTES * lf, float(total)
        return float(total), 0.0

    def host_path(self, s: PlacedShard, host_bytes: float) -> tuple[list[int], int]:
        """Resources the shard's host traffic crosses: its local NUMA node's memory, or another
        node of the host when the local one is full (then over the inter-socket link)."""
        m = self.model
        h, numa = m.numa_of[s.rank]
        if m.cpu or self.numa_used[(h, numa)] + host_bytes <= m.numa_cap[(h, numa)]:
            return m.local_path[s.rank], numa
        best = None
        for (hh, n), cap in m.numa_cap.items():
            if hh == h and n != numa and self.numa_used[(hh, n)] + host_bytes <= cap:
                best = n
                break
        return (m.local_path[s.rank], numa) if best is None else (m.remote_path(s.rank, best), best)

    def add(self, s: PlacedShard) -> None:
        m = self.model
        self.mark_type(s.sharding_type)
        lb = self._lookup_bytes(s)
        hf = self._host_fraction(s)
        self.lookup[s.rank] += lb * (1 - hf) / m.mem_bw[s.rank]
        self.comm += self._comm_vector(s)
        dev, host = self._memory(s)
        self.hbm_bytes[s.rank] += dev
        self.host_bytes[s.rank] += host
        if host:
            path, n = self.host_path(s, host)
            self.numa_used[(m.numa_of[s.rank][0], n)] += host
            self._grow()
            if hf:
                self.res_bytes[path] += lb * hf
                self.rank_res[s.rank].update(path)

    def twrw_delta(self, protos: list[PlacedShard], ranks: list[int]) -> np.ndarray:
        """Rank-time change if the device-resident table-row-wise shards ``protos`` (ranks
        ignored) went to ``ranks`` (one host, shard i on ranks[i]): lookups plus the ``add``
        comm of each shard, summed in closed form."""
        m, w = self.model, self.model.world
        s0 = protos[0]
        n = len(ranks)
        r = np.asarray(ranks)
        b = m.batch * s0.cols * BYTES
        t = 2 * (m.batch * w * s0.cols * BYTES) * (n - 1) / n / m.group_min_bw(tuple(ranks))
        part = b / n
        off = m.host_of != m.host_of[r[0]]
        ib = m.inv_bw[r][:, off]  # [n, off-host ranks]
        idb = m.ids_bytes(s0.pooling) / n
        delta = np.full(w, self.new_type_latency("table_row_wise"))
        delta += idb * m.inv_bw[r].sum(axis=0)
        delta[r] += idb * m.inv_rowsum[r]
        delta[off] += 2 * part * ib.sum(axis=0)
        rows = np.fromiter((p.rows for p in protos), dtype=np.float64, count=n)
        lb = LOOKUP_PASSES * m.batch * w * s0.pooling * m.row_bytes(s0.cols) * rows / max(1, s0.table_rows)
        np.add.at(delta, r, t + 2 * part * ib.sum(axis=1) + lb / m.mem_bw[r])
        return delta

    def add_many(self, shards: list[PlacedShard]) -> None:
        """``add`` for the shards of one row-wise or data-parallel table at once (same result up to
        float summation order); anything else, and host-memory shards, go through ``add``."""
        m = self.model
        if not shards:
            return
        s0 = shards[0]
        if (len(shards) < 4 or m.cpu or s0.kernel in UVM_KERNELS or s0.sharding_type not in ("row_wise", "data_parallel")
                or any(s.table != s0.table or s.cols != s0.cols or s.group != s0.group for s in shards)):
            for s in shards:
                self.add(s)
            return
        self.mark_type(s0.sharding_type)
        ranks = np.fromiter((s.rank for s in shards), dtype=np.int64, count=len(shards))
        rows = np.fromiter((s.rows for s in shards), dtype=np.float64, count=len(shards))
        if s0.sharding_type == "data_parallel":
            lb = np.full(len(shards), LOOKUP_PASSES * m.batch * s0.pooling * m.row_bytes(s0.cols))
            t = self._comm_vector(s0)[s0.rank]  # the same all-reduce on every rank of the group
            np.add.at(self.comm, ranks, t)
        else:
            lb = LOOKUP_PASSES * m.batch * m.world * s0.pooling * m.row_bytes(s0.cols) * rows / max(1, s0.table_rows)
            self.comm += len(shards) * self._comm_vector(s0)
        np.add.at(self.lookup, ranks, lb / m.mem_bw[ranks])
        np.add.at(self.hbm_bytes, ranks, rows * s0.cols * BYTES + rows * BYTES)

    def _grow(self) -> None:
        need = len(self.model.res_bw)
        if need > len(self.res_bytes):
            self.res_bytes = np.concatenate([self.res_bytes, np.zeros(need - len(self.res_bytes) + 8)])

    def host_io(self) -> np.ndarray:
        if not self.res_bytes.any():
            return np.zeros(self.model.world)
        bw = np.asarray(self.model.res_bw)
        t = self.res_bytes[: len(bw)] / bw
        return np.array([max((t[i] for i in rr), default=0.0) for rr in self.rank_res])

    def rank_time(self) -> np.ndarray:
        return self.lookup + self.host_io() + self.comm

    def cost(self) -> PlanCost:
        io = self.host_io()
        rt = self.lookup + io + self.comm
        return PlanCost(float(rt.max(initial=0.0)), rt, self.lookup.copy(), io, self.comm.copy(), self.hbm_bytes.copy(), self.host_bytes.copy())

    # greedy support ------------------------------------------------------------------------------

    def candidate_step_times(self, proto: PlacedShard, candidates: list[int]) -> np.ndarray:
        """The modeled step time if ``proto`` (its rank ignored) were placed on each candidate.
        Vectorized for device-resident shards; host-memory shards are evaluated one by one."""
        m = self.model
        base = self.rank_time()
        cand = np.asarray(candidates)
        hf = self._host_fraction(proto)
        if hf == 0.0 and proto.sharding_type in ("table_wise", "column_wise", "table_column_wise"):
            b = m.a2a_unit(proto.cols, proto.pooling)
            lb = self._lookup_bytes(proto)
            base = base + self.new_type_latency(proto.sharding_type)
            mat = base[None, :] + b * m.inv_bw[cand]  # [cand, world]
            own = base[cand] + lb / m.mem_bw[cand] + b * m.inv_rowsum[cand]
            mat[np.arange(len(cand)), cand] = own
            return mat.max(axis=1)
        out = np.empty(len(cand))
        for k, r in enumerate(cand):
            trial = self.copy()
            trial.add(_with_rank(proto, int(r)))
            out[k] = trial.rank_time().max()
        return out

    def copy(self) -> "CostState":
        c = CostState.__new__(CostState)
        c.model = self.model
        c.lookup = self.lookup.copy()
        c.comm = self.comm.copy()
        c.res_bytes = self.res_bytes.copy()
        c.rank_res = [set(x) for x in self.rank_res]
        c.hbm_bytes = self.hbm_bytes.copy()
        c.host_bytes = self.host_bytes.copy()
        c.numa_used = dict(self.numa_used)
        c.types = set(self.types)
        return c


def _with_rank(s: PlacedShard, rank: int) -> PlacedShard:
    from dataclasses import replace

    return replace(s, rank=rank)


# --- conversions --------------------------------------------------------------------------------


def _lf(cache_params) -> float | None:
    return None if cache_params is None else cache_params.load_factor


def _miss(kernel: str, cache_params) -> float | None:
    """The measured miss rate of a caching table (its CacheParams' stats at its load factor)."""
    if kernel != "fused_uvm_caching" or cache_params is None or getattr(cache_params, "stats", None) is None:
        return None
    lf = DEFAULT_LOAD_FACTOR if cache_params.load_factor is None else cache_params.load_factor
    return float(cache_params.stats.expected_miss_rate(lf))


def with_all_ranks(so: ShardingOption, rank: int) -> ShardingOption:
    """A light view of ``so`` with every shard on ``rank``, for ``placed_from_option`` (the
    partitioner and the bound score an option's shards before they have ranks)."""

    class _V:
        pass

    v = _V()
    v.__dict__.update(name=so.name, tensor=so.tensor, input_lengths=so.input_lengths, sharding_type=so.sharding_type,
                      compute_kernel=so.compute_kernel, cache_params=so.cache_params,
                      shards=[replace(sh, rank=rank) for sh in so.shards])
    return v  # type: ignore[return-value]


def placed_from_option(so: ShardingOption, rank_of=None) -> list[PlacedShard]:
    rows, cols = int(so.tensor.shape[0]), int(so.tensor.shape[1])
    pooling = float(sum(so.input_lengths)) if so.input_lengths else 1.0
    ranks = tuple(sh.rank for sh in so.shards if sh.rank is not None)
    group = ranks if so.sharding_type in ("row_wise", "table_row_wise", "data_parallel") else ()
    lf, miss = _lf(so.cache_params), _miss(so.compute_kernel, so.cache_params)
    out = []
    for sh in so.shards:
        if sh.rank is None:
            continue
        out.append(PlacedShard(so.name, so.sharding_type, so.compute_kernel, sh.rank, int(sh.size[0]), int(sh.size[1]),
                               rows, cols, pooling, lf, group, miss))
    return out


def placed_from_options(plan: list[ShardingOption]) -> list[PlacedShard]:
    return [p for so in plan for p in placed_from_option(so)]


def placed_from_plan(plan: ShardingPlan, tables: dict[str, dict], pooling: dict[str, float]) -> list[PlacedShard]:
    out = []
    for mplan in plan.plan.values():
        for name, ps in mplan.items():
            shape = tables[name]
            rows, cols = int(shape["num_embeddings"]), int(shape["embedding_dim"])
            lf, miss = _lf(ps.cache_params), _miss(ps.compute_kernel, ps.cache_params)
            pf = float(pooling.get(name, 1.0))
            if ps.sharding_spec is not None:
                shards = [(s.placement.rank(), s.shard_sizes[0], s.shard_sizes[1]) for s in ps.sharding_spec.shards]
            else:
                shards = [(r, rows, cols) for r in (ps.ranks or [])]
            ranks = tuple(r for r, _, _ in shards)
            group = ranks if ps.sharding_type in ("row_wise", "table_row_wise", "data_parallel") else ()
            for r, nr, nc in shards:
                out.append(PlacedShard(name, ps.sharding_type, ps.compute_kernel, r, int(nr), int(nc), rows, cols, pf, lf, group, miss))
    return out


class TopologyPerfModel(PerfModel):
    """torchrec PerfModel: the modeled step time (ms) of a partitioned plan."""

    def __init__(self, cost_model: TopologyCostModel) -> None:
        self.cost_model = cost_model

    def rate(self, plan: list[ShardingOption]) -> float:
        return self.cost_model.score(plan).step_time * 1e3
