"""sharding/planner/proposers.py: the greedy proposers' patience, the per-table uniform proposer, the proposal
budget and the report of what cut a search."""

from __future__ import annotations

import logging

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.proposers import GridSearchProposer, UniformProposer

from sharding.planner.enumerators import TopologyEnumerator
from sharding.planner.job_topology import torchrec_topology
from sharding.planner.proposers import (
    BudgetedProposer,
    PatientGreedyProposer,
    PerTableUniformProposer,
    SearchReport,
    default_proposers,
    greedy_patience_for,
)
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)


def _space(specs, constraints):
    model = meta_ebc(specs)
    enumerator = TopologyEnumerator(torchrec_topology(load_topology("cpu-gloo")), 64, (2,), constraints)
    return enumerator.enumerate(model, [EmbeddingBagCollectionSharder()])


def _proposals(proposer, space, fits: bool = True) -> list[list[tuple[str, str, int]]]:
    proposer.load(space)
    out = []
    while (plan := proposer.propose()) is not None:
        out.append([(so.name, so.sharding_type, len(so.shards)) for so in plan])
        proposer.feedback(partitionable=fits, plan=plan, perf_rating=1.0)
    return out


class _Listed:
    """A proposer that proposes the plans it was given, in order, and records its feedback."""

    def __init__(self, plans: list) -> None:
        self.plans, self.fed = plans, []

    def load(self, search_space, enumerator=None) -> None:
        self.left = list(self.plans)

    def propose(self):
        return self.left.pop(0) if self.left else None

    def feedback(self, partitionable, plan=None, perf_rating=None, storage_constraint=None) -> None:
        self.fed.append((partitionable, perf_rating))


@pytest.mark.parametrize("tables, patience", [(0, 50), (1, 50), (40, 50), (41, 48), (100, 20), (499, 4), (500, 4), (10_000, 4)])
def test_greedy_patience_is_2000_over_the_tables_within_4_and_50(tables, patience):
    assert greedy_patience_for(tables) == patience


def test_a_patient_greedy_proposer_takes_its_threshold_from_the_search_space():
    cons = {f"t_{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for i in range(2)}
    space = _space([(100, 16), (100, 16)], cons)
    auto = PatientGreedyProposer()
    auto.load(space)
    assert auto._threshold == 50  # 2 tables: 2000 / 2, at most 50
    fixed = PatientGreedyProposer(patience=7)
    fixed.load(space)
    assert fixed._threshold == 7


def test_a_table_without_a_type_keeps_its_own_option_in_that_types_uniform_plan():
    cons = {
        "t_0": ParameterConstraints(sharding_types=["table_wise", "column_wise"], compute_kernels=["fused"]),
        "t_1": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]),
    }
    space = _space([(100, 16), (1000, 64)], cons)
    # torchrec's proposes a type only where every table has it: t_1's constraint cancels column-wise for t_0
    assert _proposals(UniformProposer(), space) == [[("t_0", "table_wise", 1), ("t_1", "table_wise", 1)]]
    # per table: t_0's column-wise option whose slowest shard is fastest (2 shards of 8 columns each
    # do half the lookups' work of the whole table), t_1 its only option
    assert _proposals(PerTableUniformProposer(), space) == [
        [("t_0", "table_wise", 1), ("t_1", "table_wise", 1)],
        [("t_0", "column_wise", 2), ("t_1", "table_wise", 1)],
    ]


def test_the_proposals_are_the_same_on_every_load_and_for_every_new_proposer():
    cons = {f"t_{i}": ParameterConstraints(compute_kernels=["fused"]) for i in range(3)}
    space = _space([(100, 16), (1000, 64), (300, 32)], cons)
    proposers = default_proposers()
    first = [_proposals(p, space, fits=False) for p in proposers]
    assert all(first)
    assert [_proposals(p, space, fits=False) for p in proposers] == first
    assert [_proposals(p, space, fits=False) for p in default_proposers()] == first
    # the grid search walks every combination: 5 options for each of the 3 tables
    assert len(first[0]) == 5**3


