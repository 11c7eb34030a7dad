"""Per-table ``ParameterConstraints``: the planner's defaults for a model's tables and their
per-table merge with a user's constraints.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Mapping

from torch import nn
from torchrec.distributed.planner import ParameterConstraints

from sharding.constants import MODEL_PARALLEL_TYPES, SSD_KERNELS
from sharding.tables import table_configs


def merge_constraints(
    defaults: Mapping[str, ParameterConstraints], user: Mapping[str, ParameterConstraints] | None
) -> dict[str, ParameterConstraints]:
    """Per table: the user's constraint where given, with the fields it leaves None
    (``sharding_types``, ``compute_kernels``) taken from the planner's default for that table;
    the default elsewhere. A constraint on one table never changes another's. Copies: the user's
    objects are not modified (cache statistics are written into the result later)."""
    out = {name: dataclasses.replace(c) for name, c in defaults.items()}
    for name, c in (user or {}).items():
        d = defaults.get(name)
        fill = {} if d is None else {f: getattr(d, f) for f in ("sharding_types", "compute_kernels") if getattr(c, f) is None}
        if "compute_kernels" in fill and "data_parallel" in (c.sharding_types or []) and "dense" not in fill["compute_kernels"]:
            # data_parallel runs on the dense kernel alone (torchrec's own default for it): a user who
            # asks for it and leaves the kernels open must get it, not "no combination" for the table
            fill["compute_kernels"] = [*fill["compute_kernels"], "dense"]
        out[name] = dataclasses.replace(c, **fill)
    return out


def default_constraints(
    module: nn.Module, compute_device: str, sharding_types: list[str] | None = None, key_value_tables: Collection[str] = ()
) -> dict[str, ParameterConstraints]:
    """Model-parallel sharding types; fused kernels, plus UVM and UVM caching on GPUs, plus the
    SSD kernel (``key_value``, torchrec guards it: only where asked) for ``key_value_tables``,
    the tables nothing else can hold (``sharding/planner/ssd_tier.py``: ``key_value_tables``)."""
    types = list(sharding_types or MODEL_PARALLEL_TYPES)
    kernels = ["fused"] if compute_device == "cpu" else ["fused", "fused_uvm", "fused_uvm_caching"]
    if "data_parallel" in types:
        kernels.append("dense")
    ssd = set(key_value_tables) if compute_device == "cuda" else set()
    return {
        name: ParameterConstraints(sharding_types=types, compute_kernels=kernels + list(SSD_KERNELS) if name in ssd else kernels)
        for name in (c.name for c in table_configs(module))
    }
