"""sharding/planner/build.py: the planner a run's settings ask for, torchrec's or the topology-aware one."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

from sharding.constants import MODEL_PARALLEL_TYPES
from sharding.planner.build import StorageExplainingPlanner, allowed_sharding_types, build_planner, embedding_tables
from sharding.planner.cache_sizing import IdFrequencyStats
from sharding.planner.topology_planner import TopologyAwarePlanner
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
SHARDERS = [EmbeddingBagCollectionSharder()]
MIB = 1024**2


@dataclass
class _Settings:
    planner: str = "torchrec"
    topology: str = ""
    sharding_types: tuple[str, ...] = ()
    target_hit_rate: float = 0.95


def _types(plan) -> dict[str, str]:
    return {t: ps.sharding_type for m in plan.plan.values() for t, ps in m.items()}


def test_tables_and_allowed_types():
    assert embedding_tables(meta_ebc([(10, 4), (20, 8), (30, 4)])) == ["t_0", "t_1", "t_2"]
    assert allowed_sharding_types(_Settings()) == list(MODEL_PARALLEL_TYPES)
    assert allowed_sharding_types(_Settings(sharding_types=("column_wise",))) == ["column_wise"]


@pytest.mark.parametrize("kind", ["torchrec", "topology"])
def test_the_settings_types_are_the_only_ones_planned(kind):
    model = meta_ebc([(100, 16), (200, 32)])
    planner = build_planner(_Settings(planner=kind, sharding_types=("column_wise",)), model, 2, 2, "cpu", 64)
    assert isinstance(planner, TopologyAwarePlanner if kind == "topology" else StorageExplainingPlanner)
    assert _types(planner.plan(model, SHARDERS)) == {"t_0": "column_wise", "t_1": "column_wise"}


def test_the_topology_planner_plans_for_the_runs_ranks_with_its_cache_statistics():
    model = meta_ebc([(100, 16), (200, 32)])
    stats = {"t_1": IdFrequencyStats([2] * 100, rows=200)}  # half the rows, twice each
    planner = build_planner(_Settings(planner="topology"), model, 3, 3, "cpu", 64, cache_stats=stats, target_hit_rate=0.5)
    assert (planner.cluster.name, planner.cluster.world_size, planner.target_hit_rate) == ("cpu-gloo-3", 3, 0.5)
    # a cache of a quarter of the rows serves half of the lookups
    assert planner.constraints_for(model)["t_1"].cache_params.load_factor == 0.25
    with pytest.raises(ValueError, match=r"^topology dgx-a100 is for cuda, the run is on cpu$"):
        build_planner(_Settings(planner="topology", topology="dgx-a100"), model, 8, 8, "cpu", 64)


def test_torchrecs_planner_gets_the_cache_statistics_as_constraints():
    model = meta_ebc([(100, 16), (200, 32)])
    stats = {"t_1": IdFrequencyStats([2] * 100, rows=200)}
    planner = build_planner(_Settings(sharding_types=("table_wise",)), model, 2, 2, "cpu", 64, cache_stats=stats)
    constraints = planner._constraints
    assert (constraints["t_0"].sharding_types, constraints["t_0"].cache_params) == (["table_wise"], None)
    # the default target, 95% of the lookups: 95 of the 100 ids seen, 0.475 of the rows, 0.48 on the 0.01 grid
    assert constraints["t_1"].cache_params.load_factor == 0.48
    assert constraints["t_1"].cache_params.stats is stats["t_1"]


def test_torchrecs_insufficient_storage_is_one_line_naming_what_the_embeddings_need():
    model = meta_ebc([(1_000_000, 64), (1000, 16)])  # 256,064,000 bytes of weights, plain SGD
    planner = build_planner(_Settings(), model, 2, 2, "cpu", 64, ddr_bytes=100 * MIB)
    with pytest.raises(PlannerError, match=r"^model does not fit 2 ranks \(cpu\): embeddings need 244\.20 MiB [^\n]*$") as err:
        planner.plan(model, SHARDERS)
    assert err.value.error_type == PlannerErrorType.INSUFFICIENT_STORAGE
