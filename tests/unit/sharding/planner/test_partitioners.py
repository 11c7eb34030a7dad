"""sharding/planner/partitioners.py: greedy placement by the modelled step time, the local search after it, and the
comparison with torchrec's greedy placement."""

from __future__ import annotations

import copy
import logging
import re

import numpy as np
import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.types import PlannerError

from sharding.planner.constraints import default_constraints
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import placed_from_options
from sharding.planner.enumerators import TopologyEnumerator
from sharding.planner.job_topology import cpu_topology_like, torchrec_topology
from sharding.planner.partitioners import TopologyPartitioner, refine_placement
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
CLUSTER = load_topology("cpu-gloo")  # one host, 2 CPU ranks
BATCH = 64


def _table_wise(specs, topology=None):
    """The table-wise option of each table (rows, dim), enumerated for the 2 CPU ranks."""
    model = meta_ebc(specs)
    enumerator = TopologyEnumerator(topology or torchrec_topology(CLUSTER), BATCH, (), default_constraints(model, "cpu"))
    return [so for so in enumerator.enumerate(model, [EmbeddingBagCollectionSharder()]) if so.sharding_type == "table_wise"]


def _ranks(plan) -> dict[str, list[int]]:
    return {so.name: [sh.rank for sh in so.shards] for so in plan}


def test_two_equal_tables_go_to_two_ranks():
    plan = _table_wise([(100, 16), (100, 16)])
    TopologyPartitioner(TopologyCostModel(CLUSTER, BATCH)).partition(plan, torchrec_topology(CLUSTER))
    assert sorted(r for rs in _ranks(plan).values() for r in rs) == [0, 1]


def test_a_wide_table_gets_a_rank_to_itself():
    # a 64-column row is 4 cache lines, a 16-column row one: the wide table's lookups are 4x a
    # narrow one's, so the two narrow tables share the other rank
    plan = _table_wise([(100, 16), (1000, 64), (100, 16)])
    TopologyPartitioner(TopologyCostModel(CLUSTER, BATCH)).partition(plan, torchrec_topology(CLUSTER))
    ranks = _ranks(plan)
    assert ranks["t_0"] == ranks["t_2"] != ranks["t_1"]


def test_a_table_that_fits_no_rank_and_a_world_size_mismatch_are_planner_errors():
    small_host = torchrec_topology(CLUSTER, ddr_bytes=1000)  # 1000 bytes of host memory per rank
    plan = _table_wise([(100, 16)], small_host)
    need = plan[0].shards[0].storage
    with pytest.raises(PlannerError, match=f"^{re.escape(f't_0 (table_wise, fused): a shard needing {need} fits on no rank')}$"):
        TopologyPartitioner(TopologyCostModel(CLUSTER, BATCH)).partition(plan, small_host)
    # the cost model is for 2 ranks: a 1-rank torchrec topology is refused
    one_rank = torchrec_topology(cpu_topology_like(CLUSTER, 1))
    with pytest.raises(PlannerError, match=r"^topology world size 2 != planner world size 1$"):
        TopologyPartitioner(TopologyCostModel(CLUSTER, BATCH)).partition(_table_wise([(100, 16)], one_rank), one_rank)


def test_the_local_search_moves_a_shard_off_the_busy_rank():
    model = TopologyCostModel(CLUSTER, BATCH)
    plan = _table_wise([(100, 16), (100, 16)])
    for so in plan:  # both on rank 0
        so.shards[0].rank = 0
    state = model.new_state()
    for p in placed_from_options(plan):
        state.add(p)
    hbm_free = np.zeros(2)  # CPU shards hold no HBM
    assert refine_placement(state, plan, hbm_free, np.array([0, 0])) == 1
    assert sorted(rs[0] for rs in _ranks(plan).values()) == [0, 1]
    # balanced already: nothing to do
    again = model.new_state()
    for p in placed_from_options(plan):
        again.add(p)
    assert refine_placement(again, plan, hbm_free, np.array([0, 0])) == 0


def test_the_step_time_of_the_last_placement_is_kept_for_that_plan_only():
    model = TopologyCostModel(CLUSTER, BATCH)
    partitioner = TopologyPartitioner(model)
    plan = _table_wise([(100, 16), (1000, 64)])
    partitioner.partition(plan, torchrec_topology(CLUSTER))
    assert partitioner.cached_step_time(plan) == model.score(plan).step_time
    assert partitioner.cached_step_time(list(plan)) is None  # another list
    plan[0].shards[0].rank = 1 - plan[0].shards[0].rank
    assert partitioner.cached_step_time(plan) is None  # the same list, placed differently


def test_the_comparison_keeps_the_better_of_ours_and_torchrecs_placement():
    model = TopologyCostModel(CLUSTER, BATCH)
    topology = torchrec_topology(CLUSTER)
    specs = [(100, 16), (1000, 64), (100, 16), (500, 32), (50, 8)]
    plan = _table_wise(specs)
    partitioner = TopologyPartitioner(model)
    partitioner.partition(plan, topology)
    theirs = GreedyPerfPartitioner().partition(copy.deepcopy(plan), copy.deepcopy(topology))
    theirs_ranks, theirs_step = _ranks(theirs), model.score(theirs).step_time
    # ours as placed: as good as torchrec's by the model (a tie keeps ours)
    ours_ranks = _ranks(plan)
    assert model.score(plan).step_time == pytest.approx(theirs_step, rel=1e-12) and ours_ranks != theirs_ranks
    assert _ranks(partitioner.compare_with_default(plan)) == ours_ranks
    # ours made worse (every table on rank 0): torchrec's placement is taken
    for so in plan:
        so.shards[0].rank = 0
    assert _ranks(partitioner.compare_with_default(plan)) == theirs_ranks
    # turned off: the plan comes back as placed
    off = TopologyPartitioner(model, compare_default=False)
    off.partition(plan, topology)
    for so in plan:
        so.shards[0].rank = 0
    assert _ranks(off.compare_with_default(plan)) == {f"t_{i}": [0] for i in range(len(specs))}
