"""sharding/plan/validation.py: the exact line for each kind of unusable placement, on small
hand-made plans (the full case list over a real model: tests/integration/sharding/test_plan_validation.py)."""

from __future__ import annotations

import re

import pytest

from sharding.plan.errors import PlanFileError
from sharding.plan.file_format import plan_from_dict
from sharding.plan.validation import plan_problems, validate_plan


def _exactly(line: str) -> str:
    """A ``match=`` pattern for the whole message and nothing else."""
    return f"^{re.escape(line)}$"


def _p(sharding_type: str, shards: list[tuple[int, int, int, int, int]] | None, kernel: str = "fused", ranks=None, device="cpu") -> dict:
    """shards: (rank, row offset, col offset, rows, cols)."""
    return {
        "sharding_type": sharding_type,
        "compute_kernel": kernel,
        "ranks": ranks if ranks is not None else [s[0] for s in shards or []],
        "shards": None
        if shards is None
        else [{"offsets": [r0, c0], "sizes": [n, c], "placement": f"rank:{rank}/{device}"} for rank, r0, c0, n, c in shards],
    }


def _plan(params: dict, tables: dict | None = None, device: str = "cpu", world: int = 2, modules: dict | None = None):
    d = {
        "format": "recsys-sharding-plan",
        "version": 2,
        "world_size": world,
        "compute_device": device,
        "tables": {"t": {"num_embeddings": 100, "embedding_dim": 8}} if tables is None else tables,
        "modules": modules or {"m": {"type": "EmbeddingModuleShardingPlan", "params": params}},
        "meta": {},
    }
    return plan_from_dict(d)


def _problems(*args, **kwargs) -> list[str]:
    plan, header = _plan(*args, **kwargs)
    return plan_problems(plan, header, "p.json")


def test_valid_placements_have_no_problems():
    assert _problems({"t": _p("table_wise", [(1, 0, 0, 100, 8)])}) == []
    assert _problems({"t": _p("row_wise", [(1, 60, 0, 40, 8), (0, 0, 0, 60, 8)])}) == []  # any order
    assert _problems({"t": _p("table_column_wise", [(0, 0, 0, 100, 3), (0, 0, 3, 100, 5)])}) == []
    assert _problems({"t": _p("data_parallel", None, "dense", ranks=[1, 0])}) == []
    assert _problems({"t": _p("grid_shard", [(0, 0, 0, 50, 4), (1, 0, 4, 50, 4), (1, 50, 0, 50, 4), (0, 50, 4, 50, 4)])}) == []


@pytest.mark.parametrize(
    "param, line",
    [
        (
            _p("table_wise", [(0, 0, 0, 100, 8)], "key_value"),
            "p.json: key 'modules.m.t.compute_kernel': 'key_value' keeps the table on SSD with FBGEMM's SSD kernels, which run on "
            "CUDA only; this plan is for cpu (use fused there, or plan for a cuda topology with an SSD tier)",
        ),
        (_p("table_wise", None, ranks=[]), "p.json: key 'modules.m.t.ranks': no ranks"),
        (
            _p("data_parallel", None, "dense", ranks=[0]),
            "p.json: key 'modules.m.t.ranks': a data_parallel table is on every rank (0..1), got [0]",
        ),
        (_p("row_wise", None, ranks=[0, 1]), "p.json: key 'modules.m.t.shards': a row_wise table needs shards"),
        (
            _p("table_wise", [(0, 0, 0, 50, 8), (0, 50, 0, 50, 8)]),
            "p.json: key 'modules.m.t.shards': a table_wise table is one shard, got 2",
        ),
        (
            _p("row_wise", [(0, 0, 0, 60, 8), (3, 60, 0, 40, 8)], ranks=[0, 1]),
            "p.json: key 'modules.m.t.shards[1].placement': rank 3 is outside the world of 2 ranks (0..1)",
        ),
        (
            _p("column_wise", [(0, 0, 0, 100, 4), (1, 0, 4, 100, 2)]),
            "p.json: key 'modules.m.t.shards': shards cover columns 0..5 of 8; columns 6..7 are in no shard",
        ),
        (
            _p("grid_shard", [(0, 0, 0, 50, 8), (1, 50, 0, 50, 4)]),
            "p.json: key 'modules.m.t.shards': shards cover 600 of the table's 800 weights ([100, 8])",
        ),
    ],
)
def test_each_problem_is_one_exact_line(param, line):
    assert _problems({"t": param}) == [line]


@pytest.mark.parametrize(
    "param, moved, line",
    [
        (
            _p("column_wise", [(0, 0, 0, 100, 5), (1, 0, 5, 100, 3)]),
            ([0, 3], [100, 5]),
            "p.json: key 'modules.m.t.shards[1]': columns 3..4 are also in another shard",
        ),
        (
            _p("grid_shard", [(0, 0, 0, 50, 8), (1, 50, 0, 50, 8)]),
            ([40, 0], [50, 8]),
            "p.json: key 'modules.m.t.shards[1]': overlaps shards[0]",
        ),
    ],
)
def test_overlapping_shards_of_a_plan_built_in_code(param, moved, line):
    """A file with overlapping shards is refused when read (sharding/plan/file_format.py); a plan
    built in code can still have them, and validation names them."""
    plan, header = _plan({"t": param})
    shard = plan.plan["m"]["t"].sharding_spec.shards[1]
    shard.shard_offsets, shard.shard_sizes = moved
    assert plan_problems(plan, header, "p.json") == [line]


def test_a_plan_saved_without_tables_is_checked_against_its_shards_extent():
    assert _problems({"t": _p("row_wise", [(0, 0, 0, 60, 8), (1, 60, 0, 40, 8)])}, tables={}) == []
    assert _problems({"t": _p("row_wise", [(0, 0, 0, 60, 8), (1, 70, 0, 30, 8)])}, tables={}) == [
        "p.json: key 'modules.m.t.shards': rows 60..69 of 100 are in no shard"
    ]


def test_a_table_planned_twice_and_tables_left_out():
    tables = {n: {"num_embeddings": 10, "embedding_dim": 2} for n in ("t", "u", "v", "w", "x")}
    tw = {"type": "EmbeddingModuleShardingPlan", "params": {"t": _p("table_wise", [(0, 0, 0, 10, 2)])}}
    assert _problems({}, tables=tables, modules={"a": tw, "b": tw}) == [
        "p.json: key 'modules.b.t': table also planned in module 'a'",
        "p.json: key 'modules': no placement for tables ['u', 'v', 'w'] and 1 more",
    ]


def test_the_jobs_world_size_overrides_the_plans():
    plan, header = _plan({"t": _p("table_wise", [(1, 0, 0, 100, 8)])})
    assert plan_problems(plan, header, "p.json", world_size=1) == [
        "p.json: key 'modules.m.t.ranks': rank 1 is outside the world of 1 ranks (0..0)"
    ]


def test_validate_plan_raises_the_first_problem():
    plan, header = _plan({"t": _p("table_wise", [(0, 0, 0, 100, 8)], "dense"), "u": _p("table_wise", [(0, 0, 0, 1, 1)])})
    with pytest.raises(
        PlanFileError,
        match=_exactly(
            "p.json: key 'modules.m.t.compute_kernel': torchrec does not run a table_wise table with kernel 'dense' on cpu (allowed: fused)"
        ),
    ):
        validate_plan(plan, header, "p.json")
    validate_plan(*_plan({"t": _p("table_wise", [(0, 0, 0, 100, 8)])}), "p.json")  # a usable plan passes
