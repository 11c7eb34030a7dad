"""The recorded contribution of a row-wise / data-parallel table is ``add_many``, bit for bit."""

from __future__ import annotations

import numpy as np

from sharding.planner.cost.contribution import Contribution
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import PlacedShard
from sharding.topology.topology_file import load_topology


def _shards(table, st, kernel, ranks, rows, cols):
    per = rows // len(ranks)
    return [PlacedShard(table, st, kernel, r, per, cols, rows, cols, 2.0, None, tuple(ranks)) for r in ranks]


def test_a_tables_contribution_equals_add_many():
    """What a row-wise / data-parallel option adds, recorded once, adds the same floats as
    ``add_many`` on a state that already holds other shards."""
    cm = TopologyCostModel(load_topology("dgx-a100-2host"), 512)
    for st_type in ("row_wise", "data_parallel"):
        shards = _shards("t", st_type, "fused", list(range(16)), 1_600_000, 64)
        a, b = cm.new_state(), cm.new_state()
        for st in (a, b):
            st.add(PlacedShard("x", "table_wise", "fused", 3, 1000, 32, 1000, 32))
            st.add_many(_shards("r", "row_wise", "fused", list(range(16)), 80_000, 16))
        a.add_many(shards)
        Contribution.of(cm, shards).add_to(b)
        for f in ("lookup", "hbm_bytes", "host_bytes"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
        assert a.loads.keys() == b.loads.keys() and all(np.array_equal(a.loads[p], b.loads[p]) for p in a.loads)
        assert a.comm_time() == b.comm_time() and a.types == b.types
    assert Contribution.of(cm, shards[:3]) is None  # not the whole group: added one by one
