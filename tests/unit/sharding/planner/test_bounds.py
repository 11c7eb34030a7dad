"""sharding/planner/bounds.py: a lower bound on the modelled step time of any plan of a search space."""

from __future__ import annotations

import itertools
import logging

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from sharding.planner.bounds import step_time_lower_bound
from sharding.planner.constraints import default_constraints
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.enumerators import TopologyEnumerator
from sharding.planner.job_topology import cpu_topology_like, torchrec_topology
from sharding.planner.partitioners import TopologyPartitioner
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
CPU = load_topology("cpu-gloo")  # one host, one NUMA node of 6 GB/s shared by its CPU ranks
BATCH = 64
# gloo's collective latency on the CI VM (cost/model.py: CPU_COLLECTIVE_LATENCY_S), 5 collectives a
# step for table-, column- and table-column-wise
TW_LATENCY_S = 5 * 170e-6


def _space(cluster, specs):
    model = meta_ebc(specs)
    topology = torchrec_topology(cluster)
    enumerator = TopologyEnumerator(topology, BATCH, (2, 4), default_constraints(model, "cpu"))
    return enumerator.enumerate(model, [EmbeddingBagCollectionSharder()]), topology


def test_an_empty_search_space_bounds_nothing():
    assert step_time_lower_bound(TopologyCostModel(CPU, BATCH), []) == 0.0


def test_one_rank_bound_by_hand():
    # One rank: no links, so the bound is the latency of one sharding type plus every table's
    # lookups. A lookup of a 16-column fp32 row moves one 64-byte cache line, 3 times (forward,
    # backward, optimizer); the rank has the node's 6 GB/s. 2 tables x 64 lookups.
    one = cpu_topology_like(CPU, 1)
    assert one.hosts[0].numa_nodes[0].ddr_bw == 6e9
    space, _ = _space(one, [(100, 16), (300, 16)])
    expected = TW_LATENCY_S + 2 * BATCH * 3 * 64 / 6e9
    assert step_time_lower_bound(TopologyCostModel(one, BATCH), space) == pytest.approx(expected, rel=1e-12)
    # a 32-column row is 2 cache lines: that table's lookups double
    space, _ = _space(one, [(100, 16), (300, 32)])
    expected = TW_LATENCY_S + BATCH * 3 * 64 / 6e9 + BATCH * 3 * 128 / 6e9
    assert step_time_lower_bound(TopologyCostModel(one, BATCH), space) == pytest.approx(expected, rel=1e-12)


def test_the_bound_is_below_every_plan_of_the_space_and_fewer_options_never_lower_it():
    model = TopologyCostModel(CPU, BATCH)
    space, topology = _space(CPU, [(100, 16), (1000, 64), (200, 32)])
    bound = step_time_lower_bound(model, space)
    by_table: dict[str, list] = {}
    for so in space:
        by_table.setdefault(so.name, []).append(so)
    partitioner = TopologyPartitioner(model, compare_default=False)
    steps = []
    for plan in itertools.product(*by_table.values()):  # every plan of the space, placed by the partitioner
        plan = list(plan)
        partitioner.partition(plan, topology)
        steps.append(model.score(plan).step_time)
        assert step_time_lower_bound(model, plan) >= bound * (1 - 1e-12)  # a plan is a smaller search space
    assert len(steps) == 5**3  # per table: table-wise, column- and table-column-wise whole and in 2 shards
    assert bound <= min(steps) * (1 + 1e-12)
    assert bound > TW_LATENCY_S
