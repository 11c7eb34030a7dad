"""sharding/plan/file_format.py: a ShardingPlan to a plain dict and back with every field, the
version rules (version-1 defaults, version-2 strictness) and the exact one-line error per key."""

from __future__ import annotations

import json
import re

import pytest
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import (
    CacheParams,
    CacheStatistics,
    EmbeddingModuleShardingPlan,
    KeyValueParams,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.types import DataType

from sharding.plan import file_format
from sharding.plan.errors import PlanFileError


def _exactly(line: str) -> str:
    """A ``match=`` pattern for the whole message and nothing else."""
    return f"^{re.escape(line)}$"


TABLES = {
    "a": {"num_embeddings": 100, "embedding_dim": 8, "data_type": "FP16", "optimizer_state": None},
    "b": {
        "num_embeddings": 60,
        "embedding_dim": 4,
        "data_type": "FP32",
        "optimizer_state": {"kind": "adam", "bytes_per_weight": 8, "bytes_per_row": 0},
    },
}


def _every_field_plan() -> ShardingPlan:
    """Two tables on two CUDA ranks with every ParameterSharding field set to a non-default value."""
    a = ParameterSharding(
        sharding_type="table_wise",
        compute_kernel="fused_uvm_caching",
        ranks=[1],
        sharding_spec=EnumerableShardingSpec([ShardMetadata(shard_offsets=[0, 0], shard_sizes=[100, 8], placement="rank:1/cuda:1")]),
        cache_params=CacheParams(
            algorithm=CacheAlgorithm.LFU, load_factor=0.25, reserved_memory=1.5, precision=DataType.FP16, prefetch_pipeline=True
        ),
        enforce_hbm=True,
        stochastic_rounding=False,
        bounds_check_mode=BoundsCheckMode.WARNING,
        output_dtype=DataType.FP16,
    )
    b = ParameterSharding(
        sharding_type="row_wise",
        compute_kernel="key_value",
        ranks=[0, 1],
        sharding_spec=EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[40, 4], placement="rank:0/cuda:0"),
                ShardMetadata(shard_offsets=[40, 0], shard_sizes=[20, 4], placement="rank:1/cuda:1"),
            ]
        ),
        key_value_params=KeyValueParams(ssd_storage_directory="/ssd/kv"),
    )
    mplan = EmbeddingModuleShardingPlan()
    mplan["a"], mplan["b"] = a, b
    return ShardingPlan({"model.sparse.ebc": mplan})


def _dict_plan(**changes) -> dict:
    """A minimal, valid version-2 file dict: one table-wise table on rank 0 of a 2-rank CPU plan."""
    d = {
        "format": "recsys-sharding-plan",
        "version": 2,
        "world_size": 2,
        "compute_device": "cpu",
        "tables": {"t": {"num_embeddings": 10, "embedding_dim": 4, "data_type": "FP32", "optimizer_state": None}},
        "modules": {
            "m": {
                "type": "EmbeddingModuleShardingPlan",
                "params": {
                    "t": {
                        "sharding_type": "table_wise",
                        "compute_kernel": "fused",
                        "ranks": [0],
                        "shards": [{"offsets": [0, 0], "sizes": [10, 4], "placement": "rank:0/cpu"}],
                    }
                },
            }
        },
        "meta": {},
    }
    d.update(changes)
    return d


def _param(d: dict) -> dict:
    return d["modules"]["m"]["params"]["t"]


def test_every_field_survives_dict_and_json_round_trip():
    plan = _every_field_plan()
    d = file_format.plan_to_dict(plan, 2, "cuda", TABLES, {"by": "test"})
    back, header = file_format.plan_from_dict(json.loads(json.dumps(d)), "p.json")
    assert list(back.plan) == ["model.sparse.ebc"] and list(back.plan["model.sparse.ebc"]) == ["a", "b"]
    for name in ("a", "b"):
        assert back.plan["model.sparse.ebc"][name] == plan.plan["model.sparse.ebc"][name]  # dataclass equality, field by field
    assert header == {"version": 2, "world_size": 2, "compute_device": "cuda", "tables": TABLES, "meta": {"by": "test"}}


