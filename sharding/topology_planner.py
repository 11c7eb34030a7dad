"""A topology-aware drop-in for torchrec's ``EmbeddingShardingPlanner``.

It is torchrec's planner (enumerator, shard estimators, proposers, storage reservation, plan
output) with these pieces swapped in through torchrec's extension points, i.e. the constructor
arguments of an ``EmbeddingShardingPlanner`` that ``plan()`` builds for each model (the
constraints depend on the model's tables; no private attribute is set from outside):

- the ``Topology`` is built from a :class:`ClusterTopology` (HBM per GPU, host memory per rank =
  host memory / ranks per host, bandwidths from the path model in ``sharding/bandwidth.py``);
- :class:`TopologyPartitioner` places shards greedily by the modeled step time of
  ``sharding/cost_model.py`` (rank-pair bandwidths, shared PCIe uplinks, NUMA placement) subject to
  HBM per rank and host memory per host; row-wise-in-host groups stay inside one host (its NVLink
  domain); then a local search (``refine_placement``) moves and swaps table-/column-wise shards
  while the modeled step time drops. After the search it also runs torchrec's
  ``GreedyPerfPartitioner`` on the chosen proposal and keeps the better of the two by the model,
  so it never does worse than torchrec's placement by that model;
- :class:`TopologyPerfModel` rates plans, so torchrec's search keeps the best plan by that model;
- :class:`TopologyEnumerator` (torchrec's enumerator, given as ``enumerator=``) enumerates with
  the model's constraints: the planner's defaults merged per table with the user's
  (``merge_constraints``), in a fixed order; the proposers (``default_proposers``, given as
  ``proposer=``) are torchrec's, the greedy ones with early stopping, the uniform one per table
  (``PerTableUniformProposer``: a table a constraint keeps off a type keeps its own choice);
- the search space gets column-wise variants cut into 2 and 4 column shards
  (``finer_column_splits``; torchrec cuts columns in blocks of 128, so a dim-16 or dim-128 table
  has no split of its own), and a last proposer (``sharding/balance_proposer.py``) starts from
  the best plan found and cuts the tables of its slowest rank finer while the model says it helps.

After the search, a callback raises the cache load factor of ``fused_uvm_caching`` tables into
the HBM left free on their ranks. With ``cache_stats`` (per-table id frequencies measured from
data, ``sharding/cache_sizing.py``) each such table starts at the smallest load factor reaching
``target_hit_rate``, the cost model charges its measured miss rate, and the callback stops where
its hit-rate curve stops rising. A model that cannot fit raises :class:`ModelDoesNotFitError`
(a torchrec ``PlannerError``) with a one-line message.

Speed (500 tables on 128 GPUs in ~10 s of CPU): torchrec's enumerator runs with memoized
estimator internals (``sharding/torchrec_speedups.py``, only while this planner plans); the
greedy proposers stop after ``greedy_patience_for(tables)`` fitting proposals that do not improve
(deterministic, unlike the 20 s timeout, which stays as a safety net); the partitioner adds
row-wise tables in bulk, scores table-row-wise hosts in closed form and memoizes option -> shards.

    planner = TopologyAwarePlanner(load_topology("dgx-a100-2host"), batch_size=512)
    plan = planner.plan(model_on_meta, sharders)       # or collective_plan(model, sharders, pg)
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
from typing import Mapping, Optional

import numpy as np
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.constants import POOLING_FACTOR
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    Partitioner,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Storage,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import CacheStatistics, ModuleSharder, ShardingPlan

from sharding.balance_proposer import BalanceProposer, BestPlanTracker
from sharding.bandwidth import host_to_gpu_bandwidth
from sharding.cache_sizing import DEFAULT_TARGET_HIT_RATE, apply_cache_stats, saturation_load_factor
from sharding.constants import A2A_TYPES, DEFAULT_LOAD_FACTOR, MAX_CACHE_LOAD_FACTOR, MODEL_PARALLEL_TYPES, UNIFORM_TYPES, UVM_KERNELS
from sharding.cost_model import CostState, PlacedShard, TopologyCostModel, TopologyPerfModel, placed_from_option
from sharding.cost_model import with_all_ranks as _with_all_ranks
from sharding.plan_cost import modeled_step, step_line
from sharding.tables import table_configs
from sharding.topology import ClusterTopology, load_topology
from sharding.torchrec_speedups import fast_planner_internals

logger = logging.getLogger(__name__)

GIB = 1024**3
# column-wise variants the planner adds: each device-resident table cut into 2 and 4 column shards
DEFAULT_COLUMN_SPLITS = (2, 4)
UNIFORM = UNIFORM_TYPES


class ModelDoesNotFitError(PlannerError):
    def __init__(self, message: str) -> None:
        super().__init__(message=message, error_type=PlannerErrorType.INSUFFICIENT_STORAGE)


def torchrec_topology(
    topo: ClusterTopology, hbm_bytes: int | None = None, ddr_bytes: int | None = None
) -> Topology:
    """A torchrec ``Topology`` for the cluster: capacities per rank (host memory is the host's
    divided by its ranks), bandwidths (bytes/ms, as torchrec wants) from the path model."""
    from sharding.bandwidth import bandwidth_matrix

    cpu = topo.compute_device == "cpu"
    w, lw = topo.world_size, topo.local_world_size
    bw = bandwidth_matrix(topo, shared=False)
    same = np.equal.outer(np.arange(w) // lw, np.arange(w) // lw)
    off = ~np.eye(w, dtype=bool)
    intra = float(bw[same & off].min()) if (same & off).any() else None
    inter = float(bw[~same].min()) if (~same).any() else None
    ddr = min(h.ddr_bytes for h in topo.hosts) // lw
    hbm = None if cpu else min(g.hbm_bytes for h in topo.hosts for g in h.gpus)
    hardware = HardwareConfig(
        hbm_cap_bytes=hbm_bytes if hbm_bytes is not None else hbm,
        ddr_cap_bytes=ddr_bytes if ddr_bytes is not None else ddr,
        intra_host_bw=None if intra is None else intra / 1e3,
        inter_host_bw=None if inter is None else inter / 1e3,
        hbm_mem_bw=None if cpu else min(g.hbm_bw for h in topo.hosts for g in h.gpus) / 1e3,
        ddr_mem_bw=min(n.ddr_bw for h in topo.hosts for n in h.numa_nodes) / 1e3,
        hbm_to_ddr_mem_bw=None if cpu else min(host_to_gpu_bandwidth(topo, r) for r in range(w)) / 1e3,
    )
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=w, local_world_size=lw),
        hardware_config=hardware,
        kernel_config=KernelConfig(compute_device=topo.compute_device, use_hardware_based_bandwidth=True),
    )


class TopologyPartitioner(Partitioner):
    """Greedy placement by modeled step time (see module docstring)."""

    def __init__(self, cost_model: TopologyCostModel, compare_default: bool = True, refine: bool = True) -> None:
        self.cost_model = cost_model
        self.compare_default = compare_default
        self.refine = refine
        self.last_storage_constraint: Topology | None = None

    def partition(
        self, proposal: list[ShardingOption], storage_constraint: Topology, hbm_per_device: Optional[int] = None
    ) -> list[ShardingOption]:
        self.last_storage_constraint = storage_constraint
        self._partition(proposal, storage_constraint, hbm_per_device)
        self.last = (id(proposal), _sig(proposal), self.cost_model.score(proposal).step_time)
        return proposal

    def cached_step_time(self, plan: list[ShardingOption]) -> float | None:
        last = getattr(self, "last", None)
        if last is not None and last[0] == id(plan) and last[1] == _sig(plan):
            return last[2]
        return None

    def compare_with_default(self, plan: list[ShardingOption]) -> list[ShardingOption]:
        """Re-place the chosen proposal with torchrec's GreedyPerfPartitioner and keep whichever
        placement the cost model prefers (so ours is never worse than torchrec's on it)."""
        sc = self.last_storage_constraint
        if not self.compare_default or sc is None:
            return plan
        ours = _ranks(plan)
        ours_cost = self.cost_model.score(plan).step_time
        _reset(plan)
        try:
            GreedyPerfPartitioner().partition(plan, sc)
            if self._fits_hosts(plan, sc) and self.cost_model.score(plan).step_time < ours_cost:
                return plan
        except PlannerError:
            pass
        _set_ranks(plan, ours)
        return plan

    # host memory is a per-host budget: torchrec's per-rank DDR split can be exceeded per rank
    def _fits_hosts(self, plan: list[ShardingOption], sc: Topology) -> bool:
        lw = sc.local_world_size
        used: dict[int, float] = {}
        for so in plan:
            for sh in so.shards:
                used[sh.rank // lw] = used.get(sh.rank // lw, 0) + sh.storage.ddr
        cap = {h: sum(d.storage.ddr for d in sc.devices[h * lw:(h + 1) * lw]) for h in range(sc.world_size // lw)}
        return all(u <= cap[h] for h, u in used.items())

    def _partition(
        self, proposal: list[ShardingOption], sc: Topology, hbm_per_device: Optional[int]
    ) -> list[ShardingOption]:
        m = self.cost_model
        w, lw = sc.world_size, sc.local_world_size
        if w != m.world:
            raise PlannerError(f"topology world size {m.world} != planner world size {w}", PlannerErrorType.OTHER)
        hbm_free = np.array([float(hbm_per_device or d.storage.hbm) for d in sc.devices])
        nh = w // lw
        host_free = np.array([sum(float(d.storage.ddr) for d in sc.devices[h * lw:(h + 1) * lw]) for h in range(nh)])
        host_of = np.arange(w) // lw
        st = m.new_state()
        _reset(proposal)

        def fits(rank: int, s: Storage) -> bool:
            return s.hbm <= hbm_free[rank] and s.ddr <= host_free[host_of[rank]]

        def take(rank: int, s: Storage) -> None:
            hbm_free[rank] -= s.hbm
            host_free[host_of[rank]] -= s.ddr

        def fail(so: ShardingOption, what: str) -> PlannerError:
            return PlannerError(
                f"{so.name} ({so.sharding_type}, {so.compute_kernel}): {what}", PlannerErrorType.PARTITION
            )

        # 1. uniform options (RW, DP): shard i on rank i, as torchrec does
        for so in proposal:
            if so.sharding_type in UNIFORM:
                if len(so.shards) != w:
                    raise fail(so, f"{len(so.shards)} shards for {w} ranks")
                for r, sh in enumerate(so.shards):
                    if not fits(r, sh.storage):
                        raise fail(so, f"shard does not fit on rank {r}")
                    take(r, sh.storage)
                    sh.rank = r
                st.add_many(m.placed(so))

        rest = [so for so in proposal if so.sharding_type not in UNIFORM]
        rest.sort(key=lambda so: (-sum(sh.perf.total for sh in so.shards), -sum(sh.storage.hbm + sh.storage.ddr for sh in so.shards), so.name))

        # 2. table-row-wise: one host (its NVLink domain), shard i on its rank i
        for so in rest:
            if so.sharding_type != "table_row_wise":
                continue
            if len(so.shards) != lw:
                raise fail(so, f"{len(so.shards)} shards for {lw} ranks per host")
            best = None
            fast = nh > 1 and not m.cpu and so.compute_kernel not in UVM_KERNELS
            if fast:  # device-resident: the step time on each host in closed form, no trial states
                protos = placed_from_option(_with_all_ranks(so, 0))
                base = st.base_scores()
            for h in range(nh):
                ranks = list(range(h * lw, (h + 1) * lw))
                if not all(sh.storage.hbm <= hbm_free[r] for r, sh in zip(ranks, so.shards)):
                    continue
                if sum(sh.storage.ddr for sh in so.shards) > host_free[h]:
                    continue
                if fast:
                    step, spread = st.step_time_with(*st.twrw_loads(protos, ranks), "table_row_wise", base=base)
                    key = (round(step, 12), spread, h)
                    if best is None or key < best[0]:
                        best = (key, h, None)
                    continue
                if nh == 1:
                    for r, sh in zip(ranks, so.shards):
                        sh.rank = r
                    for p in placed_from_option(so):
                        st.add(p)
                    best = (None, h, st)
                    break
                trial = st.copy()
                for r, sh in zip(ranks, so.shards):
                    sh.rank = r
                for p in placed_from_option(so):
                    trial.add(p)
                key = (round(trial.step_time(), 12), trial.spread(), h)
                if best is None or key < best[0]:
                    best = (key, h, trial)
            if best is None:
                raise fail(so, "no host has room for it")
            _, h, trial = best
            for r, sh in zip(range(h * lw, (h + 1) * lw), so.shards):
                sh.rank = r
                take(r, sh.storage)
            if trial is None:
                for p in m.placed(so):
                    st.add(p)
            else:
                st = trial

        # 3. table-/column-wise shards, heaviest first, each where the modeled step grows least
        for so in rest:
            if so.sharding_type == "table_row_wise":
                continue
            protos = placed_from_option(_with_all_ranks(so, 0))
            host_lock = None
            for sh, proto in zip(so.shards, protos):
                cands = [r for r in range(w) if fits(r, sh.storage) and (host_lock is None or host_of[r] == host_lock)]
                if not cands:
                    raise fail(so, f"a shard needing {sh.storage} fits on no rank")
                r = _pick(st, proto, cands)
                sh.rank = r
                take(r, sh.storage)
                st.add(dataclasses.replace(proto, rank=r))
                if so.sharding_type == "table_column_wise":
                    host_lock = host_of[r]
        if self.refine:
            refine_placement(st, [so for so in rest if so.sharding_type != "table_row_wise"], hbm_free, host_of)
        return proposal


REFINE_MAX_MOVES = 200
REFINE_SWAP_WORLD = 64  # swaps (pairs of shards) only up to this many ranks; moves always


def refine_placement(st: CostState, options: list[ShardingOption], hbm_free: np.ndarray, host_of: np.ndarray) -> int:
    """Local search after the greedy placement: move one device-resident table-/column-wise
    shard to another rank, or swap one on the bottleneck rank with one elsewhere, while that
    lowers the modeled step time (or keeps it and lowers the spread: the sum of squared rank and
    directed-link times, i.e. evens the loads out). Beyond ``REFINE_SWAP_WORLD`` ranks only moves
    off the bottleneck rank are tried (the rank whose lookups plus its own links' busiest loads
    are highest).

    Greedy placement (heaviest first, each shard where the step grows least) settles early
    shards before it knows the rest; on 26 Criteo tables on 16 ranks it ended ~7% above
    torchrec's own greedy placement, which this recovers. A shard's lookups and directed-link
    loads depend on its rank only (``a2a_loads``), so a move is scored in closed form. Returns
    the number of moves and swaps made; the shards' ranks and ``hbm_free`` are updated, ``st`` is
    not (the caller rescores the plan)."""
    m = st.model
    w = m.world
    L = m.links
    items = []  # (option, shard, ids bytes, pooled bytes, lookup bytes)
    for so in options:
        if so.sharding_type not in A2A_TYPES or so.compute_kernel != "fused":
            continue
        for proto, sh in zip(placed_from_option(_with_all_ranks(so, 0)), so.shards):
            items.append((so, sh, m.ids_bytes(proto.pooling), m.batch * proto.cols * 4.0, st._lookup_bytes(proto)))
    if len(items) < 2:
        return 0
    types = sorted({it[0].sharding_type for it in items})
    ttype = np.array([types.index(it[0].sharding_type) for it in items])
    idb = np.array([it[2] for it in items])
    pooled = np.array([it[3] for it in items])
    lkb = np.array([it[4] for it in items])
    hbm = np.array([float(it[1].storage.hbm) for it in items])
    rank = np.array([int(it[1].rank) for it in items])
    tcw = np.array([it[0].sharding_type == "table_column_wise" for it in items])
    # the phases the items load: (type index, coefficient per item, link matrix per rank)
    phases = []
    for ti, t in enumerate(types):
        for stage, coef, mat in (("ids", idb, L.in_inv), ("fwd", pooled, L.out_inv), ("bwd", pooled, L.in_inv)):
            phases.append((ti, f"{t}:{stage}", coef, mat))
    loads = [st.load(name).copy() for _, name, _, _ in phases]
    comm_other = st.comm_time() - sum(float(v.max(initial=0.0)) for v in loads)
    lk = st.lookup + st.host_io()
    chunk_trials = max(1, int(2e6 // max(1, L.count)))

    def evaluate(moves: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """(step, spread) of trials, each the same-index entries of ``moves``: (items, from, to)."""
        n = len(moves[0][0])
        lks = np.repeat(lk[None, :], n, axis=0)
        rows = np.arange(n)
        for i, a, b in moves:
            np.add.at(lks, (rows, a), -lkb[i] / m.mem_bw[a])
            np.add.at(lks, (rows, b), lkb[i] / m.mem_bw[b])
        step = lks.max(axis=1) + comm_other
        spread = (lks * lks).sum(axis=1)
        for (ti, _, coef, mat), cur in zip(phases, loads):
            hit = [(i, a, b) for i, a, b in moves if (ttype[i] == ti).any()]
            if not hit:
                step += float(cur.max(initial=0.0))
                spread += float((cur * cur).sum())
                continue
            new = np.repeat(cur[None, :], n, axis=0)
            for i, a, b in hit:
                c = np.where(ttype[i] == ti, coef[i], 0.0)[:, None]
                new += c * (mat[b] - mat[a])
            step += new.max(axis=1)
            spread += (new * new).sum(axis=1)
        return np.round(step, 12), spread

    def apply(i: int, a: int, b: int) -> None:
        lk[a] -= lkb[i] / m.mem_bw[a]
        lk[b] += lkb[i] / m.mem_bw[b]
        for (ti, _, coef, mat), cur in zip(phases, loads):
            if ttype[i] == ti:
                cur += coef[i] * (mat[b] - mat[a])

    def bottleneck() -> int:
        att = lk.copy()
        for cur in loads:
            att += np.array([float(cur[a].max(initial=0.0)) if len(a) else 0.0 for a in m.attached])
        return int(np.argmax(att))

    cur_key = evaluate([(np.array([0]), np.array([rank[0]]), np.array([rank[0]]))])
    cur = (float(cur_key[0][0]), float(cur_key[1][0]))
    changes = 0
    all_ranks = np.arange(w)
    for _ in range(REFINE_MAX_MOVES):
        slow = bottleneck()
        best = None
        movers = np.arange(len(items)) if w <= REFINE_SWAP_WORLD else np.flatnonzero(rank == slow)
        idx = np.repeat(movers, w)
        dest = np.tile(all_ranks, len(movers))
        ok = (dest != rank[idx]) & (hbm[idx] <= hbm_free[dest])
        ok &= ~tcw[idx] | (host_of[dest] == host_of[rank[idx]])
        idx, dest = idx[ok], dest[ok]
        for lo in range(0, len(idx), chunk_trials):
            i, d = idx[lo:lo + chunk_trials], dest[lo:lo + chunk_trials]
            step, spread = evaluate([(i, rank[i], d)])
            k = int(np.lexsort((spread, step))[0])
            key = (float(step[k]), float(spread[k]))
            if best is None or key < best[0]:
                best = (key, ("move", int(i[k]), int(d[k])))
        if w <= REFINE_SWAP_WORLD:
            others = np.flatnonzero((rank != slow) & ~tcw)
            for i in np.flatnonzero((rank == slow) & ~tcw):
                if not len(others):
                    break
                r2 = rank[others]
                fit = (hbm[i] <= hbm_free[r2] + hbm[others]) & (hbm[others] <= hbm_free[slow] + hbm[i])
                js, r2 = others[fit], r2[fit]
                for lo in range(0, len(js), chunk_trials):
                    j, rj = js[lo:lo + chunk_trials], r2[lo:lo + chunk_trials]
                    ii = np.full(len(j), i)
                    sl = np.full(len(j), slow)
                    step, spread = evaluate([(ii, sl, rj), (j, rj, sl)])
                    k = int(np.lexsort((spread, step))[0])
                    key = (float(step[k]), float(spread[k]))
                    if best is None or key < best[0]:
                        best = (key, ("swap", int(i), int(j[k])))
        if best is None or not best[0] < (cur[0], cur[1] * (1 - 1e-9)):
            break
        kind, i, x = best[1]
        if kind == "move":
            hbm_free[rank[i]] += hbm[i]
            hbm_free[x] -= hbm[i]
            apply(i, int(rank[i]), x)
            rank[i] = x
        else:
            r2 = int(rank[x])
            hbm_free[slow] += hbm[i] - hbm[x]
            hbm_free[r2] += hbm[x] - hbm[i]
            apply(i, slow, r2)
            apply(x, r2, slow)
            rank[i], rank[x] = r2, slow
        cur = best[0]
        changes += 1
    if changes:
        for it, r in zip(items, rank):
            it[1].rank = int(r)
    return changes


def _pick(st: CostState, proto: PlacedShard, cands: list[int]) -> int:
    """The candidate with the lowest resulting step time; ties: the lowest resulting spread (sum
    of squared rank and link times: evens loads, spreads host traffic over switches), then the
    lowest rank."""
    if len(cands) == 1:
        return cands[0]
    c = np.asarray(cands)
    maxes, sums = st.candidate_scores(proto, cands)
    lo = maxes.min()
    tol = 1e-9 * max(lo, 1e-12)
    ok = maxes <= lo + tol
    idx = np.flatnonzero(ok)
    best = idx[np.lexsort((c[idx], sums[idx]))[0]]
    return int(c[best])


def _sig(plan: list[ShardingOption]) -> tuple:
    return tuple(sh.rank for so in plan for sh in so.shards)


def _ranks(plan: list[ShardingOption]) -> list[list[int]]:
    return [[sh.rank for sh in so.shards] for so in plan]


def _set_ranks(plan: list[ShardingOption], ranks: list[list[int]]) -> None:
    for so, rs in zip(plan, ranks):
        for sh, r in zip(so.shards, rs):
            sh.rank = r


def _reset(plan: list[ShardingOption]) -> None:
    for so in plan:
        for sh in so.shards:
            sh.rank = None


class _CachedPerfModel(TopologyPerfModel):
    """TopologyPerfModel that reuses the partitioner's score of the plan it just placed."""

    def __init__(self, cost_model: TopologyCostModel, partitioner: TopologyPartitioner) -> None:
        super().__init__(cost_model)
        self.partitioner = partitioner
        self.tracker = BestPlanTracker(cost_model)

    def rate(self, plan: list[ShardingOption]) -> float:
        hit = self.partitioner.cached_step_time(plan)
        rating = hit * 1e3 if hit is not None else super().rate(plan)
        self.tracker.offer(plan, rating)
        return rating


class TopologyAwarePlanner(EmbeddingShardingPlanner):
    """A torchrec ``ShardingPlanner`` for a :class:`ClusterTopology` (see module docstring).

    ``topology``: a shipped name (``"dgx-a100"``, ``"cpu-gloo"``), a YAML path or a
    :class:`ClusterTopology`. ``batch_size`` is per rank, as for torchrec's planner.
    ``constraints``: torchrec ``ParameterConstraints`` per table, merged per table with the
    planner's defaults (model-parallel types, fused kernels, plus UVM / UVM caching on GPUs): a
    constraint on one table never changes another table's options, and fields left None on a
    constrained table (``sharding_types``, ``compute_kernels``) keep the defaults.

    ``hosts`` > 1 is for k-step merging (``recsys.KStepMergeHook``): every host holds a whole
    replica, so the plan is made for one host's ranks (the topology's first host if it lists
    ``hosts`` hosts) and ``collective_plan`` returns it with its placements moved to the calling
    rank's host, ready for ``DistributedModelParallel(env=<the host's ShardingEnv>)``. A CPU
    topology with one host is resized to the ranks it plans for: ``world_size`` ranks, or, for a
    topology given by name or path, the initialised process group's world size / ``hosts``
    (a ``ClusterTopology`` object is used as given).

    Example (in every rank of a torchrun job)::

        from sharding import TopologyAwarePlanner
        planner = TopologyAwarePlanner("cpu-gloo", batch_size=512)
        model = DistributedModelParallel(model, plan=planner.collective_plan(model, sharders), sharders=sharders)
        # or, offline on a meta-device model: planner.plan(model, sharders)
    """

    def __init__(
        self,
        topology: ClusterTopology | str | os.PathLike,
        batch_size: int,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        *,
        hosts: int = 1,
        world_size: int | None = None,
        hbm_bytes: int | None = None,
        ddr_bytes: int | None = None,
        compare_default: bool = True,
        tune_cache_load_factor: bool = True,
        timeout_seconds: int | None = 20,
        proposer=None,
        debug: bool = False,
        greedy_patience: int | None | str = "auto",
        cache_stats: Mapping[str, CacheStatistics] | None = None,
        target_hit_rate: float = DEFAULT_TARGET_HIT_RATE,
        column_splits: tuple[int, ...] = DEFAULT_COLUMN_SPLITS,
    ) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        self.hosts = int(hosts)
        self.column_splits = tuple(column_splits)
        self.search_space: list[ShardingOption] = []
        if isinstance(topology, ClusterTopology):  # used as given (the caller sized it), unless world_size
            self.cluster = _cluster_to_plan(topology, self.hosts, world_size, from_job=False)
        else:
            self.cluster = _cluster_to_plan(load_topology(topology), self.hosts, world_size, from_job=True)
        self.user_constraints: dict[str, ParameterConstraints] = dict(constraints or {})
        self.greedy_patience = greedy_patience
        self.cache_stats = dict(cache_stats or {})
        self.target_hit_rate = float(target_hit_rate)
        if not 0.0 < self.target_hit_rate <= 1.0:
            raise ValueError(f"target_hit_rate must be in (0, 1], got {target_hit_rate}")
        self.cost_model = TopologyCostModel(self.cluster, batch_size)
        self.partitioner = TopologyPartitioner(self.cost_model, compare_default=compare_default)
        perf_model = _CachedPerfModel(self.cost_model, self.partitioner)
        if proposer is None:
            proposer = default_proposers(greedy_patience)
            if self.column_splits:
                proposer.append(BalanceProposer(perf_model.tracker))
        callbacks = [self.partitioner.compare_with_default]
        if tune_cache_load_factor and self.cluster.compute_device != "cpu":
            callbacks.append(self._tune_load_factors)
        # What each plan() hands torchrec's planner through its constructor (the constraints and the
        # enumerator that holds them are per model: the defaults depend on the model's tables).
        self.torchrec_topology = torchrec_topology(self.cluster, hbm_bytes, ddr_bytes)
        self.batch_size_per_rank = int(batch_size)
        self.perf_model = perf_model
        self.proposers = proposer
        self.callbacks = callbacks
        self.timeout_seconds = timeout_seconds
        self.debug = debug
        self.constraints: dict[str, ParameterConstraints] = {}
        self.last_planner: EmbeddingShardingPlanner | None = None
        self.last_enumerator: TopologyEnumerator | None = None
        super().__init__(  # a valid torchrec planner of its own (collective_plan, isinstance checks)
            topology=self.torchrec_topology,
            batch_size=batch_size,
            enumerator=TopologyEnumerator(self.torchrec_topology, batch_size, self.column_splits),
            partitioner=self.partitioner,
            performance_model=perf_model,
            debug=debug,
            callbacks=callbacks,
            timeout_seconds=timeout_seconds,
            proposer=proposer,
        )

    @property
    def best_plan(self) -> list[ShardingOption] | None:
        """The sharding options of the latest plan (torchrec's planner keeps them as its best plan)."""
        return None if self.last_planner is None else self.last_planner._best_plan

    def constraints_for(self, module: nn.Module) -> dict[str, ParameterConstraints]:
        """The constraints a plan of ``module`` uses: the planner's defaults for every table,
        merged per table with the user's (``merge_constraints``), plus measured cache statistics."""
        types = [t for t in MODEL_PARALLEL_TYPES if self.hosts == 1 or t != "table_row_wise"]
        merged = merge_constraints(default_constraints(module, self.cluster.compute_device, types), self.user_constraints)
        if self.cache_stats:
            apply_cache_stats(merged, self.cache_stats, self.target_hit_rate)
        return merged

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """A plan for ``module`` on the planner's topology (one host's ranks when ``hosts`` > 1,
        with host-local placements; ``collective_plan`` moves them to the caller's host)."""
        # torchrec's planner, configured through its constructor for this model: our enumerator
        # (holding this model's constraints), partitioner, perf model, proposers and callbacks
        self.constraints = self.constraints_for(module)
        self.last_enumerator = TopologyEnumerator(self.torchrec_topology, self.batch_size_per_rank, self.column_splits,
                                                  self.constraints)
        self.last_planner = EmbeddingShardingPlanner(
            topology=self.torchrec_topology,
            batch_size=self.batch_size_per_rank,
            enumerator=self.last_enumerator,
            partitioner=self.partitioner,
            performance_model=self.perf_model,
            constraints=self.constraints,
            debug=self.debug,
            callbacks=self.callbacks,
            timeout_seconds=self.timeout_seconds,
            proposer=self.proposers,
        )
        self.perf_model.tracker.reset()
        try:
            with fast_planner_internals():
                plan = self.last_planner.plan(module, sharders)
        except ModelDoesNotFitError:
            raise
        except PlannerError as e:
            raise ModelDoesNotFitError(fit_message(self.cluster, module, self.torchrec_topology, e)) from None
        self.search_space = self.last_enumerator.last_search_space
        # The number the search minimised, for the plan it returns: the same function and inputs
        # as `recsys-plan show --topology` (sharding/plan_cost.py), so the two always agree.
        self.last_pooling = {c.name: float(sum(self.constraints[c.name].pooling_factors))
                             if c.name in self.constraints and self.constraints[c.name].pooling_factors
                             else POOLING_FACTOR for c in table_configs(module)}
        tables = {c.name: {"num_embeddings": c.num_embeddings, "embedding_dim": c.embedding_dim} for c in table_configs(module)}
        self.last_cost = modeled_step(plan, tables, self.cluster, self.cost_model.batch, self.last_pooling)
        logger.info("topology-aware plan: %s on %s", step_line(self.last_cost), self.cluster.name or "the topology")
        return plan

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: "dist.ProcessGroup | None" = None,
    ) -> ShardingPlan:
        """Plans on rank 0 of ``pg`` (default: the whole job) and broadcasts. With ``hosts`` > 1
        the plan is for one host's ranks and comes back with its shard placements moved to the
        calling rank's host (``remap_plan_to_host``): pass it to DMP with the host's ShardingEnv."""
        import torch.distributed as dist

        plan = super().collective_plan(module, sharders, pg)
        if self.hosts == 1:
            return plan
        world = dist.get_world_size()
        per_host = self.cluster.world_size
        if world != self.hosts * per_host:
            raise ValueError(
                f"planner plans {self.hosts} hosts x {per_host} ranks ({self.cluster.name or 'topology'}), "
                f"the job has {world} ranks")
        return remap_plan_to_host(plan, dist.get_rank() // per_host, per_host, self.cluster.compute_device)

    def _tune_load_factors(self, plan: list[ShardingOption]) -> list[ShardingOption]:
        """Raise each UVM-caching table's load factor into the HBM still free on its ranks
        (largest tables first), up to ``MAX_CACHE_LOAD_FACTOR``. Tables with measured cache
        statistics go first, by modeled miss traffic (lookups x dim x miss rate), and never past
        the load factor where their hit-rate curve stops rising (``saturation_load_factor``)."""
        sc = self.partitioner.last_storage_constraint
        if sc is None:
            return plan
        free = np.array([float(d.storage.hbm) for d in sc.devices])
        for so in plan:
            for sh in so.shards:
                free[sh.rank] -= sh.storage.hbm
        caching = [so for so in plan if so.compute_kernel == "fused_uvm_caching"]

        def stats_of(so):
            return None if so.cache_params is None else so.cache_params.stats

        def order(so):
            st = stats_of(so)
            if st is None:
                return (1, -so.tensor.shape[0] * so.tensor.shape[1], 0.0, so.name)
            lf0 = so.cache_params.load_factor if so.cache_params.load_factor is not None else DEFAULT_LOAD_FACTOR
            pooling = float(sum(so.input_lengths)) if so.input_lengths else 1.0
            return (0, -pooling * so.tensor.shape[1] * st.expected_miss_rate(lf0), 0.0, so.name)

        caching.sort(key=order)
        for so in caching:
            cp = so.cache_params
            lf = (cp.load_factor if cp is not None and cp.load_factor is not None else DEFAULT_LOAD_FACTOR)
            cap = MAX_CACHE_LOAD_FACTOR
            st = stats_of(so)
            if st is not None:
                cap = min(cap, saturation_load_factor(st))
            if lf >= cap:
                continue
            # extra HBM per shard for each +1.0 of load factor
            per = [(sh, sh.size[0] * sh.size[1] * 4) for sh in so.shards]
            room = min((free[sh.rank] / b if b else math.inf) for sh, b in per)
            new = min(cap, lf + 0.95 * room)
            new = math.floor(new * 100) / 100
            if new <= lf + 0.01:
                continue
            for sh, b in per:
                extra = b * (new - lf)
                free[sh.rank] -= extra
                sh.storage = Storage(hbm=int(sh.storage.hbm + extra), ddr=sh.storage.ddr, ssd=sh.storage.ssd)
            from torchrec.distributed.types import CacheParams

            so.cache_params = dataclasses.replace(cp, load_factor=new) if cp is not None else CacheParams(load_factor=new)
        return plan


_TYPE_ORDER = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise", "grid_shard", "data_parallel")
_KERNEL_ORDER = ("fused", "fused_uvm_caching", "fused_uvm", "dense", "quant", "key_value")


def finer_column_splits(enumerator, space: list[ShardingOption], splits: tuple[int, ...], world: int,
                        local_world: int) -> list[ShardingOption]:
    """Column-wise / table-column-wise variants of each device-resident option cut into ``k`` in
    ``splits`` equal column shards (at least 4 columns each, FBGEMM's alignment, and at most one
    shard per rank; per host for table-column-wise), estimated by the enumerator's estimators.

    torchrec cuts columns in blocks of ``min_partition`` (default 128), so tables of dim <= 128
    (all of a Criteo DLRM's) get one column shard, the same as table-wise: balance then comes
    in whole tables (26 tables on 8 or 16 ranks leave ranks with one table more than others).
    Tables whose ``ParameterConstraints.min_partition`` is set keep the user's choice. The cost
    model charges each column shard the table's ids (input dist), so finer is not free."""
    from torchrec.distributed.planner.types import Shard
    from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets

    cons = enumerator.constraints
    out: list[ShardingOption] = []
    for so in space:
        if so.sharding_type not in ("column_wise", "table_column_wise") or so.compute_kernel != "fused":
            continue
        c = cons.get(so.name)
        if c is not None and c.min_partition is not None:
            continue
        dim = int(so.tensor.shape[1])
        limit = local_world if so.sharding_type == "table_column_wise" else world
        for k in splits:
            part = dim // k
            if k <= len(so.shards) or k > limit or part < 4 or part % 4 or dim % k:
                continue
            sizes, offsets = calculate_shard_sizes_and_offsets(
                tensor=so.tensor, world_size=world, local_world_size=local_world, sharding_type=so.sharding_type,
                col_wise_shard_dim=part, device_memory_sizes=enumerator._device_memory_sizes)
            if len(sizes) != k:
                continue
            new = copy.copy(so)
            new.shards = [Shard(size=sz, offset=off) for sz, off in zip(sizes, offsets)]
            out.append(new)
    if out:
        enumerator.populate_estimates(out)
    return out


def _sorted_enumeration(enumerate_fn, extra=None):
    """The search space in a fixed order: tables as the enumerator first lists them, then sharding
    type, kernel, load factor, shard count. torchrec builds each table's types and kernels with
    ``list(set(...) & set(...))``, so its order (and with it the proposers' order and which of two
    equally rated plans wins) changed with PYTHONHASHSEED from one process to the next.
    ``extra(space)``: more options to add (before sorting)."""

    def run(*args, **kwargs):
        space = enumerate_fn(*args, **kwargs)
        if extra is not None:
            space = list(space) + extra(space)
        first: dict[str, int] = {}
        for so in space:
            first.setdefault(so.fqn, len(first))

        def key(so):
            st, k = so.sharding_type, so.compute_kernel
            return (first[so.fqn], _TYPE_ORDER.index(st) if st in _TYPE_ORDER else len(_TYPE_ORDER), st,
                    _KERNEL_ORDER.index(k) if k in _KERNEL_ORDER else len(_KERNEL_ORDER), k,
                    so.cache_load_factor if so.cache_load_factor is not None else -1.0, len(so.shards))

        return sorted(space, key=key)

    return run


def greedy_patience_for(num_tables: int) -> int | None:
    """How many consecutive fitting-but-worse proposals a greedy proposer may make before it
    stops (torchrec's ``GreedyProposer(threshold=...)``): 2000 / tables, within [4, 50].

    torchrec's greedy proposers walk from each table's fastest option (by torchrec's estimate)
    towards smaller ones, one table per proposal, for memory; once a proposal fits, later ones
    trade speed for memory and rarely win. Measured without a limit: on the quick benchmark
    (26 tables, 8-16 GPUs) the first greedy proposer's ~360 proposals never beat the best plan,
    which came from the second proposer's first few; on 500 tables x 128 GPUs the first fitting
    proposal of each greedy proposer was its best (of 33 tried in 60 s). Proposals that do not
    fit do not count, so a model that needs many steps to fit still gets them. A count instead of
    the wall-clock timeout (still there, 20 s, as a safety net) keeps plans deterministic on a
    loaded machine: with only the timeout, a busy 2-core machine cut the 16-GPU DeepFM search
    early and returned a 0.88 ms plan instead of 0.63 ms."""
    return max(4, min(50, 2000 // max(1, num_tables)))


class PatientGreedyProposer(GreedyProposer):
    """torchrec's ``GreedyProposer`` whose early-stopping threshold is chosen when it sees the
    search space: ``greedy_patience_for(tables)`` with ``patience="auto"``, else ``patience``."""

    def __init__(self, use_depth: bool = True, patience: int | None | str = "auto") -> None:
        super().__init__(use_depth=use_depth, threshold=None if patience == "auto" else patience)  # type: ignore[arg-type]
        self.patience = patience

    def load(self, search_space: list[ShardingOption], enumerator=None) -> None:
        super().load(search_space, enumerator)
        if self.patience == "auto":
            self._threshold = greedy_patience_for(len({so.name for so in search_space}))


class PerTableUniformProposer(UniformProposer):
    """torchrec's ``UniformProposer`` (one plan per sharding type, every table of that type),
    except that a table without the type (a user constraint excludes it) keeps its own best
    option instead of cancelling the type's plan for all tables.

    torchrec proposes a type's uniform plan only if every table offers it, so constraining one
    table to ``column_wise`` removed the "all table-column-wise" plan the planner chose without
    constraints, and the other tables' choice changed with it (issue 12, "constraints leak")."""

    def load(self, search_space: list[ShardingOption], enumerator=None) -> None:
        from torchrec.distributed.planner.proposers import _sharding_option_score

        self._reset()
        by_fqn: dict[str, list[ShardingOption]] = {}
        for so in search_space:
            by_fqn.setdefault(so.fqn, []).append(so)
        types: list[str] = []
        for so in search_space:
            if so.sharding_type not in types:
                types.append(so.sharding_type)
        for fqn in by_fqn:
            by_fqn[fqn].sort(key=lambda x: _sharding_option_score(x, self._use_depth))
        for st in types:
            proposal = []
            for options in by_fqn.values():
                same = [so for so in options if so.sharding_type == st]
                proposal.append(same[0] if same else options[0])
            self._grouped_sharding_options.append(proposal)


def default_proposers(patience: int | None | str = "auto") -> list:
    """torchrec's default proposers, the greedy ones with early stopping after ``patience``
    fitting proposals that do not improve (``"auto"``: ``greedy_patience_for(tables)``), the
    uniform one per table (``PerTableUniformProposer``)."""
    from torchrec.distributed.planner.proposers import GridSearchProposer

    return [GridSearchProposer(), PatientGreedyProposer(patience=patience),
            PatientGreedyProposer(use_depth=False, patience=patience), PerTableUniformProposer()]


class TopologyEnumerator(EmbeddingEnumerator):
    """torchrec's enumerator with the planner's additions, given through the planner's
    ``enumerator=`` argument: the constraints of the model being planned (a new enumerator per
    ``TopologyAwarePlanner.plan``, because the defaults depend on the model's tables), column-wise
    variants cut into ``column_splits`` shards (``finer_column_splits``), and a fixed order of the
    search space (``_sorted_enumeration``); the last search space is kept (``last_search_space``)
    for bounds (``sharding/bounds.py``), with the seconds its enumeration took (``last_enumerate_s``)."""

    def __init__(self, topology: Topology, batch_size: int, column_splits: tuple[int, ...] = DEFAULT_COLUMN_SPLITS,
                 constraints: dict[str, ParameterConstraints] | None = None) -> None:
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints)
        self.constraints: dict[str, ParameterConstraints] = dict(constraints or {})
        self.column_splits = tuple(column_splits)
        self.world_size = topology.world_size
        self.local_world_size = topology.local_world_size
        self.last_search_space: list[ShardingOption] = []
        self.last_enumerate_s = 0.0

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        def extra(space: list[ShardingOption]) -> list[ShardingOption]:
            if not self.column_splits:
                return []
            return finer_column_splits(self, space, self.column_splits, self.world_size, self.local_world_size)

        t0 = time.perf_counter()
        self.last_search_space = _sorted_enumeration(super().enumerate, extra=extra)(module=module, sharders=sharders)
        self.last_enumerate_s += time.perf_counter() - t0
        return self.last_search_space


def merge_constraints(
    defaults: Mapping[str, ParameterConstraints], user: Mapping[str, ParameterConstraints] | None
) -> dict[str, ParameterConstraints]:
    """Per table: the user's constraint where given, with the fields it leaves None
    (``sharding_types``, ``compute_kernels``) taken from the planner's default for that table;
    the default elsewhere. A constraint on one table never changes another's. Copies: the user's
    objects are not modified (cache statistics are written into the result later)."""
    out = {name: dataclasses.replace(c) for name, c in defaults.items()}
    for name, c in (user or {}).items():
        d = defaults.get(name)
        fill = {} if d is None else {f: getattr(d, f) for f in ("sharding_types", "compute_kernels") if getattr(c, f) is None}
        out[name] = dataclasses.replace(c, **fill)
    return out


def remap_plan_to_host(plan: ShardingPlan, host: int, ranks_per_host: int, device_type: str) -> ShardingPlan:
    """A copy of a plan made for ranks 0..R-1 with the shard placements moved to ``host``'s
    global ranks (ShardedTensor placements name global ranks, even on a subgroup); ``ranks`` stay
    host-local because the sharders index per-rank lists of the group with them (DMPCollection
    remaps both and translates back with ShardingEnv2D.remap_rank, which is CUDA-only)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torch.distributed.remote_device import _remote_device

    plan = copy.deepcopy(plan)
    offset = host * ranks_per_host
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            spec = ps.sharding_spec
            if isinstance(spec, EnumerableShardingSpec) and spec.shards:
                for shard in spec.shards:
                    r = shard.placement.rank() + offset
                    dev = "cpu" if device_type == "cpu" else f"{device_type}:{r % ranks_per_host}"
                    shard.placement = _remote_device(f"rank:{r}/{dev}")
    return plan


def _cluster_to_plan(cluster: ClusterTopology, hosts: int, world_size: int | None, from_job: bool) -> ClusterTopology:
    """The cluster one plan is for: with ``hosts`` > 1 (k-step replicas) one host of it; a CPU
    topology with one host resized to ``world_size`` ranks (if None and ``from_job``: the
    initialised process group's world size / ``hosts``)."""
    if hosts > 1 and len(cluster.hosts) > 1:
        if len(cluster.hosts) != hosts:
            raise ValueError(f"topology {cluster.name or cluster.source}: {len(cluster.hosts)} hosts, the planner was given hosts={hosts}")
        cluster = dataclasses.replace(cluster, hosts=cluster.hosts[:1], name=f"{cluster.name}-1host")
    if world_size is None and from_job:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size() // hosts
    if world_size is not None and cluster.compute_device == "cpu" and len(cluster.hosts) == 1 and world_size != cluster.world_size:
        cluster = cpu_topology_like(cluster, world_size)
    return cluster


def default_constraints(module: nn.Module, compute_device: str, sharding_types: list[str] | None = None) -> dict[str, ParameterConstraints]:
    """Model-parallel sharding types; fused kernels, plus UVM and UVM caching on GPUs."""
    types = list(sharding_types or MODEL_PARALLEL_TYPES)
    kernels = ["fused"] if compute_device == "cpu" else ["fused", "fused_uvm", "fused_uvm_caching"]
    if "data_parallel" in types:
        kernels.append("dense")
    return {name: ParameterConstraints(sharding_types=types, compute_kernels=kernels) for name in _table_bytes(module)}


def _table_bytes(module: nn.Module) -> dict[str, int]:
    """Table -> weights + row-wise optimizer state bytes (fp32)."""
    return {c.name: c.num_embeddings * c.embedding_dim * 4 + c.num_embeddings * 4 for c in table_configs(module)}


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def fit_message(cluster: ClusterTopology, module: nn.Module, topo: Topology, err: Exception) -> str:
    """One line: what the model needs, what the cluster has, the largest tables, what would fit."""
    tables = _table_bytes(module)
    need = sum(tables.values())
    top = sorted(tables.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    w = cluster.world_size
    cpu = cluster.compute_device == "cpu"
    hbm_dev = 0 if cpu else min(g.hbm_bytes for h in cluster.hosts for g in h.gpus)
    host = min(h.ddr_bytes for h in cluster.hosts)
    avail_hbm, avail_host = hbm_dev * w, host * len(cluster.hosts)
    per_rank = hbm_dev + host / cluster.local_world_size
    ranks_needed = math.ceil(need / (0.85 * per_rank)) if per_rank else 0
    if need > 0.85 * (avail_hbm + avail_host):
        fix = (f"about {ranks_needed} ranks ({math.ceil(ranks_needed / cluster.local_world_size)} hosts like these), "
               f"or smaller embedding_dim / fewer rows for the largest tables")
    else:
        fix = ("allow fused_uvm_caching / fused_uvm and row_wise sharding for the largest tables, "
               "or smaller embedding_dim for them")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"model does not fit {cluster.name or 'topology'} ({w} ranks, {len(cluster.hosts)} hosts): "
        f"embeddings need {_gib(need)} (weights + optimizer state), available {_gib(hbm_dev)} HBM per device "
        f"({_gib(avail_hbm)} in all) and {_gib(host)} host memory per host ({_gib(avail_host)} in all); "
        f"largest tables: " + ", ".join(f"{n} {_gib(b)}" for n, b in top)
        + f"; to fit: {fix}; planner said: {first[:200]}"
    )


def cpu_topology_like(template: ClusterTopology, world_size: int) -> ClusterTopology:
    """A single-host CPU topology with ``world_size`` ranks, from a CPU template's first host."""
    h = template.hosts[0]
    g0 = h.gpus[0]
    gpus = tuple(dataclasses.replace(g0, index=i) for i in range(world_size))
    return dataclasses.replace(template, hosts=(dataclasses.replace(h, gpus=gpus),), name=f"{template.name}-{world_size}")


def cluster_for(topology: str, compute_device: str, world_size: int, local_world_size: int) -> ClusterTopology:
    """The cluster a training run plans for: ``topology`` (a file or shipped name), or the shipped
    ``cpu-gloo`` one for CPU runs. CPU topologies are resized to the run's world size."""
    name = topology or ("cpu-gloo" if compute_device == "cpu" else "")
    if not name:
        raise ValueError("sharding.planner=topology on cuda needs sharding.topology (a topology file or shipped name)")
    cluster = load_topology(name)
    if cluster.compute_device != compute_device:
        raise ValueError(f"topology {name} is for {cluster.compute_device}, the run is on {compute_device}")
    if cluster.world_size != world_size:
        if compute_device == "cpu" and world_size == local_world_size:
            return cpu_topology_like(cluster, world_size)
        raise ValueError(
            f"topology {name} has {cluster.world_size} ranks ({cluster.local_world_size} per host), the run has {world_size} ({local_world_size} per host)"
        )
    return cluster
