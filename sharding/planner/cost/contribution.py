"""What a row-wise or data-parallel table adds to a :class:`~sharding.planner.cost.state.CostState`,
recorded once per option: a search proposes the same options again and again, and 500 tables
data-parallel on 128 ranks are 64,000 shards in every proposal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sharding.planner.cost.placement import PlacedShard
from sharding.planner.cost.state import CostState


@dataclass(frozen=True)
class Contribution:
    """What one row-wise or data-parallel table placed shard i on rank i adds to a ``CostState``
    (``add_many``'s bulk case): it does not depend on the state, so a search that places the
    same option in every proposal computes it once (``TopologyCostModel.contribution``)."""

    types: tuple[str, ...]
    lookup: np.ndarray
    hbm_bytes: np.ndarray
    loads: tuple[tuple[str, np.ndarray], ...]

    @classmethod
    def of(cls, model: Any, shards: list[PlacedShard]) -> "Contribution | None":
        """None where ``add_many`` would add the shards one by one (their cost depends on the state)."""
        st = CostState(model)
        if not st.bulk_ok(shards):
            return None
        st.add_many(shards)
        return cls(tuple(sorted(st.types)), st.lookup, st.hbm_bytes, tuple(st.loads.items()))

    def add_to(self, st: CostState) -> None:
        """Adds it to ``st``: the same floats as ``add_many`` of its shards (each rank gets one
        term, so adding the recorded vector rounds the same)."""
        for t in self.types:
            st.mark_type(t)
        st.lookup += self.lookup
        st.hbm_bytes += self.hbm_bytes
        for phase, v in self.loads:
            st.add_load(phase, v)
