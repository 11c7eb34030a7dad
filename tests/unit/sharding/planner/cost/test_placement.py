"""Placed shards (sharding/planner/cost/placement.py): what the cost model reads of a torchrec
``ShardingOption`` or a ``ShardingPlan``, shard by shard, written out by hand here."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.planner.types import Shard, ShardingOption
from torchrec.distributed.types import CacheParams, CacheStatistics, ParameterSharding, ShardingPlan

from sharding.planner.cost.placement import (
    PlacedShard,
    placed_from_option,
    placed_from_options,
    placed_from_plan,
    placed_on_rank,
    with_all_ranks,
    with_rank,
)


class HalfMisses(CacheStatistics):
    """A cache whose measured miss rate is half of ``1 - load_factor``."""

    @property
    def expected_lookups(self) -> float:
        return 0.0

    def expected_miss_rate(self, clf: float) -> float:
        return 0.5 * (1.0 - clf)

    @property
    def cacheability(self) -> float:
        return 0.5


def option(
    sharding_type: str = "table_wise",
    kernel: str = "fused",
    shards: tuple[tuple[int | None, int, int], ...] = ((0, 100, 8),),
    rows: int = 100,
    cols: int = 8,
    input_lengths: tuple[float, ...] = (2.0, 1.0),
    cache_params: CacheParams | None = None,
    name: str = "t",
) -> ShardingOption:
    """A ``rows x cols`` table's option with shards ``(rank, rows, cols)`` (rank None: not placed)."""
    return ShardingOption(
        name=name,
        tensor=torch.empty(rows, cols, device="meta"),
        module=("ebc", torch.nn.Module()),
        input_lengths=list(input_lengths),
        batch_size=16,
        sharding_type=sharding_type,
        partition_by="uniform",
        compute_kernel=kernel,
        shards=[Shard(size=[r, c], offset=[0, 0], rank=rank) for rank, r, c in shards],
        cache_params=cache_params,
    )


def test_a_table_wise_option_is_one_shard_with_the_features_pooling_summed_and_no_group():
    assert placed_from_option(option()) == [PlacedShard("t", "table_wise", "fused", 0, 100, 8, 100, 8, 3.0, None, (), None)]


def test_without_input_lengths_the_pooling_is_one():
    assert placed_from_option(option(input_lengths=()))[0].pooling == 1.0


def test_row_wise_shards_carry_their_rows_and_the_group_of_placed_ranks():
    so = option("row_wise", shards=((2, 60, 8), (3, 40, 8)))
    got = placed_from_option(so)
    assert [(p.rank, p.rows, p.cols, p.table_rows, p.table_cols) for p in got] == [(2, 60, 8, 100, 8), (3, 40, 8, 100, 8)]
    assert [p.group for p in got] == [(2, 3), (2, 3)]


@pytest.mark.parametrize(
    ("sharding_type", "grouped"),
    [
        ("row_wise", True),
        ("table_row_wise", True),
        ("data_parallel", True),
        ("column_wise", False),
        ("table_column_wise", False),
    ],
)
def test_only_row_and_data_parallel_types_have_a_group(sharding_type, grouped):
    got = placed_from_option(option(sharding_type, shards=((0, 100, 4), (1, 100, 4))))
    assert [p.group for p in got] == ([(0, 1), (0, 1)] if grouped else [(), ()])


def test_shards_without_a_rank_are_left_out_and_out_of_the_group():
    got = placed_from_option(option("row_wise", shards=((1, 50, 8), (None, 50, 8))))
    assert [(p.rank, p.group) for p in got] == [(1, (1,))]
    assert placed_from_option(option(shards=((None, 100, 8),))) == []


def test_a_caching_table_keeps_its_load_factor_and_its_measured_miss_rate():
    got = placed_from_option(option(kernel="fused_uvm_caching", cache_params=CacheParams(load_factor=0.4, stats=HalfMisses())))[0]
    assert (got.load_factor, got.miss_rate) == (0.4, pytest.approx(0.5 * (1 - 0.4)))


def test_the_miss_rate_is_read_at_the_default_load_factor_when_the_table_sets_none():
    got = placed_from_option(option(kernel="key_value", cache_params=CacheParams(stats=HalfMisses())))[0]
    assert (got.load_factor, got.miss_rate) == (None, pytest.approx(0.5 * (1 - 0.2)))