def test_the_default_proposers_in_order():
    proposers = default_proposers(patience=9)
    assert [type(p) for p in proposers] == [GridSearchProposer, PatientGreedyProposer, PatientGreedyProposer, PerTableUniformProposer]
    assert [(p._use_depth, p.patience) for p in proposers[1:3]] == [(True, 9), (False, 9)]


def test_the_budget_stops_a_proposer_and_counts_what_it_proposed_and_what_was_rated():
    inner = _Listed([["a"], ["b"], ["c"], ["d"], ["e"]])
    budgeted = BudgetedProposer(inner, max_proposals=3)
    budgeted.load([])
    got = []
    while (plan := budgeted.propose()) is not None:
        got.append(plan)
        budgeted.feedback(partitionable=True, perf_rating=float(len(got)))
    assert got == [["a"], ["b"], ["c"]]
    assert (budgeted.proposals, budgeted.evaluated, budgeted.cut, budgeted.exhausted) == (3, 3, True, False)
    assert inner.fed == [(True, 1.0), (True, 2.0), (True, 3.0)]
    assert budgeted.name == "_Listed"
    # loading again starts the count again; a proposer with fewer plans runs out by itself
    short = BudgetedProposer(_Listed([["a"]]), max_proposals=3)
    short.load([])
    assert short.propose() == ["a"] and short.propose() is None
    assert (short.proposals, short.cut, short.exhausted) == (1, False, True)
    budgeted.load([])
    assert (budgeted.proposals, budgeted.evaluated, budgeted.cut) == (0, 0, False)
    unlimited = BudgetedProposer(_Listed([[str(i)] for i in range(50)]), max_proposals=None)
    unlimited.load([])
    assert sum(1 for _ in iter(unlimited.propose, None)) == 50 and not unlimited.cut


@pytest.mark.parametrize("bad", [0, -1])
def test_a_budget_below_one_is_refused(bad):
    with pytest.raises(ValueError, match=rf"^max_proposals must be >= 1 or None, got {bad}$"):
        BudgetedProposer(_Listed([]), max_proposals=bad)


def test_the_search_report_names_what_cut_the_search():
    cut, done, stopped = (BudgetedProposer(_Listed([[i] for i in range(n)]), max_proposals=2) for n in (5, 1, 5))
    for p in (cut, done, stopped):
        p.load([])
    for _ in range(3):
        if cut.propose() is not None:
            cut.feedback(partitionable=True)
    assert done.propose() == [0]
    done.feedback(partitionable=True)
    assert done.propose() is None  # ran out by itself
    assert stopped.propose() == [0]
    stopped.feedback(partitionable=False)  # asked once, then never again (a clock ran out)
    report = SearchReport.of([cut, done, stopped], max_proposals=2, timeout_seconds=None)
    assert (report.proposals, report.budget_cut, report.timeout_cut, report.cut) == (
        {"_Listed#0": 2, "_Listed#1": 1, "_Listed#2": 1},
        ["_Listed#0"],
        False,
        True,
    )
    report.step_s, report.lower_bound_s = 3e-3, 2e-3
    assert report.line() == (
        "planner search cut: the budget of 2 proposals per proposer stopped _Listed#0 after 4 proposals; "
        "plan 3 ms, lower bound of any plan 2 ms (1.50x)"
    )
    # with a timeout, a proposer neither cut nor run out was stopped by the clock
    timed = SearchReport.of([cut, done, stopped], max_proposals=2, timeout_seconds=5)
    assert timed.timeout_cut
    assert timed.line() == (
        "planner search cut: the budget of 2 proposals per proposer stopped _Listed#0; torchrec's timeout_seconds stopped "
        "the search (the plan depends on the machine's load) after 4 proposals"
    )
    assert not SearchReport.of([done], max_proposals=2, timeout_seconds=5).cut
