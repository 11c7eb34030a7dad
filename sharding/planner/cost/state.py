"""Incremental scoring of a placement: :class:`CostState` accumulates, shard by shard, each rank's
lookup and host traffic and each collective phase's load on the directed links, so the
partitioner can price "this shard on that rank" without rescoring the plan. The formulas are the
ones :mod:`sharding.planner.cost.model`'s docstring states; the model's fixed inputs (bandwidths,
rings, link matrices) stay in :class:`~sharding.planner.cost.model.TopologyCostModel`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sharding.constants import A2A_TYPES, DEFAULT_LOAD_FACTOR, LENGTH_BYTES, SSD_KERNELS, UVM_KERNELS
from sharding.constants import BYTES_PER_WEIGHT as BYTES
from sharding.planner.cost.result import PlanCost
from sharding.planner.cost.placement import PlacedShard

_A2A = A2A_TYPES


@dataclass
class CostState:
    """Per-rank lookup and host-traffic accumulators, per-phase directed-link loads (seconds) of
    the collectives, for scoring and for incremental (greedy) placement."""

    model: Any  # the TopologyCostModel (sharding/planner/cost/model.py) whose inputs this state reads
    lookup: np.ndarray = field(init=False)
    loads: dict[str, np.ndarray] = field(init=False)  # phase -> seconds on each directed link
    latency: float = field(init=False)  # the collectives' latency of the sharding types present
    res_bytes: np.ndarray = field(init=False)
    rank_res: list[set[int]] = field(init=False)
    hbm_bytes: np.ndarray = field(init=False)
    host_bytes: np.ndarray = field(init=False)
    numa_used: dict[tuple[int, int], int] = field(init=False)
    types: set[str] = field(init=False)  # sharding types present (their collectives' latency is in comm)
    ssd_read: np.ndarray = field(init=False)  # bytes per step read from each host's SSD
    ssd_write: np.ndarray = field(init=False)  # bytes per step written back to each host's SSD
    ssd_ranks: np.ndarray = field(init=False)  # ranks holding a key_value shard (they wait for their host's SSD)
    ssd_bytes: np.ndarray = field(init=False)  # SSD storage per rank

    def __post_init__(self) -> None:
        w = self.model.world
        self.lookup = np.zeros(w)
        self.loads = {}
        self._stats: dict[str, tuple[float, float]] = {}
        # all-to-all phase -> every rank's link row (in_inv / out_inv, as the phase's shards load
        # them) times the phase's loads: what a candidate's spread needs (``_track_dots``)
        self.dots: dict[str, np.ndarray] = {}
        self.latency = 0.0
        self.res_bytes = np.zeros(len(self.model.res_bw) + 8 * len(self.model.topo.hosts) + 8)
        self.rank_res = [set() for _ in range(w)]
        self.hbm_bytes = np.zeros(w)
        self.host_bytes = np.zeros(w)
        self.numa_used = {k: 0 for k in self.model.numa_cap}
        self.types = set()
        nh = len(self.model.topo.hosts)
        self.ssd_read, self.ssd_write = np.zeros(nh), np.zeros(nh)
        self.ssd_ranks = np.zeros(w, dtype=bool)
        self.ssd_bytes = np.zeros(w)

    def mark_type(self, sharding_type: str) -> None:
        """The first shard of a sharding type brings its collectives' latency to every rank."""
        if sharding_type not in self.types:
            self.types.add(sharding_type)
            self.latency += self.model.type_latency(sharding_type)

    def new_type_latency(self, sharding_type: str) -> float:
        return 0.0 if sharding_type in self.types else self.model.type_latency(sharding_type)

    def add_load(self, phase: str, v: np.ndarray) -> None:
        cur = self.loads.get(phase)
        if cur is None:
            self.loads[phase] = np.array(v, dtype=np.float64)
        else:
            cur += v
        self._stats.pop(phase, None)
        self.dots.pop(phase, None)

    def _track_dots(self, s: PlacedShard, track: dict) -> None:
        """Keeps ``dots`` of an all-to-all shard's three phases: a shard on rank r adds coef x
        ``in_inv[r]`` (or ``out_inv[r]``) to a phase, so every rank's product with the phase's
        loads grows by coef x the Gram matrix's column r. Kept from a phase's first shard on
        (``add`` only), so they follow the state, not the order of questions asked of it."""
        m = self.model
        b = m.batch * s.cols * BYTES
        t = s.sharding_type
        for phase, coef, which in ((f"{t}:ids", m.ids_bytes(s.pooling), "in"), (f"{t}:fwd", b, "out"), (f"{t}:bwd", b, "in")):
            fresh, d = track[phase]
            if fresh:
                d = np.zeros(m.world)
            if d is not None:
                d += coef * m.gram(which)[:, s.rank]
                self.dots[phase] = d

    def _phase_stats(self, phase: str) -> tuple[float, float]:
        """(busiest link, sum of squares) of one phase's loads, kept until the phase changes: the
        greedy asks for every phase's at every shard, and changes three."""
        hit = self._stats.get(phase)
        if hit is None:
            v = self.loads[phase]
            hit = self._stats[phase] = (float(v.max(initial=0.0)), float((v * v).sum()))
        return hit

    def squares(self) -> float:
        """Sum over phases of the squared link loads (the links' part of ``spread``)."""
        return sum(self._phase_stats(p)[1] for p in self.loads)

    def load(self, phase: str) -> np.ndarray:
        cur = self.loads.get(phase)
        return np.zeros(self.model.links.count) if cur is None else cur

    def comm_time(self) -> float:
        """Every phase's busiest directed link, plus the collectives' latency."""
        return self.latency + sum(self._phase_stats(p)[0] for p in self.loads)

    @property
    def comm(self) -> np.ndarray:
        """The collectives' time as seen by each rank (the same for all: they wait for each other)."""
        return np.full(self.model.world, self.comm_time())

    # traffic and comm of one shard ---------------------------------------------------------------

    def _lookup_bytes(self, s: PlacedShard) -> float:
        m = self.model
        if s.sharding_type == "data_parallel":
            return m.batch * s.pooling * m.lookup_bytes(s.cols)
        frac = s.rows / max(1, s.table_rows)  # row-wise shards see their share of the lookups
        return m.batch * m.world * s.pooling * m.lookup_bytes(s.cols) * frac

    def _lookups(self, s: PlacedShard) -> float:
        """Rows the shard looks up per step (its share of every rank's ids)."""
        m = self.model
        if s.sharding_type == "data_parallel":
            return m.batch * s.pooling
        return m.batch * m.world * s.pooling * s.rows / max(1, s.table_rows)

    def _ssd_fraction(self, s: PlacedShard) -> float:
        """Share of a key_value shard's lookup bytes that its cache misses take to SSD instead of
        HBM (the misses' rows; 0 for other kernels)."""
        miss = self._ssd_miss_rate(s)
        return miss * self.model.row_share(s.cols) if miss else 0.0

    def _ssd_miss_rate(self, s: PlacedShard) -> float:
        """Share of a key_value shard's lookups that miss its HBM cache (0 for other kernels)."""
        if s.kernel not in SSD_KERNELS:
            return 0.0
        if s.miss_rate is not None:
            return min(1.0, max(0.0, s.miss_rate))
        lf = DEFAULT_LOAD_FACTOR if s.load_factor is None else s.load_factor
        return max(0.0, 1.0 - lf)

    def ssd_traffic(self, s: PlacedShard) -> float:
        """Bytes per step a key_value shard reads from SSD (its misses' rows), and as many it
        writes back (the updated rows they evict); 0 for other kernels."""
        miss = self._ssd_miss_rate(s)
        return miss * self._lookups(s) * self.model.ssd_row_bytes(s.cols) if miss else 0.0

    def ssd_seconds(self, host: int, read: float, write: float) -> float:
        """Seconds host ``host``'s drives take to read and write these bytes (inf without drives)."""
        m = self.model
        if not read and not write:
            return 0.0
        r = read / m.ssd_read_bw[host] if m.ssd_read_bw[host] else np.inf
        w = write / m.ssd_write_bw[host] if m.ssd_write_bw[host] else np.inf
        return float(r + w)

    def ssd_io(self) -> np.ndarray:
        """Per rank: its host's SSD time if it holds a key_value shard, else 0."""
        w = self.model.world
        if not self.ssd_ranks.any():
            return np.zeros(w)
        per_host = np.array([self.ssd_seconds(h, self.ssd_read[h], self.ssd_write[h]) for h in range(len(self.ssd_read))])
        return np.where(self.ssd_ranks, per_host[self.model.host_of], 0.0)

    def local_time(self) -> np.ndarray:
        """Each rank's own work: lookups, host traffic and SSD traffic (no collectives)."""
        lk = self.lookup + self.host_io()
        if self.ssd_ranks.any():
            lk = lk + self.ssd_io()
        return lk

    def _host_fraction(self, s: PlacedShard) -> float:
        """Share of a shard's lookup bytes that go to host memory: a UVM table's rows (all of them,
        or its cache's misses); the id handling stays in HBM."""
        if self.model.cpu or s.kernel not in UVM_KERNELS:
            return 0.0
        if s.kernel == "fused_uvm":
            miss = 1.0
        elif s.miss_rate is not None:
            miss = min(1.0, max(0.0, s.miss_rate))
        else:
            lf = DEFAULT_LOAD_FACTOR if s.load_factor is None else s.load_factor
            miss = max(0.0, 1.0 - lf)
        return miss * self.model.row_share(s.cols)

    def shard_loads(self, s: PlacedShard) -> list[tuple[str, np.ndarray]]:
        """The directed-link loads (seconds) this shard's collectives add, by phase."""
        m, w, r = self.model, self.model.world, s.rank
        L = m.links
        idb = m.ids_bytes(s.pooling)  # one rank's ids for this table
        st = s.sharding_type
        if st in _A2A:
            return m.a2a_loads(st, r, s.cols, s.pooling)
        if st == "row_wise":
            g = s.group or tuple(range(w))
            n = len(g)
            d = m.batch * w * s.cols * BYTES  # the pooled partial sums every member reduce-scatters
            frac = s.rows / max(1, s.table_rows)
            # every rank sends this shard its share of the ids (bucketized) and all the lengths
            ids = (idb - m.batch * LENGTH_BYTES) * frac + m.batch * LENGTH_BYTES
            ring = m.ring_rank_inv(g, r) * ((n - 1) / n * d) if n > 1 else np.zeros(L.count)
            return [("row_wise:ids", ids * L.in_inv[r]), ("row_wise:fwd", ring), ("row_wise:bwd", ring)]
        if st == "table_row_wise":
            g = s.group or m.twrw_groups[r // len(m.twrw_groups[0])]
            n = len(g)
            d = m.batch * w * s.cols * BYTES
            part = m.batch * s.cols * BYTES / n  # this rank's slice of the host-reduced output
            ring = m.ring_rank_inv(g, r) * ((n - 1) / n * d) if n > 1 else np.zeros(L.count)
            out_off, in_off = m.off_group_inv(g, r)
            return [
                ("table_row_wise:ids", (idb / n) * L.in_inv[r]),
                ("table_row_wise:fwd_rs", ring),
                ("table_row_wise:fwd_a2a", part * out_off),
                ("table_row_wise:bwd_a2a", part * in_off),
                ("table_row_wise:bwd_ag", ring),
            ]
        if st == "data_parallel":
            g = s.group or tuple(range(w))
            n = len(g)
            if n <= 1:
                return []
            return [("data_parallel:allreduce", m.ring_rank_inv(g, r) * (2 * (n - 1) / n * s.rows * s.cols * BYTES))]
        return []

    def _memory(self, s: PlacedShard) -> tuple[float, float]:
        """(device bytes, host bytes): weights + row-wise optimizer state (a key_value shard: its
        HBM cache, load_factor x weights; its SSD bytes are ``_ssd_bytes``)."""
        total = s.rows * s.cols * BYTES + s.rows * BYTES
        if s.kernel in SSD_KERNELS:
            lf = DEFAULT_LOAD_FACTOR if s.load_factor is None else s.load_factor
            return s.rows * s.cols * BYTES * lf, 0.0
        if self.model.cpu:
            return 0.0, float(total)
        if s.kernel == "fused_uvm":
            return 0.0, float(total)
        if s.kernel == "fused_uvm_caching":
            lf = DEFAULT_LOAD_FACTOR if s.load_factor is None else s.load_factor
            return s.rows * s.cols * BYTES * lf, float(total)
        return float(total), 0.0

    @staticmethod
    def _ssd_bytes(s: PlacedShard) -> float:
        """SSD storage of a key_value shard: weights + row-wise optimizer state (0 otherwise)."""
        return float(s.rows * s.cols * BYTES + s.rows * BYTES) if s.kernel in SSD_KERNELS else 0.0

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
        miss = self._ssd_fraction(s)
        self.lookup[s.rank] += lb * (1 - hf - miss) / m.mem_bw[s.rank]
        loads = self.shard_loads(s)
        track = {p: (p not in self.loads, self.dots.get(p)) for p, _ in loads} if s.sharding_type in _A2A else {}
        for phase, v in loads:
            self.add_load(phase, v)
        if track:
            self._track_dots(s, track)
        dev, host = self._memory(s)
        self.hbm_bytes[s.rank] += dev
        self.host_bytes[s.rank] += host
        if s.kernel in SSD_KERNELS:
            h = m.host_of[s.rank]
            io = self.ssd_traffic(s)
            self.ssd_read[h] += io
            self.ssd_write[h] += io
            self.ssd_ranks[s.rank] = True
            self.ssd_bytes[s.rank] += self._ssd_bytes(s)
        if host:
            path, n = self.host_path(s, host)
            self.numa_used[(m.numa_of[s.rank][0], n)] += host
            self._grow()
            if hf:
                self.res_bytes[path] += lb * hf
                self.rank_res[s.rank].update(path)

    def twrw_loads(self, protos: list[PlacedShard], ranks: list[int]) -> tuple[np.ndarray, list[tuple[str, np.ndarray]]]:
        """(lookup seconds per rank, link loads by phase) that the device-resident table-row-wise
        shards ``protos`` (ranks ignored) add if shard i goes to ``ranks[i]`` (one host), in
        closed form: the same as adding them one by one."""
        m, w = self.model, self.model.world
        L = m.links
        s0 = protos[0]
        n = len(ranks)
        r = np.asarray(ranks)
        g = tuple(int(x) for x in ranks)
        d = m.batch * w * s0.cols * BYTES
        part = m.batch * s0.cols * BYTES / n
        ring = m.ring_inv(g) * ((n - 1) / n * d) if n > 1 else np.zeros(L.count)
        idb = m.ids_bytes(s0.pooling) / n
        in_sum, out_off, in_off = m.group_sums(g)
        loads = [
            ("table_row_wise:ids", idb * in_sum),
            ("table_row_wise:fwd_rs", ring),
            ("table_row_wise:fwd_a2a", part * out_off),
            ("table_row_wise:bwd_a2a", part * in_off),
            ("table_row_wise:bwd_ag", ring),
        ]
        rows = np.fromiter((p.rows for p in protos), dtype=np.float64, count=n)
        lk = np.zeros(w)
        lb = m.batch * w * s0.pooling * m.lookup_bytes(s0.cols) * rows / max(1, s0.table_rows)
        np.add.at(lk, r, lb / m.mem_bw[r])
        return lk, loads

    def base_scores(self) -> tuple:
        """What ``step_time_with`` reads of the state, computed once for many trials."""
        lk = self.local_time()
        maxes = {p: float(v.max(initial=0.0)) for p, v in self.loads.items()}
        squares = {p: float((v * v).sum()) for p, v in self.loads.items()}
        return lk, self.comm_time(), sum(squares.values()), maxes, squares

    def step_time_with(
        self, lookup_delta: np.ndarray, loads: list[tuple[str, np.ndarray]], new_type: str | None = None, base: tuple | None = None
    ) -> tuple[float, float]:
        """(step time, spread) if the given lookups and link loads were added; spread (sum of
        squares of rank and link times) breaks ties towards even loads. ``base``: ``base_scores()``
        of this state, when many trials start from it."""
        lk0, comm, link_sq, maxes, squares = base if base is not None else self.base_scores()
        lk = lk0 + lookup_delta
        comm += self.new_type_latency(new_type) if new_type else 0.0
        spread = float((lk * lk).sum()) + link_sq
        merged: dict[str, np.ndarray] = {}
        for phase, v in loads:
            merged[phase] = merged.get(phase, 0.0) + v
        for phase, v in merged.items():
            cur = self.loads.get(phase)
            new = v if cur is None else cur + v
            comm += float(new.max(initial=0.0)) - maxes.get(phase, 0.0)
            spread += float((new * new).sum()) - squares.get(phase, 0.0)
        return float(lk.max(initial=0.0)) + comm, spread

    def bulk_ok(self, shards: list[PlacedShard]) -> bool:
        """Whether ``add_many`` adds these shards at once (one device-resident row-wise or
        data-parallel table, its whole group): then what they add does not depend on the state
        (``Contribution``)."""
        m = self.model
        if not shards:
            return False
        s0 = shards[0]
        return not (
            len(shards) < 4
            or m.cpu
            or s0.kernel in UVM_KERNELS + SSD_KERNELS
            or s0.sharding_type not in ("row_wise", "data_parallel")
            or any(s.table != s0.table or s.cols != s0.cols or s.group != s0.group for s in shards)
            or (s0.group and len(shards) != len(s0.group))
        )

    def add_many(self, shards: list[PlacedShard]) -> None:
        """``add`` for the shards of one row-wise or data-parallel table at once (same result up to
        float summation order); anything else, and host-memory shards, go through ``add``."""
        m = self.model
        if not shards:
            return
        if not self.bulk_ok(shards):
            for s in shards:
                self.add(s)
            return
        s0 = shards[0]
        self.mark_type(s0.sharding_type)
        L = m.links
        w = m.world
        ranks = np.fromiter((s.rank for s in shards), dtype=np.int64, count=len(shards))
        rows = np.fromiter((s.rows for s in shards), dtype=np.float64, count=len(shards))
        g = s0.group or tuple(range(w))
        n = len(g)
        if s0.sharding_type == "data_parallel":
            lb = np.full(len(shards), m.batch * s0.pooling * m.lookup_bytes(s0.cols))
            if n > 1:
                self.add_load("data_parallel:allreduce", m.ring_inv(g) * (2 * (n - 1) / n * s0.rows * s0.cols * BYTES))
        else:
            lb = m.batch * w * s0.pooling * m.lookup_bytes(s0.cols) * rows / max(1, s0.table_rows)
            idb = m.ids_bytes(s0.pooling)
            ids = (idb - m.batch * LENGTH_BYTES) * rows / max(1, s0.table_rows) + m.batch * LENGTH_BYTES
            self.add_load("row_wise:ids", ids @ L.in_inv[ranks])
            if n > 1:
                ring = m.ring_inv(g) * ((n - 1) / n * m.batch * w * s0.cols * BYTES)
                self.add_load("row_wise:fwd", ring)
                self.add_load("row_wise:bwd", ring)
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
        """Each rank's lookups and host traffic, plus the collectives' time (the same for all):
        its max is the step time."""
        return self.local_time() + self.comm_time()

    def step_time(self) -> float:
        return float(self.rank_time().max(initial=0.0))

    def spread(self) -> float:
        lk = self.local_time()
        return float((lk * lk).sum()) + sum(float((v * v).sum()) for v in self.loads.values())

    def cost(self) -> PlanCost:
        m = self.model
        io = self.host_io()
        ssd = self.ssd_io()
        comm_time = self.comm_time()
        attributed = np.full(m.world, self.latency)
        phases = {}
        for phase, v in self.loads.items():
            k = int(np.argmax(v)) if len(v) else 0
            phases[phase] = (m.links.names[k] if len(v) else "", float(v.max(initial=0.0)))
            for r in range(m.world):
                a = m.attached[r]
                attributed[r] += float(v[a].max(initial=0.0)) if len(a) else 0.0
        base = self.lookup + io + ssd
        rt = base + attributed
        return PlanCost(
            float(base.max(initial=0.0)) + comm_time,
            rt,
            self.lookup.copy(),
            io,
            attributed,
            self.hbm_bytes.copy(),
            self.host_bytes.copy(),
            comm_time,
            phases,
            ssd,
            self.ssd_bytes.copy(),
        )

    # greedy support: the candidates' scores are in sharding/planner/cost/candidates.py ----------------

    def copy(self) -> "CostState":
        c = CostState.__new__(CostState)
        c.model = self.model
        c.lookup = self.lookup.copy()
        c.loads = {k: v.copy() for k, v in self.loads.items()}
        c._stats = dict(self._stats)
        c.dots = {k: v.copy() for k, v in self.dots.items()}
        c.latency = self.latency
        c.res_bytes = self.res_bytes.copy()
        c.rank_res = [set(x) for x in self.rank_res]
        c.hbm_bytes = self.hbm_bytes.copy()
        c.host_bytes = self.host_bytes.copy()
        c.numa_used = dict(self.numa_used)
        c.types = set(self.types)
        c.ssd_read, c.ssd_write = self.ssd_read.copy(), self.ssd_write.copy()
        c.ssd_ranks, c.ssd_bytes = self.ssd_ranks.copy(), self.ssd_bytes.copy()
        return c
