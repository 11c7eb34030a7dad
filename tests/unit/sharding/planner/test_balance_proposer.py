"""sharding/planner/balance_proposer.py: the best plan of a search and the proposer that cuts its slowest rank's
tables into finer column shards."""

from __future__ import annotations

import logging

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints

from sharding.planner.balance_proposer import BalanceProposer, BestPlanTracker, bottleneck_tables, largest_table_type
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.enumerators import TopologyEnumerator
from sharding.planner.job_topology import torchrec_topology
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
CLUSTER = load_topology("cpu-gloo")  # 2 CPU ranks
BATCH = 64


def _space(specs):
    """Per table (rows, dim): table-wise, column-wise whole and column-wise in 2 shards, fused."""
    cons = {
        f"t_{i}": ParameterConstraints(sharding_types=["table_wise", "column_wise"], compute_kernels=["fused"]) for i in range(len(specs))
    }
    enumerator = TopologyEnumerator(torchrec_topology(CLUSTER), BATCH, (2,), cons)
    return enumerator.enumerate(meta_ebc(specs), [EmbeddingBagCollectionSharder()])


def _option(space, name: str, sharding_type: str, shards: int):
    return next(so for so in space if (so.name, so.sharding_type, len(so.shards)) == (name, sharding_type, shards))


def _placed_table_wise(space, ranks: dict[str, int]):
    plan = [_option(space, name, "table_wise", 1) for name in ranks]
    for so in plan:
        so.shards[0].rank = ranks[so.name]
    return plan


def _short(plan) -> list[tuple[str, str, int]]:
    return [(so.name, so.sharding_type, len(so.shards)) for so in plan]


def test_the_tracker_keeps_the_best_plan_and_the_tables_on_its_slowest_rank():
    model = TopologyCostModel(CLUSTER, BATCH)
    space = _space([(100, 16), (100, 16), (100, 16)])
    tracker = BestPlanTracker(model)
    plan = _placed_table_wise(space, {"t_0": 0, "t_1": 0, "t_2": 1})  # rank 0 does twice the lookups
    assert bottleneck_tables(model, plan) == ["t_0", "t_1"]
    tracker.offer(plan, 2.0)
    tracker.offer(list(reversed(plan)), 3.0)  # worse: ignored
    assert (tracker.rating, _short(tracker.options), tracker.bottleneck_tables) == (2.0, _short(plan), ["t_0", "t_1"])
    assert list(tracker.best_by_type) == ["table_wise"]
    tracker.reset()
    assert (tracker.rating, tracker.options, tracker.best_by_type) == (float("inf"), None, {})


def test_the_largest_table_sets_the_plans_kind_ties_by_name():
    space = _space([(100, 16), (200, 8), (10, 16)])  # t_0 and t_1: 1600 values each
    plan = [_option(space, "t_0", "table_wise", 1), _option(space, "t_1", "column_wise", 2), _option(space, "t_2", "column_wise", 1)]
    assert largest_table_type(plan) == "column_wise"
    plan[1] = _option(space, "t_1", "table_wise", 1)
    assert largest_table_type(plan) == "table_wise"


def test_nothing_to_propose_before_a_plan_was_rated():
    proposer = BalanceProposer(BestPlanTracker(TopologyCostModel(CLUSTER, BATCH)))
    proposer.load(_space([(100, 16), (100, 16)]))
    assert proposer.propose() is None


