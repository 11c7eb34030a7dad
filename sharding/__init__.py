"""Topology-aware sharding for TorchRec: the public API (docs/dropin.md).

    from sharding import TopologyAwarePlanner, ClusterTopology, load_topology, save_plan, load_plan

    planner = TopologyAwarePlanner("cpu-gloo", batch_size=512)   # a shipped name, a YAML path or a ClusterTopology
    plan = planner.collective_plan(model, sharders)              # a torchrec ShardingPlan, for DistributedModelParallel
    save_plan(plan, "plan.json", model=model)                    # reusable by `recsys-plan show/validate`
    plan = load_plan("plan.json")

Names are imported lazily (PEP 562), so ``import sharding`` stays cheap and imports no torchrec.
This package never imports ``recsys``.
"""

from __future__ import annotations

import importlib
from typing import Any

from sharding.compat import install_log_filters

install_log_filters()  # before anything imports FBGEMM (sharding/compat.py)

# public name -> module that defines it
_EXPORTS = {
    "TopologyAwarePlanner": "sharding.planner.topology_planner",
    "ModelDoesNotFitError": "sharding.planner.topology_planner",
    "ClusterTopology": "sharding.topology.cluster",
    "load_topology": "sharding.topology.topology_file",
    "save_plan": "sharding.plan.io",
    "load_plan": "sharding.plan.io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sharding' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
