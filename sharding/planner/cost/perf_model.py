"""The perf model given to torchrec's planner as ``performance_model=``: the cost model's step
time, reusing the partitioner's score of the plan it just placed, and tracking the best plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrec.distributed.planner.types import ShardingOption

from sharding.planner.balance_proposer import BestPlanTracker
from sharding.planner.cost.model import TopologyCostModel, TopologyPerfModel

if TYPE_CHECKING:
    from sharding.planner.partitioners import TopologyPartitioner


class CachedPerfModel(TopologyPerfModel):
    """TopologyPerfModel that reuses the partitioner's score of the plan it just placed."""

    def __init__(self, cost_model: TopologyCostModel, partitioner: TopologyPartitioner | None) -> None:
        """``partitioner``: ours, whose score it reuses; None (a caller's own partitioner): no reuse."""
        super().__init__(cost_model)
        self.partitioner = partitioner
        self.tracker = BestPlanTracker(cost_model)

    def rate(self, plan: list[ShardingOption]) -> float:
        hit = self.partitioner.cached_step_time(plan) if self.partitioner is not None else None
        rating = hit * 1e3 if hit is not None else super().rate(plan)
        self.tracker.offer(plan, rating)
        return rating
