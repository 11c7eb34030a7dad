"""Shards as the cost model sees them: :class:`PlacedShard` (one shard of one table on one rank),
and the conversions from what the planner and the plan files hold (torchrec ``ShardingOption``
lists, a ``ShardingPlan`` with its tables' shapes) into placed shards."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torchrec.distributed.planner.types import ShardingOption
from torchrec.distributed.types import ShardingPlan

from sharding.constants import DEFAULT_LOAD_FACTOR, SSD_KERNELS


@dataclass(frozen=True)
class PlacedShard:
    """One shard of one table on one rank (the unit the model scores)."""

    table: str
    sharding_type: str  # torchrec ShardingType value
    kernel: str  # torchrec EmbeddingComputeKernel value
    rank: int
    rows: int
    cols: int
    table_rows: int
    table_cols: int
    pooling: float = 1.0  # sum of the table's features' pooling factors
    load_factor: float | None = None
    group: tuple[int, ...] = ()  # the ranks holding the table's shards (RW / TWRW / DP group)
    miss_rate: float | None = None  # fused_uvm_caching, key_value: measured miss rate at load_factor (None: 1 - load_factor)


def with_rank(s: PlacedShard, rank: int) -> PlacedShard:
    """``s`` on another rank."""
    return replace(s, rank=rank)


# --- conversions --------------------------------------------------------------------------------


def _lf(cache_params) -> float | None:
    return None if cache_params is None else cache_params.load_factor


def _miss(kernel: str, cache_params) -> float | None:
    """The measured miss rate of a caching or key_value table (its CacheParams' stats at its load factor)."""
    if kernel not in ("fused_uvm_caching",) + SSD_KERNELS or cache_params is None or getattr(cache_params, "stats", None) is None:
        return None
    lf = DEFAULT_LOAD_FACTOR if cache_params.load_factor is None else cache_params.load_factor
    return float(cache_params.stats.expected_miss_rate(lf))


def with_all_ranks(so: ShardingOption, rank: int) -> ShardingOption:
    """A light view of ``so`` with every shard on ``rank``, for ``placed_from_option`` (the
    partitioner and the bound score an option's shards before they have ranks)."""

    class _V:
        pass

    v = _V()
    v.__dict__.update(
        name=so.name,
        tensor=so.tensor,
        input_lengths=so.input_lengths,
        sharding_type=so.sharding_type,
        compute_kernel=so.compute_kernel,
        cache_params=so.cache_params,
        shards=[replace(sh, rank=rank) for sh in so.shards],
    )
    return v  # type: ignore[return-value]


def placed_from_option(so: ShardingOption, rank_of=None) -> list[PlacedShard]:
    ranks = tuple(sh.rank for sh in so.shards if sh.rank is not None)
    return _placed(so, [(sh, sh.rank) for sh in so.shards if sh.rank is not None], ranks)


def placed_on_rank(so: ShardingOption, rank: int) -> list[PlacedShard]:
    """``placed_from_option(with_all_ranks(so, rank))`` without the view: the prototypes the
    partitioner prices an option's shards from before they have ranks."""
    return _placed(so, [(sh, rank) for sh in so.shards], (rank,) * len(so.shards))


def _placed(so: ShardingOption, shards: list[tuple[Any, int]], ranks: tuple[int, ...]) -> list[PlacedShard]:
    rows, cols = int(so.tensor.shape[0]), int(so.tensor.shape[1])
    pooling = float(sum(so.input_lengths)) if so.input_lengths else 1.0
    group = ranks if so.sharding_type in ("row_wise", "table_row_wise", "data_parallel") else ()
    lf, miss = _lf(so.cache_params), _miss(so.compute_kernel, so.cache_params)
    return [
        PlacedShard(
            so.name,
            so.sharding_type,
            so.compute_kernel,
            rank,
            int(sh.size[0]),
            int(sh.size[1]),
            rows,
            cols,
            pooling,
            lf,
            group,
            miss,
        )
        for sh, rank in shards
    ]


def placed_from_options(plan: list[ShardingOption]) -> list[PlacedShard]:
    return [p for so in plan for p in placed_from_option(so)]


def placed_from_plan(plan: ShardingPlan, tables: dict[str, dict], pooling: dict[str, float]) -> list[PlacedShard]:
    out = []
    for mplan in plan.plan.values():
        for name, ps in mplan.items():
            shape = tables[name]
            rows, cols = int(shape["num_embeddings"]), int(shape["embedding_dim"])
            lf, miss = _lf(ps.cache_params), _miss(ps.compute_kernel, ps.cache_params)
            pf = float(pooling.get(name, 1.0))
            if ps.sharding_spec is not None:
                shards = [(s.placement.rank(), s.shard_sizes[0], s.shard_sizes[1]) for s in ps.sharding_spec.shards]
            else:
                shards = [(r, rows, cols) for r in (ps.ranks or [])]
            ranks = tuple(r for r, _, _ in shards)
            group = ranks if ps.sharding_type in ("row_wise", "table_row_wise", "data_parallel") else ()
            for r, nr, nc in shards:
                out.append(PlacedShard(name, ps.sharding_type, ps.compute_kernel, r, int(nr), int(nc), rows, cols, pf, lf, group, miss))
    return out