@pytest.mark.parametrize(
    ("kernel", "cache_params"),
    [
        ("fused", CacheParams(load_factor=0.4, stats=HalfMisses())),  # not a cache: the stats say nothing
        ("fused_uvm", CacheParams(load_factor=0.4, stats=HalfMisses())),
        ("fused_uvm_caching", CacheParams(load_factor=0.4)),  # no measurement
        ("fused_uvm_caching", None),
    ],
)
def test_no_miss_rate_without_a_cache_or_without_statistics(kernel, cache_params):
    got = placed_from_option(option(kernel=kernel, cache_params=cache_params))[0]
    assert got.miss_rate is None
    assert got.load_factor == (None if cache_params is None else 0.4)


def test_with_rank_moves_a_shard_and_leaves_the_original():
    s = PlacedShard("t", "row_wise", "fused", 1, 50, 8, 100, 8, 2.0, None, (1, 3))
    moved = with_rank(s, 3)
    assert moved == dataclasses.replace(s, rank=3) and s.rank == 1


def test_with_all_ranks_views_every_shard_on_one_rank_without_touching_the_option():
    so = option("row_wise", shards=((None, 60, 8), (None, 40, 8)))
    got = placed_from_option(with_all_ranks(so, 3))
    assert [(p.rank, p.rows) for p in got] == [(3, 60), (3, 40)]
    assert [sh.rank for sh in so.shards] == [None, None]


@pytest.mark.parametrize("kind", ["row_wise", "column_wise", "data_parallel", "table_wise"])
def test_placed_on_rank_is_the_view_placed(kind):
    shards = ((None, 60, 8), (None, 40, 8)) if kind != "table_wise" else ((None, 100, 8),)
    so = option(kind, shards=shards)
    got = placed_on_rank(so, 2)
    assert got == placed_from_option(with_all_ranks(so, 2))
    assert all(p.rank == 2 for p in got) and [sh.rank for sh in so.shards] == [None] * len(shards)
    assert got[0].group == ((2,) * len(shards) if kind in ("row_wise", "data_parallel") else ())


def test_placed_from_options_is_every_options_shards_in_order():
    plan = [option(name="a", shards=((1, 100, 8),)), option("column_wise", name="b", shards=((0, 100, 4), (1, 100, 4)))]
    assert [(p.table, p.rank, p.cols) for p in placed_from_options(plan)] == [("a", 1, 8), ("b", 0, 4), ("b", 1, 4)]


def _spec(*shards: tuple[int, int, int, int]) -> EnumerableShardingSpec:
    """Shards ``(rank, row offset, rows, cols)``."""
    return EnumerableShardingSpec(
        [ShardMetadata(shard_offsets=[off, 0], shard_sizes=[r, c], placement=f"rank:{rank}/cpu") for rank, off, r, c in shards]
    )


def test_a_sharding_plan_is_placed_from_its_specs_and_the_tables_shapes():
    plan = ShardingPlan(
        {
            "ebc": {
                "big": ParameterSharding("row_wise", "fused", [2, 3], _spec((2, 0, 60, 8), (3, 60, 40, 8))),
                "small": ParameterSharding(
                    "table_wise", "fused_uvm_caching", [1], _spec((1, 0, 10, 4)), cache_params=CacheParams(load_factor=0.5)
                ),
            }
        }
    )
    tables = {"big": {"num_embeddings": 100, "embedding_dim": 8}, "small": {"num_embeddings": 10, "embedding_dim": 4}}
    got = placed_from_plan(plan, tables, {"big": 3.0})
    assert got == [
        PlacedShard("big", "row_wise", "fused", 2, 60, 8, 100, 8, 3.0, None, (2, 3), None),
        PlacedShard("big", "row_wise", "fused", 3, 40, 8, 100, 8, 3.0, None, (2, 3), None),
        PlacedShard("small", "table_wise", "fused_uvm_caching", 1, 10, 4, 10, 4, 1.0, 0.5, (), None),  # no pooling given: 1
    ]


def test_a_data_parallel_plan_entry_without_a_spec_is_a_whole_replica_on_each_of_its_ranks():
    plan = ShardingPlan({"ebc": {"dp": ParameterSharding("data_parallel", "dense", [0, 1, 2])}})
    got = placed_from_plan(plan, {"dp": {"num_embeddings": 20, "embedding_dim": 16}}, {})
    assert [(p.rank, p.rows, p.cols, p.group) for p in got] == [(0, 20, 16, (0, 1, 2)), (1, 20, 16, (0, 1, 2)), (2, 20, 16, (0, 1, 2))]


def test_a_plan_entry_with_neither_spec_nor_ranks_places_nothing():
    plan = ShardingPlan({"ebc": {"dp": ParameterSharding("data_parallel", "dense")}})
    assert placed_from_plan(plan, {"dp": {"num_embeddings": 20, "embedding_dim": 16}}, {}) == []
