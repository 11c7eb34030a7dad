"""The perf model handed to torchrec's planner (sharding/planner/cost/perf_model.py): the cost
model's step time in milliseconds, or the partitioner's score of the plan it has just placed,
and the best plan rated so far. On the CPU/gloo pair, whose step is worked by hand here."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.planner.types import Shard, ShardingOption

from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.perf_model import CachedPerfModel
from sharding.topology.topology_file import load_topology

CLUSTER = load_topology("cpu-gloo")  # one host, 2 CPU ranks sharing a 6 GB/s NUMA node (3 GB/s each for lookups)
BATCH = 64
LATENCY = 170e-6  # one gloo collective
IDS = BATCH * (8 + 4)  # one rank's ids and lengths for a table of pooling 1
POOLED = BATCH * 16 * 4  # a 16-column table's pooled output for one rank's batch
LOOKUP = BATCH * 2 * 3 * 64 / 3e9  # both ranks' ids, three passes over one 64-byte line


def table(name: str, rank: int) -> ShardingOption:
    """A 100 x 16 table-wise table on ``rank``."""
    return ShardingOption(
        name=name,
        tensor=torch.empty(100, 16, device="meta"),
        module=("ebc", torch.nn.Module()),
        input_lengths=[1.0],
        batch_size=BATCH,
        sharding_type="table_wise",
        partition_by="uniform",
        compute_kernel="fused",
        shards=[Shard(size=[100, 16], offset=[0, 0], rank=rank)],
    )


class ScoredOnce:
    """A partitioner that has just placed ``plan`` and scored it ``step`` seconds."""

    def __init__(self, plan: list[ShardingOption], step: float) -> None:
        self.plan, self.step = plan, step

    def cached_step_time(self, plan: list[ShardingOption]) -> float | None:
        return self.step if plan is self.plan else None


@pytest.fixture
def model() -> TopologyCostModel:
    return TopologyCostModel(CLUSTER, BATCH)


def test_without_a_partitioner_the_rating_is_the_models_step_in_milliseconds(model):
    plan = [table("t", 1)]
    perf = CachedPerfModel(model, None)
    step = LOOKUP + (IDS + 2 * POOLED) / 6e9 + 5 * LATENCY  # the owner's lookups, the all-to-alls through DDR
    assert perf.rate(plan) == pytest.approx(step * 1e3, rel=1e-12)
    assert perf.tracker.rating == pytest.approx(step * 1e3, rel=1e-12)
    assert perf.tracker.options == plan and perf.tracker.bottleneck_tables == ["t"]


def test_the_partitioners_score_of_the_plan_it_placed_is_reused(model):
    plan = [table("t", 1)]
    perf = CachedPerfModel(model, ScoredOnce(plan, 0.004))
    assert perf.rate(plan) == pytest.approx(4.0)  # not the model's 0.86 ms
    assert perf.tracker.rating == pytest.approx(4.0)


def test_a_plan_the_partitioner_has_not_scored_is_rated_by_the_model(model):
    perf = CachedPerfModel(model, ScoredOnce([table("t", 1)], 0.004))
    other = [table("t", 1)]
    assert perf.rate(other) == pytest.approx((LOOKUP + (IDS + 2 * POOLED) / 6e9 + 5 * LATENCY) * 1e3, rel=1e-12)


def test_the_tracker_keeps_the_best_plan_rated(model):
    perf = CachedPerfModel(model, None)
    stacked = [table("a", 0), table("b", 0)]
    split = [table("a", 0), table("b", 1)]
    comm = (2 * IDS + 4 * POOLED) / 6e9 + 5 * LATENCY  # one DDR link carries both tables' all-to-alls either way
    assert perf.rate(stacked) == pytest.approx((2 * LOOKUP + comm) * 1e3, rel=1e-12)
    assert perf.rate(split) == pytest.approx((LOOKUP + comm) * 1e3, rel=1e-12)
    perf.rate(stacked)
    assert perf.tracker.options == split and perf.tracker.rating == pytest.approx((LOOKUP + comm) * 1e3, rel=1e-12)
