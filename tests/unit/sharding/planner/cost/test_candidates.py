"""The greedy placement's scores of every candidate rank at once (``candidates.py``) against
states the shard was added to, and the state's running products they read."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sharding.planner.cost.candidates import candidate_scores
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import PlacedShard
from sharding.topology.topology_file import load_topology


def test_candidate_scores_spread_only_for_ties():
    """With ``ties``, the spread comes for the candidates whose step ties with the lowest (the
    same numbers as without), inf for the others; both ways of computing it (many ties, one)."""
    m = TopologyCostModel(load_topology("dgx-a100-2host"), 512)
    few, busy = m.new_state(), m.new_state()
    for r in range(m.world):
        if r in (3, 5, 9):
            few.add(PlacedShard(f"x{r}", "table_wise", "fused", r, 1000, 32, 1000, 32))
        if r != 7:
            busy.add(PlacedShard(f"b{r}", "table_wise", "fused", r, 10**6, 256, 10**6, 256, 20.0))
    proto = PlacedShard("y", "table_wise", "fused", 0, 1000, 16, 1000, 16, 2.0)
    ties = []
    for st in (few, busy):
        steps, spreads = candidate_scores(st, proto, list(range(m.world)))
        s2, sp2 = candidate_scores(st, proto, list(range(m.world)), ties=1e-9)
        assert np.array_equal(steps, s2)
        tied = steps <= steps.min() * (1 + 1e-9)
        assert np.isinf(sp2[~tied]).all()
        assert sp2[tied] == pytest.approx(spreads[tied], rel=1e-12)
        ties.append(int(tied.sum()))
    assert ties[0] > m.world // 2 and ties[1] == 1


def test_the_states_running_products_equal_the_direct_ones():
    """``CostState.dots``: every rank's link row times an all-to-all phase's loads, kept by the
    state's own adds; dropped when something else loads the phase; copied with the state."""
    m = TopologyCostModel(load_topology("dgx-a100-2host"), 512)
    L = m.links
    st = m.new_state()
    for r, (t, cols) in enumerate([("table_wise", 32), ("column_wise", 16), ("table_wise", 128), ("column_wise", 64)] * 3):
        st.add(PlacedShard(f"x{r}", t, "fused", (5 * r) % m.world, 1000, cols, 1000, cols, 1.0 + r))
    for t in ("table_wise", "column_wise"):
        for phase, mat in ((f"{t}:ids", L.in_inv), (f"{t}:fwd", L.out_inv), (f"{t}:bwd", L.in_inv)):
            assert st.dots[phase] == pytest.approx(mat @ st.loads[phase], rel=1e-12)
    twin = st.copy()
    st.add_load("table_wise:ids", L.in_inv[0])
    assert "table_wise:ids" not in st.dots and "table_wise:ids" in twin.dots
    proto = PlacedShard("y", "table_wise", "fused", 0, 1000, 16, 1000, 16, 2.0)
    steps, spreads = candidate_scores(st, proto, list(range(m.world)))  # the direct product where none is kept
    for r in (0, 7):
        trial = st.copy()
        trial.add(dataclasses.replace(proto, rank=r))
        assert steps[r] == pytest.approx(trial.step_time(), rel=1e-12)
        assert spreads[r] == pytest.approx(trial.spread(), rel=1e-9)
