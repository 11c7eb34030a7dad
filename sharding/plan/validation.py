"""The one check of a plan's contents, shared by ``recsys-plan validate``/``show``, ``load_plan``,
``save_plan`` and the pre-launch check of ``recsys train``.

A plan file can be well-formed JSON and still unusable: a sharding type or kernel torchrec does not
have, a kernel that does not go with its sharding type, shards that leave a gap in the table or
overlap or run past its end, ranks outside the world. torchrec notices these only inside every
worker, with a traceback; here each is one line naming the file and the key, before any worker.

Checked, per table: ``sharding_type`` is a torchrec ``ShardingType``; ``compute_kernel`` is an
``EmbeddingComputeKernel`` that torchrec's embedding-bag sharder offers for that sharding type on
the plan's compute device (``key_value``, the SSD tier, on a CPU plan gets its own line: FBGEMM's
SSD kernels run on CUDA only); ``ranks`` are in [0, world); shards (every type but data-parallel) are
placed on those ranks and tile the table exactly (no gap, no overlap, in bounds): table-wise is one
shard of the whole table, column-wise / table-column-wise split dim 1 only, row-wise /
table-row-wise split dim 0 only. Per plan: each table is planned once, and the tables are the ones
the file's header records (with their shapes).

    problems = plan_problems(plan, header, "plan.json")      # [] when usable
    validate_plan(plan, header, "plan.json")                  # raises PlanFileError(problems[0])
"""

from __future__ import annotations

from typing import Any

from torchrec.distributed.types import ParameterSharding, ShardingPlan, ShardingType

from sharding.constants import SSD_KERNELS
from sharding.plan.errors import PlanFileError

_ROWS = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
_COLS = (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)
_DP = ShardingType.DATA_PARALLEL.value
_TW = ShardingType.TABLE_WISE.value


def _sharding_types() -> list[str]:
    return [t.value for t in ShardingType]


def _kernels() -> list[str]:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    return [k.value for k in EmbeddingComputeKernel]


def _kernels_for(sharding_type: str, device: str) -> list[str]:
    """Kernels torchrec's embedding-bag sharder offers for this sharding type and device."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder().compute_kernels(sharding_type, device)


def _param_problems(ps: ParameterSharding, key: str, shape: tuple[int, int] | None, world: int, device: str) -> list[str]:
    """Problems of one table's placement; ``key`` is its path in the file (modules.<m>.<table>)."""
    st, kernel = ps.sharding_type, ps.compute_kernel
    if st not in _sharding_types():
        return [f"key '{key}.sharding_type': '{st}' is not a torchrec sharding type (one of {', '.join(_sharding_types())})"]
    if kernel not in _kernels():
        return [f"key '{key}.compute_kernel': '{kernel}' is not a torchrec compute kernel (one of {', '.join(_kernels())})"]
    allowed = _kernels_for(st, device)
    if kernel in SSD_KERNELS and device != "cuda":
        return [
            f"key '{key}.compute_kernel': '{kernel}' keeps the table on SSD with FBGEMM's SSD kernels, which run on "
            f"CUDA only; this plan is for {device} (use fused there, or plan for a cuda topology with an SSD tier)"
        ]
    if kernel not in allowed:
        return [
            f"key '{key}.compute_kernel': torchrec does not run a {st} table with kernel '{kernel}' on {device} "
            f"(allowed: {', '.join(allowed)})"
        ]
    ranks = list(ps.ranks or [])
    if not ranks:
        return [f"key '{key}.ranks': no ranks"]
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        return [f"key '{key}.ranks': rank {bad[0]} is outside the world of {world} ranks (0..{world - 1})"]
    spec = ps.sharding_spec
    if st == _DP:
        if spec is not None:
            return [f"key '{key}.shards': a data_parallel table has no shards (a full copy on every rank)"]
        if sorted(ranks) != list(range(world)):
            return [f"key '{key}.ranks': a data_parallel table is on every rank (0..{world - 1}), got {ranks}"]
        return []
    if spec is None or not spec.shards:
        return [f"key '{key}.shards': a {st} table needs shards"]
    shards = [(list(s.shard_offsets), list(s.shard_sizes), s.placement.rank()) for s in spec.shards]
    placed = [r for _, _, r in shards]
    for i, r in enumerate(placed):
        if not 0 <= r < world:
            return [f"key '{key}.shards[{i}].placement': rank {r} is outside the world of {world} ranks (0..{world - 1})"]
    if placed != ranks:
        return [f"key '{key}.ranks': {ranks} differ from the shards' placements {placed}"]
    if st == _TW and len(shards) != 1:
        return [f"key '{key}.shards': a table_wise table is one shard, got {len(shards)}"]
    if shape is None:  # no shape recorded (saved without a model): check the shards against their own extent
        shape = (max(o[0] + s[0] for o, s, _ in shards), max(o[1] + s[1] for o, s, _ in shards))
    return _tiling_problems(shards, st, shape, key)


