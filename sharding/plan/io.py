"""Plan files: versioned JSON that round-trips losslessly to and from torchrec's `ShardingPlan`.

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
with shapes only) still load; their memory figures assume row-wise Adagrad.

Public API: ``save_plan(plan, path, model=...)`` and ``load_plan(path) -> ShardingPlan`` (both
validate: sharding/plan/validation.py); ``read_plan_file`` gives the header too.
Every problem with a file is a `PlanFileError` with one line naming the file and the key.
Files are written atomically (temp file + rename): a crash never leaves half a plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
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
VERSION = 2
READS = (1, 2)  # versions this module reads; version 1 files lack data types and optimizer state


from sharding.plan.errors import PlanFileError  # noqa: E402 (defined there, raised and re-exported here)


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


def model_tables(
    model: nn.Module,
    optimizer: str | Mapping[str, str] | None = None,
    fused_params: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Table name -> what a plan file records about it: shape, data type and optimizer state.

    The optimizer kind is read from the model (``sharding.optimizer_state.optimizer_kind``);
    ``optimizer`` (one kind, or table -> kind) overrides it, ``fused_params`` are the sharder's.
    A table whose optimizer has no known state layout records ``optimizer_state: null``. After
    ``DistributedModelParallel`` the tables are read from the sharded modules (`sharded_tables`)."""
    from sharding.optimizer_state import (
        UnknownOptimizerError,
        optimizer_kind,
        sharded_tables,
        state_of,
        table_parameters,
    )

    overrides = optimizer if isinstance(optimizer, Mapping) else {}
    out = {}
    # unsharded modules (before DMP), and sharded ones (after it: their own configs and fused params)
    entries = [(c, lambda p=param: optimizer_kind(p, fused_params)) for c, param in table_parameters(model)]
    entries += [(c, lambda k=kind: k) for c, kind in sharded_tables(model)]
    for c, known_kind in entries:
        kind = optimizer if isinstance(optimizer, str) else overrides.get(c.name)
        try:
            found = kind or known_kind()
            state = state_of(found).to_dict() if found else None  # None: not known on this rank
        except UnknownOptimizerError:
            if kind:  # a kind the caller named must be one we know
                raise
            state = None
        out[c.name] = {
            "num_embeddings": c.num_embeddings,
            "embedding_dim": c.embedding_dim,
            "data_type": getattr(c.data_type, "value", str(c.data_type)),
            "optimizer_state": state,
        }
    return out


def table_shape(entry: Mapping[str, Any]) -> tuple[int, int]:
    return entry["num_embeddings"], entry["embedding_dim"]


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
    meta). Only the file's syntax is checked here; ``sharding.plan_validation`` checks the plan."""
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


def write_plan_file(path: str | os.PathLike, plan_dict: dict[str, Any]) -> Path:
    """Atomic write of a plan dict: a temp file in the same directory, fsync, rename. On any
    failure the previous file (if any) is left as it was and no temp file remains."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(plan_dict, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_plan_file(path: str | os.PathLike) -> tuple[ShardingPlan, dict[str, Any]]:
    """The plan and the file's header, syntax checked (what ``load_plan`` returned before version 2)."""
    path = Path(path)
    if not path.is_file():
        raise PlanFileError(f"{path}: no such plan file")
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PlanFileError(f"{path}: not a text file (byte {e.start} is not UTF-8)") from None
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return plan_from_dict(d, str(path))


def _infer_world_and_device(plan: ShardingPlan) -> tuple[int, str]:
    ranks, devices = [0], set()
    for mplan in plan.plan.values():
        for ps in mplan.values():
            ranks += list(ps.ranks or [])
            for s in ps.sharding_spec.shards if ps.sharding_spec is not None else []:
                ranks.append(s.placement.rank())
                devices.add(s.placement.device().type)
    return max(ranks) + 1, "cuda" if "cuda" in devices else (devices.pop() if len(devices) == 1 else "cpu")


