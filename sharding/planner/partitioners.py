"""The topology-aware partitioner: shards placed greedily by the modelled step time of
``sharding/planner/cost/model.py`` under HBM per rank, host memory per host and SSD per host (the
key_value kernel's rows, ``sharding/planner/ssd_tier.py``), then a local search
(``refine_placement``); torchrec's ``GreedyPerfPartitioner`` placement is kept when the model
prefers it (``compare_with_default``). Given to torchrec's planner as ``partitioner=``.

A search partitions hundreds of proposals that differ in a few tables, so the partitioner keeps
what does not change between them: each uniform option's memory and cost, each option's shards
as the model sees them, and the greedy steps of recent proposals (``_Traces``), replayed while
the start and the candidates match, which gives exactly the placement a fresh search gives.
Data-parallel tables cost every rank the same (on ranks with equally fast memory), so they
cannot move another shard: their cost is added after the greedy, and proposals that differ only
in which tables are data-parallel share their greedy steps up to the first table that left or
joined the all-to-all.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.types import (
    Partitioner,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Storage,
    Topology,
)

from sharding.constants import A2A_TYPES, SSD_KERNELS, UNIFORM_TYPES, UVM_KERNELS
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import PlacedShard, placed_from_option, placed_on_rank
from sharding.planner.cost.state import CostState
from sharding.planner.cost.candidates import candidate_scores

UNIFORM = UNIFORM_TYPES


class TopologyPartitioner(Partitioner):
    """Greedy placement by modeled step time (see module docstring)."""

    def __init__(self, cost_model: TopologyCostModel, compare_default: bool = True, refine: bool = True) -> None:
        self.cost_model = cost_model
        self.compare_default = compare_default
        self.refine = refine
        self.last_storage_constraint: Topology | None = None
        self._needs: dict[tuple, tuple] = {}
        self._placed: dict[int, tuple] = {}
        self._traces = _Traces()

    def partition(
        self, proposal: list[ShardingOption], storage_constraint: Topology, hbm_per_device: Optional[int] = None
    ) -> list[ShardingOption]:
        if storage_constraint is not self.last_storage_constraint:
            # a new search (torchrec's planner reserves storage once per plan): what was kept
            # for the last one's options goes, so a long-lived planner holds one search's
            self._needs, self._placed, self._traces = {}, {}, _Traces()
            self.cost_model.forget_options()
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

    # host memory and SSD are per-host budgets: torchrec's per-rank splits can be exceeded per rank
    def _fits_hosts(self, plan: list[ShardingOption], sc: Topology) -> bool:
        lw = sc.local_world_size
        hosts = range(sc.world_size // lw)
        for tier in ("ddr", "ssd"):
            used: dict[int, float] = {}
            for so in plan:
                for sh in so.shards:
                    used[sh.rank // lw] = used.get(sh.rank // lw, 0) + getattr(sh.storage, tier)
            cap = {h: sum(getattr(d.storage, tier) for d in sc.devices[h * lw : (h + 1) * lw]) for h in hosts}
            if not all(u <= cap[h] for h, u in used.items()):
                return False
        return True

    def _uniform_need(self, so: ShardingOption, host_of: np.ndarray, nh: int) -> tuple[np.ndarray, ...] | None:
        """(HBM per rank, host memory per host, SSD per host) of a uniform option's shards, shard
        i on rank i (memoized per option: a search proposes the same options again and again)."""
        key = (id(so), len(so.shards), nh)
        hit = self._needs.get(key)
        if hit is None or hit[0] is not so:
            st = [sh.storage for sh in so.shards]
            if any(x is None for x in st):
                return None
            hbm = np.array([float(x.hbm) for x in st])
            ddr, ssd = np.zeros(nh), np.zeros(nh)
            np.add.at(ddr, host_of, [float(x.ddr) for x in st])
            np.add.at(ssd, host_of, [float(x.ssd) for x in st])
            if len(self._needs) > 100_000:
                self._needs.clear()
            hit = self._needs[key] = (so, hbm, ddr, ssd)
        return hit[1:]

    def _protos(self, so: ShardingOption) -> tuple[list[PlacedShard], dict[tuple[int, int], PlacedShard]]:
        """The option's shards as the cost model sees them (rank 0), and a memo of them placed
        ({(shard, rank): placed shard}), kept per option across proposals."""
        hit = self._placed.get(id(so))
        if hit is None or hit[0] is not so or hit[3] is not so.cache_params:
            if len(self._placed) > 100_000:
                self._placed.clear()
            hit = self._placed[id(so)] = (so, placed_on_rank(so, 0), {}, so.cache_params)
        return hit[1], hit[2]

    @staticmethod
    def _take_uniform(need, hbm_free: np.ndarray, host_free: np.ndarray, ssd_free: np.ndarray, host_of: np.ndarray) -> bool:
        """Takes a uniform option's memory if all of it fits (False: nothing taken, the caller
        checks shard by shard to name the one that does not)."""
        hbm, ddr, ssd = need
        if not ((hbm <= hbm_free).all() and (ddr <= host_free).all() and (ssd <= ssd_free).all()):
            return False
        hbm_free -= hbm
        host_free -= ddr
        ssd_free -= ssd
        return True

    def _partition(self, proposal: list[ShardingOption], sc: Topology, hbm_per_device: Optional[int]) -> list[ShardingOption]:
        m = self.cost_model
        w, lw = sc.world_size, sc.local_world_size
        if w != m.world:
            raise PlannerError(f"topology world size {m.world} != planner world size {w}", PlannerErrorType.OTHER)
        hbm_free = np.array([float(hbm_per_device or d.storage.hbm) for d in sc.devices])
        nh = w // lw
        host_free = np.array([sum(float(d.storage.ddr) for d in sc.devices[h * lw : (h + 1) * lw]) for h in range(nh)])
        ssd_free = np.array([sum(float(d.storage.ssd) for d in sc.devices[h * lw : (h + 1) * lw]) for h in range(nh)])
        host_of = np.arange(w) // lw
        # table-row-wise: a group is one NVLink domain (one host unless hosts share one)
        gw = m.topo.ranks_per_nvlink_domain
        groups = w // gw
        st = m.new_state()
        _reset([so for so in proposal if so.sharding_type not in UNIFORM])  # uniform ones: every shard set below

        def fits(rank: int, s: Storage) -> bool:
            h = host_of[rank]
            return s.hbm <= hbm_free[rank] and s.ddr <= host_free[h] and s.ssd <= ssd_free[h]

        def fitting(s: Storage) -> np.ndarray:
            """The ranks ``fits`` admits, for all ranks at once (the greedy asks for every shard)."""
            return (s.hbm <= hbm_free) & (s.ddr <= host_free[host_of]) & (s.ssd <= ssd_free[host_of])

        def take(rank: int, s: Storage) -> None:
            hbm_free[rank] -= s.hbm
            host_free[host_of[rank]] -= s.ddr
            ssd_free[host_of[rank]] -= s.ssd

        def fail(so: ShardingOption, what: str) -> PlannerError:
            return PlannerError(f"{so.name} ({so.sharding_type}, {so.compute_kernel}): {what}", PlannerErrorType.PARTITION)

        # 1. uniform options (RW, DP): shard i on rank i, as torchrec does. Where what a
        # data-parallel table adds to the step is the same on every rank (device-resident, every
        # rank's memory as fast), it cannot change where the other shards go: its memory is taken
        # now, its cost added after the greedy, so proposals that differ in their data-parallel
        # tables can share greedy steps (``_Traces``).
        uniform_mem = float(np.ptp(m.mem_bw)) == 0.0
        deferred: list = []
        first: list[int] = []  # the uniform options whose cost is in the state before the greedy
        for so in proposal:
            if so.sharding_type in UNIFORM:
                if len(so.shards) != w:
                    raise fail(so, f"{len(so.shards)} shards for {w} ranks")
                need = self._uniform_need(so, host_of, nh)
                if need is None or not self._take_uniform(need, hbm_free, host_free, ssd_free, host_of):
                    for r, sh in enumerate(so.shards):
                        if not fits(r, sh.storage):
                            raise fail(so, f"shard does not fit on rank {r}")
                        take(r, sh.storage)
                for r, sh in enumerate(so.shards):
                    sh.rank = r
                c = m.contribution(so, in_order=True)
                if c is not None and uniform_mem and so.sharding_type == "data_parallel":
                    deferred.append(c)
                    continue
                first.append(id(so))
                if c is None:
                    st.add_many(m.placed(so))
                else:
                    c.add_to(st)

        rest = [so for so in proposal if so.sharding_type not in UNIFORM]
        rest.sort(
            key=lambda so: (-sum(sh.perf.total for sh in so.shards), -sum(sh.storage.hbm + sh.storage.ddr for sh in so.shards), so.name)
        )

        # 2. table-row-wise: one NVLink domain (a host, unless hosts share one), shard i on its rank i
        for so in rest:
            if so.sharding_type != "table_row_wise":
                continue
            if len(so.shards) != gw:
                raise fail(so, f"{len(so.shards)} shards for {gw} ranks per NVLink domain (host)")
            best = None
            fast = groups > 1 and not m.cpu and so.compute_kernel not in UVM_KERNELS + SSD_KERNELS
            if fast:  # device-resident: the step time on each host in closed form, no trial states
                protos = placed_on_rank(so, 0)
                base = st.base_scores()
            for h in range(groups):
                ranks = list(range(h * gw, (h + 1) * gw))
                if not all(sh.storage.hbm <= hbm_free[r] for r, sh in zip(ranks, so.shards)):
                    continue
                ddr, ssd = np.zeros(nh), np.zeros(nh)
                np.add.at(ddr, host_of[ranks], [sh.storage.ddr for sh in so.shards])
                np.add.at(ssd, host_of[ranks], [sh.storage.ssd for sh in so.shards])
                if (ddr > host_free).any() or (ssd > ssd_free).any():
                    continue
                if fast:
                    step, spread = st.step_time_with(*st.twrw_loads(protos, ranks), "table_row_wise", base=base)
                    key = (round(step, 12), spread, h)
                    if best is None or key < best[0]:
                        best = (key, h, None)
                    continue
                if groups == 1:
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
                raise fail(so, "no NVLink domain (host) has room for it")
            _, h, trial = best
            for r, sh in zip(range(h * gw, (h + 1) * gw), so.shards):
                sh.rank = r
                take(r, sh.storage)
            if trial is None:
                for p in m.placed(so):
                    st.add(p)
            else:
                st = trial

        # 3. table-/column-wise shards, heaviest first, each where the modeled step grows least.
        # A step whose state and candidates equal those of a recent proposal's step is not
        # searched again: its rank is that step's (the same inputs give the same choice).
        order = [so for so in rest if so.sharding_type != "table_row_wise"]
        twrw = tuple((id(so), so.shards[0].rank) for so in rest if so.sharding_type == "table_row_wise")
        start = (id(sc), hbm_per_device, tuple(first), twrw)
        known = self._traces.longest(start, order)
        trace: list[tuple[ShardingOption, list[bytes], list[int]]] = []
        for i, so in enumerate(order):
            step = known[i] if known is not None and i < len(known) and known[i][0] is so else None
            if step is None:
                known = None
            protos, on_rank = self._protos(so)
            host_lock = None
            masks, ranks = [], []
            for k, (sh, proto) in enumerate(zip(so.shards, protos)):
                ok = fitting(sh.storage)
                if host_lock is not None:
                    ok &= host_of == host_lock
                mask = np.packbits(ok).tobytes()
                if step is not None and step[1][k] == mask:
                    r = step[2][k]
                else:
                    step = known = None
                    cands = np.flatnonzero(ok)
                    if not len(cands):
                        raise fail(so, f"a shard needing {sh.storage} fits on no rank")
                    r = _pick(st, proto, cands)
                masks.append(mask)
                ranks.append(r)
                sh.rank = r
                take(r, sh.storage)
                placed = on_rank.get((k, r))
                if placed is None:
                    placed = on_rank[(k, r)] = dataclasses.replace(proto, rank=r)
                st.add(placed)
                if so.sharding_type == "table_column_wise":
                    host_lock = host_of[r]
            trace.append((so, masks, ranks))
        self._traces.add(start, trace, (sc, proposal))
        for c in deferred:
            c.add_to(st)
        if self.refine:
            refine_placement(st, [so for so in rest if so.sharding_type != "table_row_wise"], hbm_free, host_of)
        return proposal


class _Traces:
    """The greedy steps of the latest proposals: per option in greedy order, each shard's
    candidate ranks (a bit mask) and the rank chosen, under the state the placement started
    from (``start``: the storage, the uniform tables whose cost was added first, the
    table-row-wise placements). A new proposal with the same start and the same first options
    replays their steps while its candidates are the same, and searches from the first that
    differs, so it gets exactly the placement a full search gives. Recent traces only: the
    search walks from proposal to neighbouring proposal."""

    KEEP = 8

    def __init__(self) -> None:
        self.items: list[tuple[tuple, list, object]] = []

    def longest(self, start: tuple, order: list[ShardingOption]) -> list | None:
        best, best_n = None, 0
        for key, steps, _ in self.items:
            if key != start:
                continue
            n = 0
            for (so, _, _), new in zip(steps, order):
                if so is not new:
                    break
                n += 1
            if n > best_n:
                best, best_n = steps, n
        return best

    def add(self, start: tuple, steps: list, keep_alive: object) -> None:
        """``keep_alive``: what the ids in ``start`` refer to, held so no id is reused."""
        self.items.append((start, steps, keep_alive))
        del self.items[: -self.KEEP]


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
        for proto, sh in zip(placed_on_rank(so, 0), so.shards):
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
    lk = st.local_time()
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
            i, d = idx[lo : lo + chunk_trials], dest[lo : lo + chunk_trials]
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
                    j, rj = js[lo : lo + chunk_trials], r2[lo : lo + chunk_trials]
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


TIE = 1e-9  # relative: steps this close to the lowest are a tie, broken by spread, then rank


def _pick(st: CostState, proto: PlacedShard, cands: np.ndarray) -> int:
    """The candidate with the lowest resulting step time; ties: the lowest resulting spread (sum
    of squared rank and link times: evens loads, spreads host traffic over switches), then the
    lowest rank."""
    if len(cands) == 1:
        return int(cands[0])
    c = np.asarray(cands)
    maxes, sums = candidate_scores(st, proto, c, ties=TIE)
    lo = maxes.min()
    tol = TIE * max(lo, 1e-12)
    ok = maxes <= lo + tol
    idx = np.flatnonzero(ok)
    best = idx[np.lexsort((c[idx], sums[idx]))[0]]
    return int(c[best])


def _sig(plan: list[ShardingOption]) -> list:
    return [sh.rank for so in plan for sh in so.shards]


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
