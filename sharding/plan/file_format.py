"""The plan file's JSON layout: a torchrec `ShardingPlan` to and from a plain dict, version by version.

torchrec plans pickle, and `ShardingPlan._serialize()` is private and one-way; a plan that a
person can read, diff, check into a repo and hand to a training job needs a stable text
format. Layout (version 2):

    {"format": "recsys-sharding-plan", "version": 2,
     "world_size": 2, "compute_device": "cpu",
     "tables": {"t_C1": {"num_embeddings": 1446, "embedding_dim": 16, "data_type": "FP32",   # what it was made for
                         "optimizer_state": {"kind": "cowclip_adam", "bytes_per_weight": 8, "bytes_per_row": 8}}, ...},
     "modules": {"model.embeddings": {"type": "EmbeddingModuleShardingPlan", "params": {
         "t_C1": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [0],
                  "shards": [{"offsets": [0, 0], "sizes": [1446, 16], "placement": "rank:0/cpu"}],
                  "cache_params": null, "enforce_hbm": null, "stochastic_rounding": null,
                  "bounds_check_mode": null, "output_dtype": null, "key_value_params": null}}}},
     "meta": {...free-form: who made it, planner, topology...}}

Version 2 added each table's ``data_type`` and ``optimizer_state`` (sharding/optimizer_state.py),
so a plan can be validated and its memory counted with no model at hand. Version 1 files (tables
with shapes only) still load: their tables get ``data_type`` FP32 and ``optimizer_state`` null.

Kept apart from the file handling of sharding/plan/io.py (paths, atomic writes, models): this is
the format alone, dict in and dict out, so the layout and its version rules can be read, tested
and changed in one place. Only syntax is checked here (sharding/plan/validation.py checks what a
plan means); every problem is a `PlanFileError` with one line naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import (
    CacheParams,
    EmbeddingModuleShardingPlan,
    KeyValueParams,
    ParameterSharding,
    ShardingPlan,
)

from sharding.plan.errors import PlanFileError

FORMAT = "recsys-sharding-plan"
VERSION = 2
READS = (1, 2)  # versions this module reads; version 1 files lack data types and optimizer state


# -- enums that appear in ParameterSharding / CacheParams ---------------------------------------


def _enum_types() -> dict[str, type]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
    from torchrec.types import DataType

    return {"BoundsCheckMode": BoundsCheckMode, "CacheAlgorithm": CacheAlgorithm, "DataType": DataType}


def _enc(value: Any, where: str) -> Any:
    """Plain JSON for the values a ParameterSharding holds; enums as {"enum": T, "name": N}."""
    import enum

    if isinstance(value, enum.Enum):  # first: FBGEMM's BoundsCheckMode is an IntEnum, so an int too
        return {"enum": type(value).__name__, "name": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_enc(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _enc(v, f"{where}.{k}") for k, v in value.items()}
    raise PlanFileError(f"{where}: cannot store a {type(value).__name__} in a plan file")


def _dec(value: Any, where: str) -> Any:
    if isinstance(value, dict) and set(value) == {"enum", "name"}:
        types = _enum_types()
        if value["enum"] not in types:
            raise PlanFileError(f"{where}: unknown enum type '{value['enum']}'")
        try:
            return types[value["enum"]][value["name"]]
        except KeyError:
            raise PlanFileError(f"{where}: '{value['name']}' is not a {value['enum']}") from None
    if isinstance(value, list):
        return [_dec(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _dec(v, f"{where}.{k}") for k, v in value.items()}
    return value


def _dataclass_to_dict(obj: Any, where: str) -> dict[str, Any] | None:
    if obj is None:
        return None
    from torchrec.distributed.types import CacheStatistics

    # CacheParams.stats (measured cache statistics, sharding/planner/cache_sizing.py) are planning input,
    # not part of the placement: stored as null (the plan's meta keeps a summary)
    return {
        f.name: None if isinstance(getattr(obj, f.name), CacheStatistics) else _enc(getattr(obj, f.name), f"{where}.{f.name}")
        for f in dataclasses.fields(obj)
    }


def _dataclass_from_dict(cls: type, d: dict[str, Any] | None, where: str) -> Any:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise PlanFileError(f"{where}: expected an object, got {d!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise PlanFileError(f"{where}: unknown key '{sorted(unknown)[0]}'")
    return cls(**{k: _dec(v, f"{where}.{k}") for k, v in d.items()})


# -- ParameterSharding <-> dict -----------------------------------------------------------------

_PARAM_KEYS = {
    "sharding_type",
    "compute_kernel",
    "ranks",
    "shards",
    "cache_params",
    "enforce_hbm",
    "stochastic_rounding",
    "bounds_check_mode",
    "output_dtype",
    "key_value_params",
}


def param_to_dict(ps: ParameterSharding, where: str) -> dict[str, Any]:
    spec = ps.sharding_spec
    if spec is not None and not isinstance(spec, EnumerableShardingSpec):
        raise PlanFileError(f"{where}.sharding_spec: {type(spec).__name__} is not supported (EnumerableShardingSpec only)")
    extra = {f.name for f in dataclasses.fields(ps)} - (_PARAM_KEYS - {"shards"}) - {"sharding_spec"}
    for name in extra:  # a newer torchrec field we do not know: refuse rather than drop it
        if getattr(ps, name) is not None:
            raise PlanFileError(f"{where}.{name}: field not supported by plan format version {VERSION}")
    return {
        "sharding_type": ps.sharding_type,
        "compute_kernel": ps.compute_kernel,
        "ranks": list(ps.ranks) if ps.ranks is not None else None,
        "shards": None
        if spec is None
        else [{"offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes), "placement": str(s.placement)} for s in spec.shards],
        "cache_params": _dataclass_to_dict(ps.cache_params, f"{where}.cache_params"),
        "enforce_hbm": ps.enforce_hbm,
        "stochastic_rounding": ps.stochastic_rounding,
        "bounds_check_mode": _enc(ps.bounds_check_mode, f"{where}.bounds_check_mode"),
        "output_dtype": _enc(ps.output_dtype, f"{where}.output_dtype"),
        "key_value_params": _dataclass_to_dict(ps.key_value_params, f"{where}.key_value_params"),
    }


def param_from_dict(d: Any, where: str) -> ParameterSharding:
    if not isinstance(d, dict):
        raise PlanFileError(f"{where}: expected an object, got {d!r}")
    unknown = set(d) - _PARAM_KEYS
    if unknown:
        raise PlanFileError(f"{where}: unknown key '{sorted(unknown)[0]}'")
    for key in ("sharding_type", "compute_kernel"):
        if not isinstance(d.get(key), str):
            raise PlanFileError(f"{where}.{key}: expected a string, got {d.get(key)!r}")
    ranks = d.get("ranks")
    if ranks is not None and not (isinstance(ranks, list) and all(isinstance(r, int) and r >= 0 for r in ranks)):
        raise PlanFileError(f"{where}.ranks: expected a list of ranks, got {ranks!r}")
    spec = None
    if d.get("shards") is not None:
        if not isinstance(d["shards"], list):
            raise PlanFileError(f"{where}.shards: expected a list of shards, got {d['shards']!r}")
        if not d["shards"]:  # torch's EnumerableShardingSpec would fail on an empty list with an IndexError
            raise PlanFileError(f"{where}.shards: empty (a sharded table has at least one shard; null if unsharded)")
        shards = []
        for i, s in enumerate(d["shards"]):
            w = f"{where}.shards[{i}]"
            for key in ("offsets", "sizes"):
                v = s.get(key) if isinstance(s, dict) else None
                if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
                    raise PlanFileError(f"{w}.{key}: expected [rows, columns] of non-negative integers, got {v!r}")
            try:
                shards.append(ShardMetadata(shard_offsets=list(s["offsets"]), shard_sizes=list(s["sizes"]), placement=s["placement"]))
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise PlanFileError(f"{w}: bad shard ({e})") from None
        for i, a in enumerate(shards):  # torch refuses to build a spec with overlapping shards: name them
            for j in range(i):
                b = shards[j]
                if all(
                    max(a.shard_offsets[k], b.shard_offsets[k])
                    < min(a.shard_offsets[k] + a.shard_sizes[k], b.shard_offsets[k] + b.shard_sizes[k])
                    for k in (0, 1)
                ):
                    raise PlanFileError(
                        f"{where}.shards[{i}]: overlaps shards[{j}] (offsets {a.shard_offsets} and "
                        f"{b.shard_offsets}, sizes {a.shard_sizes} and {b.shard_sizes})"
                    )
        spec = EnumerableShardingSpec(shards)
    return ParameterSharding(
        sharding_type=d["sharding_type"],
        compute_kernel=d["compute_kernel"],
        ranks=ranks,
        sharding_spec=spec,
        cache_params=_dataclass_from_dict(CacheParams, d.get("cache_params"), f"{where}.cache_params"),
        enforce_hbm=d.get("enforce_hbm"),
        stochastic_rounding=d.get("stochastic_rounding"),
        bounds_check_mode=_dec(d.get("bounds_check_mode"), f"{where}.bounds_check_mode"),
        output_dtype=_dec(d.get("output_dtype"), f"{where}.output_dtype"),
        key_value_params=_dataclass_from_dict(KeyValueParams, d.get("key_value_params"), f"{where}.key_value_params"),
    )


# -- whole plans ----------------------------------------------------------------------------------

_TABLE_KEYS = {"num_embeddings", "embedding_dim", "data_type", "optimizer_state"}


def plan_to_dict(
    plan: ShardingPlan, world_size: int, compute_device: str, tables: dict[str, dict[str, Any]], meta: dict | None = None
) -> dict[str, Any]:
    modules = {}
    for path, mplan in plan.plan.items():
        if not isinstance(mplan, EmbeddingModuleShardingPlan):
            raise PlanFileError(f"module '{path}': {type(mplan).__name__} is not supported")
        modules[path] = {
            "type": "EmbeddingModuleShardingPlan",
            "params": {name: param_to_dict(ps, f"modules.{path}.{name}") for name, ps in mplan.items()},
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world_size,
        "compute_device": compute_device,
        "tables": tables,
        "modules": modules,
        "meta": meta or {},
    }


def _is_count(v: Any, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _read_tables(tables: dict[str, Any], version: int, source: str) -> dict[str, dict[str, Any]]:
    """The header's tables, checked. ``data_type`` defaults to FP32 and ``optimizer_state`` to
    null (not recorded: version-1 files, or an optimizer without a known state layout); reports
    then assume row-wise Adagrad, as version-1 tools did."""
    out = {}
    for name, t in tables.items():
        where = f"{source}: key 'tables.{name}"
        if not isinstance(t, dict):
            raise PlanFileError(f"{where}': expected an object, got {t!r}")
        if version >= 2:
            unknown = set(t) - _TABLE_KEYS
            if unknown:
                raise PlanFileError(f"{where}.{sorted(unknown)[0]}': unknown key")
        for key in ("num_embeddings", "embedding_dim"):
            if not _is_count(t.get(key), 1):
                raise PlanFileError(f"{where}.{key}': expected a positive integer, got {t.get(key)!r}")
        entry = {
            "num_embeddings": t["num_embeddings"],
            "embedding_dim": t["embedding_dim"],
            "data_type": t.get("data_type", "FP32"),
            "optimizer_state": t.get("optimizer_state"),
        }
        if version >= 2:
            from sharding.optimizer_state import DATA_TYPE_BITS

            if entry["data_type"] not in DATA_TYPE_BITS:
                raise PlanFileError(f"{where}.data_type': unknown data type {entry['data_type']!r} (one of {', '.join(DATA_TYPE_BITS)})")
            st = entry["optimizer_state"]
            if st is not None and not (
                isinstance(st, dict)
                and set(st) == {"kind", "bytes_per_weight", "bytes_per_row"}
                and isinstance(st["kind"], str)
                and _is_count(st["bytes_per_weight"])
                and _is_count(st["bytes_per_row"])
            ):
                raise PlanFileError(f"{where}.optimizer_state': expected {{kind, bytes_per_weight, bytes_per_row}}, got {st!r}")
        out[name] = entry
    return out


def plan_from_dict(d: Any, source: str = "plan") -> tuple[ShardingPlan, dict[str, Any]]:
    """Returns the ShardingPlan and the file's header (version, world_size, compute_device, tables,
    meta). Only the file's syntax is checked here; sharding/plan/validation.py checks the plan."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise PlanFileError(f"{source}: not a sharding plan file (key 'format' is not '{FORMAT}')")
    if d.get("version") not in READS:
        raise PlanFileError(
            f"{source}: key 'version': unsupported plan format version {d.get('version')!r} (this tool reads {', '.join(map(str, READS))})"
        )
    for key, tp in (("world_size", int), ("compute_device", str), ("tables", dict), ("modules", dict)):
        if not isinstance(d.get(key), tp):
            raise PlanFileError(f"{source}: key '{key}': expected {tp.__name__}, got {d.get(key)!r}")
    if d["world_size"] < 1:
        raise PlanFileError(f"{source}: key 'world_size': expected a positive integer, got {d['world_size']!r}")
    plan = ShardingPlan({})
    for path, m in d["modules"].items():
        if not isinstance(m, dict) or m.get("type") != "EmbeddingModuleShardingPlan" or not isinstance(m.get("params"), dict):
            raise PlanFileError(f"{source}: key 'modules.{path}': expected an EmbeddingModuleShardingPlan object")
        mplan = EmbeddingModuleShardingPlan()
        for name, p in m["params"].items():
            try:
                mplan[name] = param_from_dict(p, f"modules.{path}.{name}")
            except PlanFileError as e:  # e names the key path; add the file
                raise PlanFileError(f"{source}: {e}") from None
        plan.plan[path] = mplan
    header = {
        "version": d["version"],
        "world_size": d["world_size"],
        "compute_device": d["compute_device"],
        "tables": _read_tables(d["tables"], d["version"], source),
        "meta": d.get("meta", {}),
    }
    return plan, header