def test_the_stored_dict_is_plain_json_with_enums_by_name():
    d = file_format.plan_to_dict(_every_field_plan(), 2, "cuda", TABLES)
    assert (d["format"], d["version"], d["world_size"], d["compute_device"], d["meta"]) == ("recsys-sharding-plan", 2, 2, "cuda", {})
    a = d["modules"]["model.sparse.ebc"]["params"]["a"]
    assert a["shards"] == [{"offsets": [0, 0], "sizes": [100, 8], "placement": "rank:1/cuda:1"}]
    assert a["cache_params"] == {
        "algorithm": {"enum": "CacheAlgorithm", "name": "LFU"},
        "load_factor": 0.25,
        "reserved_memory": 1.5,
        "precision": {"enum": "DataType", "name": "FP16"},
        "prefetch_pipeline": True,
        "stats": None,
        "multipass_prefetch_config": None,
    }
    assert a["output_dtype"] == {"enum": "DataType", "name": "FP16"} and a["enforce_hbm"] is True and a["stochastic_rounding"] is False
    # FBGEMM's BoundsCheckMode is an IntEnum: by name like every enum, not as the bare int 1
    assert a["bounds_check_mode"] == {"enum": "BoundsCheckMode", "name": "WARNING"}
    b = d["modules"]["model.sparse.ebc"]["params"]["b"]
    assert b["key_value_params"]["ssd_storage_directory"] == "/ssd/kv" and b["cache_params"] is None
    assert [s["offsets"] for s in b["shards"]] == [[0, 0], [40, 0]]


def test_measured_cache_statistics_are_stored_as_null():
    """CacheParams.stats is planning input, not placement: the file keeps null."""

    class Stats(CacheStatistics):
        @property
        def expected_lookups(self) -> float:
            return 1.0

        def expected_miss_rate(self, clf: float) -> float:
            return 0.5

        @property
        def cacheability(self) -> float:
            return 0.1

    plan = _every_field_plan()
    plan.plan["model.sparse.ebc"]["a"].cache_params.stats = Stats()
    d = file_format.plan_to_dict(plan, 2, "cuda", TABLES)
    assert d["modules"]["model.sparse.ebc"]["params"]["a"]["cache_params"]["stats"] is None


def test_a_value_json_cannot_hold_is_refused_with_its_key():
    plan = _every_field_plan()
    plan.plan["model.sparse.ebc"]["a"].cache_params.reserved_memory = {1, 2}
    with pytest.raises(
        PlanFileError, match=_exactly("modules.model.sparse.ebc.a.cache_params.reserved_memory: cannot store a set in a plan file")
    ):
        file_format.plan_to_dict(plan, 2, "cuda", TABLES)


def test_a_module_plan_of_another_kind_is_refused():
    plan = ShardingPlan({"m": {"t": None}})
    with pytest.raises(PlanFileError, match=r"^module 'm': dict is not supported$"):
        file_format.plan_to_dict(plan, 1, "cpu", {})


def test_version_1_tables_get_the_defaults_and_may_carry_extra_keys():
    d = _dict_plan(version=1, tables={"t": {"num_embeddings": 10, "embedding_dim": 4, "note": "old tool"}})
    _, header = file_format.plan_from_dict(d, "v1.json")
    assert header["version"] == 1
    assert header["tables"] == {"t": {"num_embeddings": 10, "embedding_dim": 4, "data_type": "FP32", "optimizer_state": None}}


def test_a_bounds_check_mode_stored_as_an_int_still_reads():
    """A version 2 file may hold FBGEMM's int value (1: WARNING) instead of the name."""
    d = file_format.plan_to_dict(_every_field_plan(), 2, "cuda", TABLES)
    d["modules"]["model.sparse.ebc"]["params"]["a"]["bounds_check_mode"] = 1
    back, _ = file_format.plan_from_dict(d, "p.json")
    assert back.plan["model.sparse.ebc"]["a"].bounds_check_mode == BoundsCheckMode.WARNING


def test_missing_optional_keys_read_as_none():
    plan, header = file_format.plan_from_dict(_dict_plan())
    ps = plan.plan["m"]["t"]
    assert (ps.cache_params, ps.enforce_hbm, ps.bounds_check_mode, ps.output_dtype, ps.key_value_params) == (None,) * 5
    assert [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in ps.sharding_spec.shards] == [([0, 0], [10, 4], "rank:0/cpu")]
    assert header["meta"] == {}


def _without(key: str) -> dict:
    d = _dict_plan()
    del d[key]
    return d


@pytest.mark.parametrize(
    "d, line",
    [
        (_dict_plan(version=3), "p.json: key 'version': unsupported plan format version 3 (this tool reads 1, 2)"),
        (_without("version"), "p.json: key 'version': unsupported plan format version None (this tool reads 1, 2)"),
        (_dict_plan(format="other"), "p.json: not a sharding plan file (key 'format' is not 'recsys-sharding-plan')"),
        ([1, 2], "p.json: not a sharding plan file (key 'format' is not 'recsys-sharding-plan')"),
        (_without("world_size"), "p.json: key 'world_size': expected int, got None"),
        (_without("compute_device"), "p.json: key 'compute_device': expected str, got None"),
        (_without("tables"), "p.json: key 'tables': expected dict, got None"),
        (_without("modules"), "p.json: key 'modules': expected dict, got None"),
        (_dict_plan(world_size=0), "p.json: key 'world_size': expected a positive integer, got 0"),
        (
            _dict_plan(modules={"m": {"type": "Other", "params": {}}}),
            "p.json: key 'modules.m': expected an EmbeddingModuleShardingPlan object",
        ),
    ],
)
def test_header_errors_are_one_exact_line(d, line):
    with pytest.raises(PlanFileError, match=_exactly(line)):
        file_format.plan_from_dict(d, "p.json")