def save_plan(
    plan: ShardingPlan,
    path: str | os.PathLike,
    model: nn.Module | None = None,
    *,
    world_size: int | None = None,
    compute_device: str | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    fused_params: Mapping[str, Any] | None = None,
    meta: dict | None = None,
    planner: Any = None,
    batch_size: int | None = None,
) -> Path:
    """Write ``plan`` as a plan file that ``recsys-plan show/validate`` and ``load_plan`` read.

    ``model`` (the model the plan is for, before or after ``DistributedModelParallel``; ``meta``
    device is fine) records each table's shape, data type and optimizer state, which validation
    and memory figures need; its optimizer kinds come from ``apply_optimizer_in_backward`` tags
    (after DMP: the sharded modules' per-table fused params), else ``fused_params`` (the
    sharder's), else ``optimizer`` (a kind such as ``"rowwise_adagrad"``, or table -> kind). A model
    with no embedding tables is an error, never a file with none. ``planner`` (the torchrec
    ``EmbeddingShardingPlanner`` or ``TopologyAwarePlanner`` that made the plan) records the batch
    size per rank it planned for (``batch_size`` gives it directly), which the modelled step of
    ``recsys-plan show --topology`` uses. ``world_size`` and ``compute_device`` default to what the
    plan's shards say. The plan is validated first, and the file is written atomically: on any
    error nothing is written.

        plan = planner.collective_plan(model, sharders, pg)
        if rank == 0:
            save_plan(plan, "plan.json", model=model, planner=planner)
        ...
        plan = load_plan("plan.json")   # another job: DistributedModelParallel(model, plan=plan, ...)
    """
    from sharding.plan.validation import validate_plan

    inferred_world, inferred_device = _infer_world_and_device(plan)
    world = world_size or inferred_world
    device = compute_device or inferred_device
    tables = model_tables(model, optimizer, fused_params) if model is not None else {}
    if model is not None and not tables:
        raise PlanFileError(
            f"{path}: save_plan(model=...) found no EmbeddingBagCollection / EmbeddingCollection tables "
            f"in {type(model).__name__}, sharded or not; nothing was written"
        )
    meta = dict(meta or {})
    batch = batch_size or getattr(planner, "_batch_size", None)
    if batch:
        meta.setdefault("batch_size_per_rank", int(batch))
    cluster = getattr(planner, "cluster", None)  # the topology-aware planner's hardware
    if cluster is not None:
        meta.setdefault("planner", "topology")
        meta.setdefault("topology", cluster.name)
    if getattr(planner, "last_pooling", None):
        meta.setdefault("pooling", planner.last_pooling)
    d = plan_to_dict(plan, world, device, tables, meta)
    _, header = plan_from_dict(json.loads(json.dumps(d)), str(path))
    validate_plan(plan, header, str(path))
    return write_plan_file(path, d)


def load_plan(path: str | os.PathLike) -> ShardingPlan:
    """Read and validate a plan file (``save_plan``, ``recsys-plan make``, a run's ``plan.json``):
    a torchrec ``ShardingPlan`` for ``DistributedModelParallel(..., plan=load_plan(path))``.
    Any problem is a ``PlanFileError`` with one line naming the file and the key.

        plan = load_plan("runs/demo/plan.json")
    """
    from sharding.plan.validation import validate_plan

    plan, header = read_plan_file(path)
    validate_plan(plan, header, str(path))
    return plan


def check_plan_fits(header: dict[str, Any], plan: ShardingPlan, tables: dict[str, dict[str, Any]], world_size: int, source: str) -> None:
    """A saved plan must be for this model (table names, shapes) and this world size, and cover
    every table once."""
    if header["world_size"] != world_size:
        raise PlanFileError(f"{source}: key 'world_size': plan is for {header['world_size']} ranks, this job has {world_size}")
    planned = header["tables"]
    if planned and {n: table_shape(t) for n, t in planned.items()} != {n: table_shape(t) for n, t in tables.items()}:
        missing = sorted(set(tables) - set(planned))
        extra = sorted(set(planned) - set(tables))
        changed = sorted(t for t in set(tables) & set(planned) if table_shape(tables[t]) != table_shape(planned[t]))
        what = (
            f"missing tables {missing[:3]}"
            if missing
            else f"unknown tables {extra[:3]}"
            if extra
            else f"table {changed[0]} is {list(table_shape(planned[changed[0]]))} (rows, dim) in the plan, "
            f"{list(table_shape(tables[changed[0]]))} in the model"
        )
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
    unknown = sorted(set(seen) - set(tables))
    if unknown:
        raise PlanFileError(f"{source}: key 'modules.{seen[unknown[0]]}.{unknown[0]}': the model has no table '{unknown[0]}'")
