"""Why a model does not fit: one line naming what the embeddings need (weights plus each table's
real optimizer state), what the ranks hold, the shortfall and the largest tables.

torchrec's planner says only "Unable to find a plan for this model because of insufficient
storage" (or a multi-line table of proposals); a user needs to know by how much and which tables
to shrink, offload or split.

    try:
        plan = planner.plan(model, sharders)
    except PlannerError as e:
        raise SystemExit(does_not_fit_message(model, topology, e))
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn
from torchrec.distributed.planner.types import Topology

from sharding.optimizer_state import state_bytes, weight_bytes

GIB = 1024**3
TORCHREC_RESERVE = 0.15  # torchrec's planner keeps this share of each device's memory in reserve


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps a figure above 1 (KiB, MiB or GiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 1024:,.2f} KiB"


def table_bytes(tables: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Table -> weights + optimizer state bytes, from plan-file table entries (``plan_io.model_tables``)."""
    out = {}
    for name, t in tables.items():
        rows, cols = t["num_embeddings"], t["embedding_dim"]
        st = t.get("optimizer_state") or {"kind": "rowwise_adagrad"}
        out[name] = weight_bytes(t.get("data_type") or "FP32", rows, cols) + state_bytes(st["kind"], rows, cols)
    return out


def does_not_fit_message(module: nn.Module, topology: Topology, err: Exception) -> str:
    """One line: need vs what the ranks hold (after torchrec's reserve), shortfall, largest tables."""
    from sharding.plan.io import model_tables

    tables = model_tables(module)
    sizes = table_bytes(tables)
    need = sum(sizes.values())
    world = topology.world_size
    hbm = sum(d.storage.hbm for d in topology.devices)
    ddr = sum(d.storage.ddr for d in topology.devices)
    usable = (hbm + ddr) * (1 - TORCHREC_RESERVE)
    top = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    largest = ", ".join(
        f"{n} {format_bytes(b)} ({tables[n]['num_embeddings']:,} x {tables[n]['embedding_dim']}, "
        f"{(tables[n].get('optimizer_state') or {}).get('kind', 'rowwise_adagrad')})"
        for n, b in top
    )
    per_rank = (hbm + ddr) / world * (1 - TORCHREC_RESERVE)
    said = planner_said(err)
    if reserve_exceeds_hbm(err):
        verdict = (
            f"each rank's {format_bytes(hbm / world)} HBM is less than what torchrec reserves before placing any table "
            f"({TORCHREC_RESERVE:.0%} of it, the dense modules and the input buffers)"
        )
        fix = "more HBM per rank (--hbm-gb), or leave --hbm-gb out for the device's own"
    elif need > usable:
        verdict = f"short by {format_bytes(need - usable)}"
        ranks = math.ceil(need / per_rank) if per_rank > 0 else 0
        fix = (
            f"{f'about {ranks} ranks like these, or ' if ranks else ''}more memory per rank (--hbm-gb / --ddr-gb), "
            f"or fewer rows / a smaller embedding_dim for the largest tables"
        )
    elif top[0][1] > per_rank:
        verdict = f"enough in all, but the largest table needs {format_bytes(top[0][1])} and one rank holds {format_bytes(per_rank)}"
        fix = "allow row_wise / column_wise sharding (and fused_uvm_caching on GPUs) for the largest tables"
    else:
        verdict = "enough in all and per rank, but no placement the constraints allow fits (see what the planner said)"
        fix = "allow more sharding types and compute kernels for the largest tables, or more memory per rank"
    return (
        f"model does not fit {world} ranks ({topology.compute_device}): embeddings need {format_bytes(need)} "
        f"(weights + optimizer state), the ranks hold {format_bytes(hbm / world)} HBM + {format_bytes(ddr / world)} host memory each, "
        f"{format_bytes(usable)} in all after torchrec's {TORCHREC_RESERVE:.0%} reserve: {verdict}; largest tables: {largest}; "
        f"to fit: {fix}; planner said: {said}"
    )


def planner_said(err: Exception) -> str:
    """The first line of a planner error, whole (a cut mid-word reads as garbage)."""
    text = str(err).strip()
    return text.splitlines()[0].strip() if text else type(err).__name__


def reserve_exceeds_hbm(err: Exception) -> bool:
    """torchrec's storage reservation left negative HBM: its percentage, the dense modules and the
    KJT buffers take more than a rank has, so no table fits whatever its size or sharding."""
    return "negative available hbm storage" in str(err)
