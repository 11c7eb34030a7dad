"""A proposer that splits the tables on the slowest rank into finer column shards.

torchrec's proposers walk each table's options by torchrec's own per-shard estimate (fastest
first, then smaller ones for memory), one table at a time; none of them asks which rank sets the
step. With whole tables, balance comes in table-sized steps (26 Criteo tables on 8 or 16 ranks
leave some ranks a table more than others), and a column-wise variant of a table
(``finer_column_splits`` in ``sharding/planner/enumerators.py``) is what evens it out, but its
per-shard estimate rarely makes a greedy proposer pick it.

``BalanceProposer`` runs after the others. It starts from the best plan found so far (recorded by
the planner's perf model, :class:`BestPlanTracker`), and hill-climbs. Neighbours of a plan, in
order: every table whole but ``j`` of them (the slowest rank's first) cut into ``k`` column shards,
those that even out the columns per rank first (26 tables on 8 ranks: 2 tables in 4); then, for
each table with a shard on the slowest rank (by the cost model), that table's option replaced by
one of the same kernel cut into more shards. It keeps a proposal the partitioner + cost model
rate better and stops after ``patience`` proposals in a row that are not.

Where the search space has data-parallel options (the user allowed ``data_parallel``), the first
neighbours make the ``j`` smallest all-to-all tables data-parallel (``_data_parallel_cuts``): a
tiny table's ring all-reduce of its gradient (rows x columns) is cheaper than its share of every
all-to-all (its ids in, its pooled output out, batch x world x columns), and taking its columns
out of the all-to-all lets the rest balance. One such table alone rarely pays (the first adds the
all-reduce's latency and whole tables move the busiest link in table-sized steps), so the step
is not monotone in ``j``: every prefix is tried (a round, free of ``patience``) and the plan moves
to the round's best, for at most ``MAX_DATA_PARALLEL_ROUNDS`` neighbourhoods of a search. When
the start plan has data-parallel tables (torchrec's greedy proposers pick them by their own
estimate), a second walk starts from it with those tables whole: the model-parallel optimum
(tables cut into column shards) is not one move away from a plan with data-parallel tables.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import numpy as np
from torchrec.distributed.planner.types import Enumerator, Proposer, ShardingOption, Topology

from sharding.constants import A2A_TYPES as _A2A
from sharding.planner.cost.model import TopologyCostModel


class BestPlanTracker:
    """The best-rated plan of a search (its options, and the tables on its slowest rank)."""

    def __init__(self, cost_model: TopologyCostModel) -> None:
        self.cost_model = cost_model
        self.reset()

    def reset(self) -> None:
        self.rating = float("inf")
        self.options: list[ShardingOption] | None = None
        self.bottleneck_tables: list[str] = []
        # the best plan per sharding type of its largest table: other starts for the balance walk
        self.best_by_type: dict[str, tuple[float, list[ShardingOption]]] = {}

    def offer(self, plan: list[ShardingOption], rating: float) -> None:
        if rating < self.rating:
            self.rating = rating
            self.options = list(plan)
            self.bottleneck_tables = bottleneck_tables(self.cost_model, plan)
        if plan:
            key = largest_table_type(plan)
            if rating < self.best_by_type.get(key, (float("inf"),))[0]:
                self.best_by_type[key] = (rating, list(plan))


def largest_table_type(plan: list[ShardingOption]) -> str:
    """The sharding type of a plan's largest table (rows x columns; ties by name): what sets the
    plan's kind (e.g. big tables table-row-wise and small ones anything)."""
    big = max(plan, key=lambda so: (int(so.tensor.shape[0]) * int(so.tensor.shape[1]), so.name))
    return big.sharding_type


def bottleneck_tables(cost_model: TopologyCostModel, plan: list[ShardingOption]) -> list[str]:
    """Tables with a shard on the slowest rank of a placed plan, widest (by columns there) first."""
    rt = cost_model.score(plan).rank_time
    slow = int(np.argmax(rt)) if len(rt) else 0
    cols: dict[str, int] = defaultdict(int)
    for so in plan:
        for sh in so.shards:
            if sh.rank == slow:
                cols[so.name] += int(sh.size[1])
    return sorted(cols, key=lambda n: (-cols[n], n))