def _tiling_problems(shards: list[tuple[list[int], list[int], int]], st: str, shape: tuple[int, int], key: str) -> list[str]:
    rows, cols = shape
    axis = 0 if st in _ROWS else 1 if st in _COLS else None
    for i, (off, size, _) in enumerate(shards):
        where = f"key '{key}.shards[{i}]'"
        if off[0] + size[0] > rows or off[1] + size[1] > cols:
            return [f"{where}: offsets {off} + sizes {size} run past the table's [{rows}, {cols}] (rows, dim)"]
        if st == _TW and (off != [0, 0] or size != [rows, cols]):
            return [f"{where}: a table_wise shard is the whole table [{rows}, {cols}] (rows, dim), got offsets {off}, sizes {size}"]
        if axis is not None:
            other, full = 1 - axis, (rows, cols)[1 - axis]
            if off[other] != 0 or size[other] != full:
                what = "all rows" if other == 0 else "the full dim"
                return [f"{where}: a {st} shard splits dim {axis} only and spans {what} ({full}), got offsets {off}, sizes {size}"]
    if axis is not None:  # 1-D: sorted intervals along the split axis must be contiguous from 0 to the end
        extent, name = (rows, "rows") if axis == 0 else (cols, "columns")
        pos = 0
        for i in sorted(range(len(shards)), key=lambda j: (shards[j][0][axis], shards[j][1][axis])):
            start, length = shards[i][0][axis], shards[i][1][axis]
            if start > pos:
                return [f"key '{key}.shards': {name} {pos}..{start - 1} of {extent} are in no shard"]
            if start < pos:
                return [f"key '{key}.shards[{i}]': {name} {start}..{min(pos, start + length) - 1} are also in another shard"]
            pos = start + length
        if pos != extent:
            return [f"key '{key}.shards': shards cover {name} 0..{pos - 1} of {extent}; {name} {pos}..{extent - 1} are in no shard"]
        return []
    area = sum(s[0] * s[1] for _, s, _ in shards)  # grid shards: in bounds, pairwise disjoint, summing to the table
    for i in range(len(shards)):
        for j in range(i):
            (oi, si, _), (oj, sj, _) = shards[i], shards[j]
            if all(max(oi[d], oj[d]) < min(oi[d] + si[d], oj[d] + sj[d]) for d in (0, 1)):
                return [f"key '{key}.shards[{i}]': overlaps shards[{j}]"]
    if area != rows * cols:
        return [f"key '{key}.shards': shards cover {area} of the table's {rows * cols} weights ([{rows}, {cols}])"]
    return []


def plan_problems(plan: ShardingPlan, header: dict[str, Any], source: str, world_size: int | None = None) -> list[str]:
    """Every problem of ``plan`` (as read with its file header), one line each naming ``source``
    and the key. ``world_size``: the job's, if it differs from the plan's own."""
    world = world_size or header["world_size"]
    device = header.get("compute_device", "cuda")
    tables = header.get("tables") or {}
    problems: list[str] = []
    seen: dict[str, str] = {}
    for path, mplan in plan.plan.items():
        for name, ps in mplan.items():
            key = f"modules.{path}.{name}"
            if name in seen:
                problems.append(f"key '{key}': table also planned in module '{seen[name]}'")
                continue
            seen[name] = path
            if tables and name not in tables:
                problems.append(f"key '{key}': table '{name}' is not in the plan's 'tables'")
                continue
            t = tables.get(name)
            shape = (t["num_embeddings"], t["embedding_dim"]) if t else None
            problems += _param_problems(ps, key, shape, world, device)
    missing = sorted(set(tables) - set(seen))
    if missing:
        problems.append(
            f"key 'modules': no placement for tables {missing[:3]}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    return [f"{source}: {p}" for p in problems]


def validate_plan(plan: ShardingPlan, header: dict[str, Any], source: str, world_size: int | None = None) -> None:
    """Raises ``PlanFileError`` with the first problem (one line), if any."""
    problems = plan_problems(plan, header, source, world_size)
    if problems:
        raise PlanFileError(problems[0])
