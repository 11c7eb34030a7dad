"""Plan files: versioned JSON that round-trips losslessly to and from torchrec's `ShardingPlan`.

torchrec plans pickle, and `ShardingPlan._serialize()` is private and one-way; a plan that a
person can read, diff, check into a repo and hand to a training job needs a stable text
format. Layout (version 1):

    {"format": "recsys-sharding-plan", "version": 1,
     "world_size": 2, "compute_device": "cpu",
     "tables": {"t_C1": {"num_embeddings": 1446, "embedding_dim": 16}, ...},   # what it was made for
     "modules": {"model.embeddings": {"type": "EmbeddingModuleShardingPlan", "params": {
         "t_C1": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [0],
                  "shards": [{"offsets": [0, 0], "sizes": [1446, 16], "placement": "rank:0/cpu"}],
                  "cache_params": null, "enforce_hbm": null, "stochastic_rounding": null,
                  "bounds_check_mode": null, "output_dtype": null, "key_value_params": null}}}},
     "meta": {...free-form: who made it, planner, topology...}}

Every problem with a file is a `PlanFileError` with one line naming the file and the key.
Files are written atomically (temp file + rename): a crash never leaves half a plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import (
    CacheParams,
    EmbeddingModuleShardingPlan,
    KeyValueParams,
    ParameterSharding,
    ShardingPlan,
)

FORMAT = "recsys-sharding-plan"
VERSION = 1


class PlanFileError(ValueError):
    """A plan file that cannot be used; the message is one line naming the file and key."""


# -- enums that appear in ParameterSharding / CacheParams ---------------------------------------


def _enum_types() -> dict[str, type]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
    from torchrec.types import DataType

    return {"BoundsCheckMode": BoundsCheckMode, "CacheAlgorithm": CacheAlgorithm, "DataType": DataType}


def _enc(value: Any, where: str) -> Any:
    """Plain JSON for the values a ParameterSharding holds; enums as {"enum": T, "name": N}."""
    import enum

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__name__, "name": value.name}
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

    # CacheParams.stats (measured cache statistics, sharding/cache_sizing.py) are planning input,
    # not part of the placement: stored as null (the plan's meta keeps a summary)
    return {f.name: None if isinstance(getattr(obj, f.name), CacheStatistics) else _enc(getattr(obj, f.name), f"{where}.{f.name}")
            for f in dataclasses.fields(obj)}


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
    "sharding_type", "compute_kernel", "ranks", "shards", "cache_params", "enforce_hbm",
    "stochastic_rounding", "bounds_check_mode", "output_dtype", "key_value_params",
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
        "shards": None if spec is None else [
            {"offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes), "placement": str(s.placement)}
            for s in spec.shards
        ],
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
        shards = []
        for i, s in enumerate(d["shards"]):
            w = f"{where}.shards[{i}]"
            try:
                shards.append(ShardMetadata(shard_offsets=list(s["offsets"]), shard_sizes=list(s["sizes"]), placement=s["placement"]))
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise PlanFileError(f"{w}: bad shard ({e})") from None
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


def model_tables(model: nn.Module) -> dict[str, dict[str, int]]:
    """Table name -> shape, for every embedding collection in the model (what a plan is for)."""
    from sharding.tables import table_configs

    return {t.name: {"num_embeddings": t.num_embeddings, "embedding_dim": t.embedding_dim} for t in table_configs(model)}


def plan_to_dict(
    plan: ShardingPlan, world_size: int, compute_device: str, tables: dict[str, dict[str, int]], meta: dict | None = None
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


def plan_from_dict(d: Any, source: str = "plan") -> tuple[ShardingPlan, dict[str, Any]]:
    """Returns the ShardingPlan and the file's header (world_size, compute_device, tables, meta)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise PlanFileError(f"{source}: not a sharding plan file (key 'format' is not '{FORMAT}')")
    if d.get("version") != VERSION:
        raise PlanFileError(f"{source}: key 'version': unsupported plan format version {d.get('version')!r} (this tool reads {VERSION})")
    for key, tp in (("world_size", int), ("compute_device", str), ("tables", dict), ("modules", dict)):
        if not isinstance(d.get(key), tp):
            raise PlanFileError(f"{source}: key '{key}': expected {tp.__name__}, got {d.get(key)!r}")
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
    header = {k: d[k] for k in ("world_size", "compute_device", "tables")}
    header["meta"] = d.get("meta", {})
    return plan, header


def save_plan(path: str | os.PathLike, plan_dict: dict[str, Any]) -> Path:
    """Atomic write: a temp file in the same directory, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(plan_dict, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_plan(path: str | os.PathLike) -> tuple[ShardingPlan, dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise PlanFileError(f"{path}: no such plan file")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return plan_from_dict(d, str(path))


def check_plan_fits(header: dict[str, Any], plan: ShardingPlan, tables: dict[str, dict[str, int]], world_size: int, source: str) -> None:
    """A saved plan must be for this model and this world size, and cover every table once."""
    if header["world_size"] != world_size:
        raise PlanFileError(f"{source}: key 'world_size': plan is for {header['world_size']} ranks, this job has {world_size}")
    if header["tables"] != tables:
        missing = sorted(set(tables) - set(header["tables"]))
        extra = sorted(set(header["tables"]) - set(tables))
        changed = sorted(t for t in set(tables) & set(header["tables"]) if tables[t] != header["tables"][t])
        what = (f"missing tables {missing[:3]}" if missing else f"unknown tables {extra[:3]}" if extra
                else f"table {changed[0]} is {header['tables'][changed[0]]} in the plan, {tables[changed[0]]} in the model")
        raise PlanFileError(f"{source}: key 'tables': plan is for another model ({what})")
    seen: dict[str, str] = {}
    for path, mplan in plan.plan.items():
        for name, ps in mplan.items():
            if name in seen:
                raise PlanFileError(f"{source}: key 'modules.{path}.{name}': table also planned in '{seen[name]}'")
            seen[name] = path
            bad = [r for r in (ps.ranks or []) if r >= world_size]
            if bad:
                raise PlanFileError(f"{source}: key 'modules.{path}.{name}.ranks': rank {bad[0]} >= world size {world_size}")
    missing = sorted(set(tables) - set(seen))
    if missing:
        raise PlanFileError(f"{source}: key 'modules': no placement for tables {missing[:3]}")