class BalanceProposer(Proposer):
    def __init__(self, tracker: BestPlanTracker, patience: int = 8) -> None:
        self.tracker = tracker
        self.patience = patience
        self.by_table: dict[str, list[ShardingOption]] = {}
        self.current: list[ShardingOption] | None = None
        self.rating = float("inf")
        self.queue: list[tuple[list[ShardingOption], bool]] = []
        self.last: list[ShardingOption] | None = None
        self.last_was_dp = False
        self.dp_best: tuple[list[ShardingOption], float, list[str]] | None = None
        self.dp_rounds = 0
        self.restarts: list[tuple[list[ShardingOption], bool]] = []
        self.has_data_parallel = False
        self.misses = 0
        self.tried: set[tuple] = set()

    def load(self, search_space: list[ShardingOption], enumerator: Optional[Enumerator] = None) -> None:
        self.by_table = defaultdict(list)
        for so in search_space:
            self.by_table[so.name].append(so)
        self.has_data_parallel = any(so.sharding_type == "data_parallel" for so in search_space)
        self.current, self.queue, self.last, self.misses, self.tried = None, [], None, 0, set()
        self.last_was_dp, self.dp_best, self.dp_rounds, self.restarts = False, None, 0, []

    def propose(self) -> Optional[list[ShardingOption]]:
        if self.current is None:
            if self.tracker.options is None:
                return None
            self.current, self.rating = list(self.tracker.options), self.tracker.rating
            self.queue = self._neighbours(self.current, self.tracker.bottleneck_tables)
            whole = [
                self._first(so.name, "table_wise", "fused") or so if so.sharding_type == "data_parallel" else so for so in self.current
            ]
            if any(a is not b for a, b in zip(whole, self.current)):
                self.restarts = [(whole, False)]
            if self.has_data_parallel:
                # data-parallel rounds from the best plans of other kinds too (e.g. big tables
                # table-row-wise across hosts): small tables data-parallel beside them can beat any
                # plan one move away from the best one (torchrec's default on 16 DGX hosts, DLRM)
                mine = largest_table_type(self.current)
                others = sorted((r, k, p) for k, (r, p) in self.tracker.best_by_type.items() if k not in (mine, "data_parallel"))
                self.restarts += [(p, True) for _, _, p in others[:MAX_OTHER_STARTS]]
        while True:
            if self.queue and self.queue[0][1]:  # a data-parallel round: every candidate, no patience
                cand, _ = self.queue.pop(0)
                dp = True
            else:
                dp = False
                if self.dp_best is not None:  # the round is over: move to its best, if it beat the plan
                    best, self.dp_best = self.dp_best, None
                    if best[1] < self.rating * (1 - 1e-9):
                        self.current, self.rating, self.misses = best[0], best[1], 0
                        self.queue = self._neighbours(self.current, best[2])
                        continue
                if not self.queue or self.misses >= self.patience:
                    if not self.restarts:
                        return None
                    # another walk: from the start plan without data-parallel tables (the
                    # model-parallel optimum needs column cuts no single move reaches from there),
                    # or from the best plan of another kind, with one data-parallel round
                    cand, with_dp = self.restarts.pop(0)
                    self.current, self.rating, self.misses, self.queue = cand, float("inf"), 0, []
                    self.dp_rounds = MAX_DATA_PARALLEL_ROUNDS - 1 if with_dp else MAX_DATA_PARALLEL_ROUNDS
                    self.tried.add(tuple(id(so) for so in cand))
                    self.last, self.last_was_dp = cand, False
                    return cand
                cand, _ = self.queue.pop(0)
            key = tuple(id(so) for so in cand)
            if key in self.tried:
                continue
            self.tried.add(key)
            self.last, self.last_was_dp = cand, dp
            return cand

    def feedback(
        self,
        partitionable: bool,
        plan: Optional[list[ShardingOption]] = None,
        perf_rating: Optional[float] = None,
        storage_constraint: Optional[Topology] = None,
    ) -> None:
        if self.last is None:
            return
        better = partitionable and plan is not None and perf_rating is not None and perf_rating < self.rating * (1 - 1e-9)
        if self.last_was_dp:
            # keep the round's best; the plan moves when the round ends (best, not first, improvement)
            if better and (self.dp_best is None or perf_rating < self.dp_best[1]):
                self.dp_best = (self.last, perf_rating, bottleneck_tables(self.tracker.cost_model, plan))
        elif better:
            self.current, self.rating, self.misses = self.last, perf_rating, 0
            self.queue = self._neighbours(self.current, bottleneck_tables(self.tracker.cost_model, plan))
        else:
            self.misses += 1

    def _neighbours(self, plan: list[ShardingOption], tables: list[str]) -> list[tuple[list[ShardingOption], bool]]:
        """Group cuts (``_group_cuts``), then the plan with one bottleneck table's option cut finer
        (same kernel), coarsest cut first; before them, where the search space has data-parallel
        options, the data-parallel prefixes (``_data_parallel_cuts``: a round, see ``propose``).
        Returns (plan, is a data-parallel candidate) pairs.

        Each sharding type is its own group of collectives (the cost model charges their
        latency), so a table going column-wise takes the plan's other table-wise options with it
        to their one-shard column-wise twins (the same placement and bytes, one group less)."""
        out = self._group_cuts(plan, tables)
        index = {so.name: i for i, so in enumerate(plan)}
        for name in tables:
            cur = plan[index[name]]
            if cur.sharding_type not in _A2A:
                continue
            alts = [
                so
                for so in self.by_table.get(name, ())
                if so.sharding_type in _A2A
                and so.compute_kernel == cur.compute_kernel
                and so.cache_load_factor == cur.cache_load_factor
                and len(so.shards) > len(cur.shards)
            ]
            alts.sort(key=lambda so: (len(so.shards), so.sharding_type))
            for alt in alts:
                cand = list(plan)
                cand[index[name]] = alt
                out.append(cand)
                if alt.sharding_type != "table_wise":
                    same = [self._twin(so, alt.sharding_type) if so.sharding_type == "table_wise" else so for so in cand]
                    if any(a is not b for a, b in zip(same, cand)):
                        out.append(same)
        dp: list[list[ShardingOption]] = []
        if self.dp_rounds < MAX_DATA_PARALLEL_ROUNDS:
            dp = self._data_parallel_cuts(plan)
            self.dp_rounds += bool(dp)
        return [(c, True) for c in dp] + [(c, False) for c in out]

    def _data_parallel_cuts(self, plan: list[ShardingOption]) -> list[list[ShardingOption]]:
        """The plan with its ``j`` smallest candidate tables (by gradient bytes, rows x columns)
        data-parallel and its other candidates in the all-to-all, for ``j`` = 0, 1, 2, ... (at most
        ``MAX_DATA_PARALLEL_CUTS`` values of ``j``, spread geometrically beyond that). Candidates:
        the tables data-parallel now (so a round can also take them back: torchrec's greedy
        proposers make small tables data-parallel by their own estimate, and the best plan of the
        search may start with too many), and the all-to-all tables with a data-parallel option whose
        ring all-reduce (2 (n-1)/n x rows x columns through every rank, on the busiest link of
        the model's rings: ``TopologyCostModel.ring_inv``, NCCL's channels across hosts) takes less
        time than the pooled output the table sends in one all-to-all from its best owner (batch x
        columns to every peer, on the busiest link of that rank's sends): a larger one loads the
        links more than its all-to-all does. A table taken back gets its table-wise option (fused
        kernel), or, in a plan whose largest table is row-wise or table-row-wise, that type (a small
        table goes back beside the big ones the way they are sharded)."""
        model = self.tracker.cost_model
        world, batch = model.world, model.batch
        ring_s = 2 * (world - 1) / world * float(model.ring_inv(tuple(range(world))).max(initial=0.0))  # per gradient byte
        a2a_s = batch * float(model.links.out_inv.max(axis=1).min()) if world > 1 else 0.0  # per byte of a row
        back_type = largest_table_type(plan)
        if back_type in _A2A + ("data_parallel",):  # whole tables, as they go into the all-to-all
            back_type = "table_wise"
        cands = []
        for i, so in enumerate(plan):
            rows, cols = int(so.tensor.shape[0]), int(so.tensor.shape[1])
            if so.sharding_type == "data_parallel":
                back = self._first(so.name, back_type, "fused") or self._first(so.name, "table_wise", "fused")
                if back is not None:
                    cands.append((rows * cols, so.name, i, so, back))
            elif so.sharding_type in _A2A + ("row_wise", "table_row_wise") and rows * ring_s < a2a_s:
                dp = self._first(so.name, "data_parallel")
                if dp is not None:
                    cands.append((rows * cols, so.name, i, dp, so))
        if not cands:
            return []
        cands.sort(key=lambda c: c[:2])
        out = []
        for j in [0] + _spread(len(cands), MAX_DATA_PARALLEL_CUTS - 1):
            cand = list(plan)
            for k, (_, _, i, dp, a2a) in enumerate(cands):
                cand[i] = dp if k < j else a2a
            if any(a is not b for a, b in zip(cand, plan)):
                out.append(cand)
        return out

    def _first(self, name: str, sharding_type: str, kernel: str | None = None) -> ShardingOption | None:
        """The table's first option of ``sharding_type`` (and ``kernel``, if given) in the search
        space: a data-parallel option (its kernel is ``dense``), or a table's whole (table-wise,
        fused) option to take it back from data-parallel."""
        for alt in self.by_table.get(name, ()):
            if alt.sharding_type == sharding_type and (kernel is None or alt.compute_kernel == kernel):
                return alt
        return None

    def _group_cuts(self, plan: list[ShardingOption], tables: list[str]) -> list[list[ShardingOption]]:
        """Plans with every table-/column-wise table whole but ``j`` of them (the bottleneck's
        first) cut into ``k`` column shards, all column-wise: with near-equal tables one cut
        never helps (it moves a table's worth of load around) while ``j`` cuts that even out the
        columns per rank can. Those come first: by the most columns a rank gets when the shards
        are spread widest first over the least loaded rank (``_makespan``), then fewest shards."""
        base = []
        for so in plan:
            one = self._option(so, "column_wise", 1) if so.sharding_type in _A2A and so.compute_kernel == "fused" else None
            base.append(one if one is not None else so)
        movable = [i for i, so in enumerate(base) if so.sharding_type == "column_wise" and len(so.shards) == 1]
        if len(movable) < 2:
            return []
        first = {n: i for i, n in enumerate(tables)}
        movable.sort(key=lambda i: (first.get(base[i].name, len(first)), -int(base[i].tensor.shape[1]), base[i].name))
        world = self.tracker.cost_model.world
        shards = sum(len(so.shards) for so in base)
        widths: dict[int, int] = defaultdict(int)  # {shard width: shards}
        for so in base:
            for sh in so.shards:
                widths[int(sh.size[1])] += 1
        cands = []
        for k in sorted(
            {
                len(so.shards)
                for opts in self.by_table.values()
                for so in opts
                if so.sharding_type == "column_wise" and so.compute_kernel == "fused"
            }
            - {1}
        ):
            for j in range(1, min(world, len(movable)) + 1):
                n = shards + j * (k - 1)
                cut = defaultdict(int, widths)
                for i in movable[:j]:
                    d = int(base[i].tensor.shape[1])
                    cut[d] -= 1
                    cut[d // k] += k
                cands.append((_makespan_of_counts(cut, world), n, j, k))
        out = []
        for _, _, j, k in sorted(cands):
            cand = list(base)
            for i in movable[:j]:
                cut = self._option(base[i], "column_wise", k)
                if cut is not None:
                    cand[i] = cut
            if any(a is not b for a, b in zip(cand, plan)):
                out.append(cand)
        return out

    def _option(self, so: ShardingOption, sharding_type: str, shards: int) -> ShardingOption | None:
        for alt in self.by_table.get(so.name, ()):
            if (
                alt.sharding_type == sharding_type
                and len(alt.shards) == shards
                and alt.compute_kernel == so.compute_kernel
                and alt.cache_load_factor == so.cache_load_factor
            ):
                return alt
        return None

    def _twin(self, so: ShardingOption, sharding_type: str) -> ShardingOption:
        """``so``'s option of ``sharding_type`` with one shard (a table-wise table as column-wise)."""
        for alt in self.by_table.get(so.name, ()):
            if (
                alt.sharding_type == sharding_type
                and len(alt.shards) == 1
                and alt.compute_kernel == so.compute_kernel
                and alt.cache_load_factor == so.cache_load_factor
            ):
                return alt
        return so


MAX_DATA_PARALLEL_CUTS = 24
# neighbourhoods that get a data-parallel round (each round proposes up to MAX_DATA_PARALLEL_CUTS
# plans; on 500 tables x 128 ranks a proposal takes ~0.1-0.3 s)
MAX_DATA_PARALLEL_ROUNDS = 3
# walks from the best plans of other kinds (largest table's sharding type) when data_parallel is allowed
MAX_OTHER_STARTS = 2


def _spread(n: int, most: int) -> list[int]:
    """1..n when n <= most, else ``most`` values from 1 to n spaced geometrically."""
    if n <= most:
        return list(range(1, n + 1))
    return sorted({int(round(v)) for v in np.geomspace(1, n, most)})


def _makespan(widths: list[int], world: int) -> int:
    """The most columns any rank gets when shards of these widths go, widest first, each to the
    least loaded rank (LPT). Each rank sends its columns' pooled output to every peer and
    receives its peers' share back, so the busiest directed link of an all-to-all follows it."""
    counts: dict[int, int] = defaultdict(int)
    for w in widths:
        counts[w] += 1
    return _makespan_of_counts(counts, world)


def _makespan_of_counts(counts: dict[int, int], world: int) -> int:
    """``_makespan`` from {width: number of shards}. Shards of one width are placed in bulk: the
    greedy step always picks the least load, so the loads it picks are non-decreasing and are the
    ``k`` smallest of {load_r + i * width}; which of several equal loads takes a shard does not
    change the loads' multiset. A search over the k-th smallest such value replaces ``k`` heap
    steps (500 tables x 128 ranks: thousands of shards of a few widths, per candidate cut)."""
    load = np.zeros(max(1, world), dtype=np.int64)
    for w in sorted((w for w, k in counts.items() if k > 0), reverse=True):
        _place_equal(load, w, counts[w])
    return int(load.max())


def _place_equal(load: np.ndarray, w: int, k: int) -> None:
    """Places ``k`` shards of width ``w`` as LPT would, in place (``w`` >= 0)."""
    if w == 0:
        return
    n = len(load)

    def reached(t: int) -> int:  # values load_r + i*w <= t, over every rank
        return int(np.where(load <= t, (t - load) // w + 1, 0).sum())

    rounds = -(-k // n) - 1  # the k-th smallest value lies between these
    lo, hi = int(load.min()) + rounds * w, int(load.max()) + rounds * w
    while lo < hi:  # the least t with reached(t) >= k
        mid = (lo + hi) // 2
        if reached(mid) >= k:
            hi = mid
        else:
            lo = mid + 1
    below = np.where(load < lo, (lo - 1 - load) // w + 1, 0)  # each rank's values under the k-th
    at = np.flatnonzero((load <= lo) & ((lo - load) % w == 0))  # ranks with a value equal to it
    load += below * w
    load[at[: k - int(below.sum())]] += w