def test_the_neighbours_of_a_plan_in_order_each_proposed_once():
    model = TopologyCostModel(CLUSTER, BATCH)
    space = _space([(100, 16), (100, 16), (100, 16)])
    tracker = BestPlanTracker(model)
    tracker.offer(_placed_table_wise(space, {"t_0": 0, "t_1": 0, "t_2": 1}), 1.0)
    proposer = BalanceProposer(tracker)
    proposer.load(space)
    got = []
    while (plan := proposer.propose()) is not None:
        got.append(_short(plan))
        proposer.feedback(partitionable=True, plan=plan, perf_rating=2.0)  # never better
    # 1. group cuts, all tables column-wise: 3 x 16 columns on 2 ranks put 32 on one; one table
    #    cut in 2 (16, 16, 8, 8) or two (16, 8, 8, 8, 8) put 24 on each: fewer shards first
    # 2. each bottleneck table (t_0, t_1: rank 0) cut alone, then with the others as column-wise
    #    twins (for t_0 that is the first group cut again: not proposed twice)
    cw1, cw2, tw = ("column_wise", 1), ("column_wise", 2), ("table_wise", 1)
    assert got == [
        [("t_0", *cw2), ("t_1", *cw1), ("t_2", *cw1)],
        [("t_0", *cw2), ("t_1", *cw2), ("t_2", *cw1)],
        [("t_0", *cw2), ("t_1", *tw), ("t_2", *tw)],
        [("t_0", *tw), ("t_1", *cw2), ("t_2", *tw)],
        [("t_0", *cw1), ("t_1", *cw2), ("t_2", *cw1)],
    ]
    # the same again after a new load, and with patience 2 the walk stops after 2 misses
    proposer.load(space)
    assert _short(proposer.propose()) == got[0]
    patient = BalanceProposer(tracker, patience=2)
    patient.load(space)
    seen = []
    while (plan := patient.propose()) is not None:
        seen.append(_short(plan))
        patient.feedback(partitionable=True, plan=plan, perf_rating=2.0)
    assert seen == got[:2]


def test_a_better_proposal_becomes_the_plan_to_walk_from():
    model = TopologyCostModel(CLUSTER, BATCH)
    space = _space([(100, 16), (100, 16), (100, 16)])
    tracker = BestPlanTracker(model)
    tracker.offer(_placed_table_wise(space, {"t_0": 0, "t_1": 0, "t_2": 1}), 1.0)
    proposer = BalanceProposer(tracker)
    proposer.load(space)
    first = proposer.propose()
    proposer.feedback(partitionable=True, plan=first, perf_rating=2.0)
    second = proposer.propose()
    ranks = iter([0, 1, 0, 1, 1])  # placed: t_0's two shards on 0 and 1, t_1's on 0 and 1, t_2 on 1
    for so in second:
        for sh in so.shards:
            sh.rank = next(ranks)
    proposer.feedback(partitionable=True, plan=second, perf_rating=0.5)
    assert (proposer.current, proposer.rating, proposer.misses) == (second, 0.5, 0)
    # not partitionable is a miss, however it is rated
    proposer.propose()
    proposer.feedback(partitionable=False, plan=None, perf_rating=0.1)
    assert (proposer.current, proposer.rating, proposer.misses) == (second, 0.5, 1)


def test_makespan_places_runs_of_equal_widths_as_lpt_does_one_by_one():
    """The bulk placement of equal widths against LPT written out shard by shard with a scan for
    the least loaded rank: many shards of few widths (more shards than ranks, ties everywhere),
    width 0, one rank, no shards."""
    import random

    from sharding.planner.balance_proposer import _makespan

    def lpt(widths, world):
        load = [0] * world
        for w in sorted(widths, reverse=True):
            i = min(range(world), key=load.__getitem__)
            load[i] += w
        return max(load)

    rng = random.Random(0)
    for _ in range(500):  # few shards per rank
        widths = [rng.choice([4, 8, 16, 32, 64, 128]) for _ in range(rng.randint(0, 60))]
        world = rng.randint(1, 20)
        assert _makespan(widths, world) == lpt(widths, world), (world, sorted(widths))
    rng = random.Random(7)
    for _ in range(300):  # many shards per rank
        widths = [rng.choice([0, 1, 3, 4, 8, 16, 32, 64, 128]) for _ in range(rng.randint(0, 400))]
        world = rng.randint(1, 48)
        assert _makespan(widths, world) == lpt(widths, world), (world, sorted(widths))
    assert _makespan([], 8) == 0 and _makespan([0, 0], 3) == 0
    assert _makespan([16] * 1000, 128) == 16 * 8  # 1000 = 7 x 128 + 104: the busiest ranks get 8
    # loads 5|0, 5|4, 5|7, 8|7, 8|10: LPT's 10, not the optimum 9 (5+4 | 3+3+3)
    assert _makespan([5, 4, 3, 3, 3], 2) == 10
