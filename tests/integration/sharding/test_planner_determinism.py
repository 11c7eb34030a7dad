"""Plans depend only on their inputs: no wall-clock limit in the search, a budget of proposals
per proposer (sharding/planner/proposers.py ``BudgetedProposer``) that says when it cut a search."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.proposers import GreedyProposer
from torchrec.distributed.planner.types import PlannerError

from sharding.planner.bounds import step_time_lower_bound
from sharding.planner.proposers import BudgetedProposer, SearchReport
from sharding.planner.topology_planner import ModelDoesNotFitError, TopologyAwarePlanner
from tests.support.plan_models import meta_ebc as ebc

ROOT = Path(__file__).resolve().parents[3]


def _placements(plan):
    return {
        name: (ps.sharding_type, ps.compute_kernel, ps.ranks, str(ps.sharding_spec)) for mp in plan.plan.values() for name, ps in mp.items()
    }


def test_no_wall_clock_limit_by_default_and_every_proposer_runs_to_its_own_end():
    planner = TopologyAwarePlanner("dgx-a100-2host", 512)
    assert planner.timeout_seconds is None  # torchrec's default; a clock would make plans load-dependent
    planner.plan(ebc(), [EmbeddingBagCollectionSharder()])
    report = planner.last_search
    assert not report.cut and report.budget_cut == [] and not report.timeout_cut
    assert all(isinstance(p, BudgetedProposer) and p.exhausted for p in planner.proposers)
    assert report.proposals["BalanceProposer#4"] > 0  # the last proposer got its turn
    # torchrec counts the proposals it evaluates (a repeat is a cache hit); we count every one made
    assert sum(report.proposals.values()) >= planner.last_planner._num_proposals > 0


def test_budget_cuts_the_same_way_every_time_and_says_how_far_from_the_bound(caplog):
    """A budget of 3 proposals per proposer: each greedy proposer stops at 3, the plan is the same
    in two searches, and one warning names the cut proposers, the plan's step and the lower bound."""
    plans, lines = [], []
    for _ in range(2):
        planner = TopologyAwarePlanner("dgx-a100-2host", 512, max_proposals=3)
        with caplog.at_level(logging.WARNING, logger="sharding.planner.topology_planner"):
            caplog.clear()
            plans.append(_placements(planner.plan(ebc(), [EmbeddingBagCollectionSharder()])))
        lines.append([r.getMessage() for r in caplog.records if "search cut" in r.getMessage()])
        report = planner.last_search
        assert {"PatientGreedyProposer#1", "PatientGreedyProposer#2"} <= set(report.budget_cut)
        assert all(report.proposals[n] == 3 for n in report.budget_cut)
        assert all(n in report.budget_cut or count < 3 for n, count in report.proposals.items())
        assert report.step_s == pytest.approx(planner.last_cost.step_time)
        assert report.lower_bound_s == pytest.approx(step_time_lower_bound(planner.cost_model, planner.search_space))
        assert report.lower_bound_s <= report.step_s
    assert plans[0] == plans[1]
    assert lines[0] == lines[1] and len(lines[0]) == 1
    assert f"budget of 3 proposals per proposer stopped {', '.join(report.budget_cut)} after" in lines[0][0]
    assert f"({report.step_s / report.lower_bound_s:.2f}x)" in lines[0][0]


class _SlowGreedy(GreedyProposer):
    """torchrec's greedy proposer that takes 1.1 s over each plan's feedback (a busy machine)."""

    def feedback(self, *args, **kwargs):
        time.sleep(1.1)
        return super().feedback(*args, **kwargs)


def test_a_timeout_the_caller_sets_is_reported_as_load_dependent(caplog):
    """With torchrec's timeout_seconds the search stops by the clock: the report says so."""
    planner = TopologyAwarePlanner("dgx-a100-2host", 512, timeout_seconds=1, proposer=[_SlowGreedy(), GreedyProposer()])
    with caplog.at_level(logging.WARNING, logger="sharding.planner.topology_planner"):
        planner.plan(ebc(), [EmbeddingBagCollectionSharder()])
    report = planner.last_search
    assert report.timeout_cut and report.budget_cut == []
    assert report.proposals == {"_SlowGreedy#0": 1, "GreedyProposer#1": 0}
    assert any(
        "timeout_seconds stopped the search (the plan depends on the machine's load) after 1 proposals" in r.getMessage()
        for r in caplog.records
    )


def test_a_timeout_before_any_plan_is_not_called_a_model_that_does_not_fit():
    planner = TopologyAwarePlanner("dgx-a100-2host", 512, timeout_seconds=1e-9)
    with pytest.raises(
        PlannerError,
        match=r"^no plan: timeout_seconds=1e-09 stopped the search after 0 proposals, "
        r"before any plan was made",
    ) as e:
        planner.plan(ebc(), [EmbeddingBagCollectionSharder()])
    assert not isinstance(e.value, ModelDoesNotFitError)


def test_budget_rejects_nonsense():
    with pytest.raises(ValueError, match="max_proposals must be >= 1 or None, got 0"):
        TopologyAwarePlanner("dgx-a100", 512, max_proposals=0)


def test_search_report_line_without_a_bound():
    r = SearchReport(proposals={"A#0": 5}, budget_cut=["A#0"], max_proposals=5)
    assert r.line() == "planner search cut: the budget of 5 proposals per proposer stopped A#0 after 5 proposals"


def test_recsys_plan_make_is_byte_identical_idle_and_under_a_cpu_load_of_four(tmp_path):
    """The same `recsys-plan make` on an idle machine and beside 4 busy processes (2x the cores of
    the CI machine) writes the same bytes."""
    cmd = [
        sys.executable,
        "-m",
        "recsys.plan_cli",
        "make",
        "--config",
        str(ROOT / "configs/experiments/demo.yaml"),
        "--topology",
        "dgx-a100-2host",
    ]
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    idle = tmp_path / "idle.json"
    subprocess.run(cmd + ["--out", str(idle)], check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        time.sleep(0.5)
        loaded = tmp_path / "loaded.json"
        subprocess.run(cmd + ["--out", str(loaded)], check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert idle.read_bytes() == loaded.read_bytes()