@pytest.mark.parametrize(
    "table, line",
    [
        ({"embedding_dim": 4}, "p.json: key 'tables.t.num_embeddings': expected a positive integer, got None"),
        ({"num_embeddings": 10, "embedding_dim": True}, "p.json: key 'tables.t.embedding_dim': expected a positive integer, got True"),
        ({"num_embeddings": 10, "embedding_dim": 4, "colour": 1}, "p.json: key 'tables.t.colour': unknown key"),
        ("ten rows", "p.json: key 'tables.t': expected an object, got 'ten rows'"),
        (
            {"num_embeddings": 10, "embedding_dim": 4, "optimizer_state": {"kind": "adam", "bytes_per_weight": -8, "bytes_per_row": 0}},
            "p.json: key 'tables.t.optimizer_state': expected {kind, bytes_per_weight, bytes_per_row}, "
            "got {'kind': 'adam', 'bytes_per_weight': -8, 'bytes_per_row': 0}",
        ),
    ],
)
def test_table_errors_name_the_key(table, line):
    with pytest.raises(PlanFileError, match=_exactly(line)):
        file_format.plan_from_dict(_dict_plan(tables={"t": table}), "p.json")


def test_an_unknown_data_type_lists_the_known_ones():
    """The list is torchrec's DataType values (it grows with torchrec): the common ones are named."""
    with pytest.raises(PlanFileError, match=r"^p\.json: key 'tables\.t\.data_type': unknown data type 'FP12' \(one of ") as e:
        file_format.plan_from_dict(_dict_plan(tables={"t": {"num_embeddings": 10, "embedding_dim": 4, "data_type": "FP12"}}), "p.json")
    head, _, known = str(e.value).partition(" (one of ")
    assert head == "p.json: key 'tables.t.data_type': unknown data type 'FP12'"
    assert known.endswith(")") and {"FP32", "FP16", "BF16", "INT8", "INT4"} <= set(known[:-1].split(", "))


@pytest.mark.parametrize(
    "change, line",
    [
        ({"colour": "red"}, "p.json: modules.m.t: unknown key 'colour'"),
        ({"compute_kernel": 3}, "p.json: modules.m.t.compute_kernel: expected a string, got 3"),
        ({"ranks": [0, -1]}, "p.json: modules.m.t.ranks: expected a list of ranks, got [0, -1]"),
        ({"shards": "all"}, "p.json: modules.m.t.shards: expected a list of shards, got 'all'"),
        ({"shards": []}, "p.json: modules.m.t.shards: empty (a sharded table has at least one shard; null if unsharded)"),
        (
            {"shards": [{"offsets": [0], "sizes": [10, 4], "placement": "rank:0/cpu"}]},
            "p.json: modules.m.t.shards[0].offsets: expected [rows, columns] of non-negative integers, got [0]",
        ),
        (
            {
                "shards": [
                    {"offsets": [0, 0], "sizes": [6, 4], "placement": "rank:0/cpu"},
                    {"offsets": [5, 0], "sizes": [5, 4], "placement": "rank:1/cpu"},
                ]
            },
            "p.json: modules.m.t.shards[1]: overlaps shards[0] (offsets [5, 0] and [0, 0], sizes [5, 4] and [6, 4])",
        ),
        ({"bounds_check_mode": {"enum": "Colour", "name": "RED"}}, "p.json: modules.m.t.bounds_check_mode: unknown enum type 'Colour'"),
        (
            {"output_dtype": {"enum": "DataType", "name": "FP12"}},
            "p.json: modules.m.t.output_dtype: 'FP12' is not a DataType",
        ),
        ({"cache_params": {"load_factor": 0.2, "size": 3}}, "p.json: modules.m.t.cache_params: unknown key 'size'"),
        ({"key_value_params": [1]}, "p.json: modules.m.t.key_value_params: expected an object, got [1]"),
    ],
)
def test_parameter_errors_name_the_key(change, line):
    d = _dict_plan()
    _param(d).update(change)
    with pytest.raises(PlanFileError, match=_exactly(line)):
        file_format.plan_from_dict(d, "p.json")


def test_a_data_parallel_table_has_no_shards():
    d = _dict_plan()
    _param(d).update(sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1], shards=None)
    plan, _ = file_format.plan_from_dict(d)
    assert plan.plan["m"]["t"].sharding_spec is None and plan.plan["m"]["t"].ranks == [0, 1]
    assert file_format.plan_to_dict(plan, 2, "cpu", {})["modules"]["m"]["params"]["t"]["shards"] is None
