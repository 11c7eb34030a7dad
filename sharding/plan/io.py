"""Plan files on disk: ``save_plan`` and ``load_plan``, the tables a model records in a plan file,
and the check that a saved plan is for the job at hand.

Public API: ``save_plan(plan, path, model=...)`` and ``load_plan(path) -> ShardingPlan`` (both
validate: sharding/plan/validation.py); ``read_plan_file`` gives the header too. The JSON layout
and its versions are sharding/plan/file_format.py; this module adds what touches files and models.
Every problem with a file is a `PlanFileError` with one line naming the file and the key.
Files are written atomically (temp file + rename): a crash never leaves half a plan.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torchrec.distributed.types import ShardingPlan

from sharding.plan.errors import PlanFileError
from sharding.plan.file_format import plan_from_dict, plan_to_dict


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
