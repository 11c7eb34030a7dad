"""Which tables of a torchrec module are CowClip-Adam tables, and where their state lives: the
per-table tag (``tag_cowclip_adam``), the plan's compute kernel mapped to a state location
(device, managed or host-mapped memory), and grouped configs split by that location."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.optim import Adam as TrecAdam
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys.optim.cowclip.hyper import COWCLIP_ADAM, CowClipHyper, cowclip_fused_params

# the plan's compute kernel -> where CowClipAdamTBE keeps weights + state (fused_uvm: see state_location)


# the plan's compute kernel -> where CowClipAdamTBE keeps weights + state (fused_uvm: see state_location)
_KERNEL_LOCATION = {
    EmbeddingComputeKernel.FUSED: "device",
    EmbeddingComputeKernel.DENSE: "device",
    EmbeddingComputeKernel.FUSED_UVM: "managed",
}

_DP = ShardingType.DATA_PARALLEL.value


def is_cowclip(fused_params: dict[str, Any] | None) -> bool:
    return bool(fused_params) and fused_params.get("optimizer") == COWCLIP_ADAM


def table_location(table: Any, fused_params: dict[str, Any] | None) -> str:
    """Where a CowClip table keeps weights + optimizer state, from the kernel the plan gave it
    (torchrec keeps it per table: its grouping files ``fused_uvm`` tables under ``fused``):
    ``device`` (fused, dense), ``managed`` (fused_uvm; ``host_mapped`` when the fused params set
    ``uvm_host_mapped``, as for FBGEMM's tables). Any other kernel is a one-line error."""
    kernel = EmbeddingComputeKernel(table.compute_kernel)
    if kernel == EmbeddingComputeKernel.FUSED_UVM_CACHING:
        raise ValueError(
            f"CowClip-Adam table {table.name}: compute kernel fused_uvm_caching is not supported (FBGEMM's cache of "
            "hot rows cannot stay coherent with the CowClip update); use fused_uvm or fused"
        )
    if kernel not in _KERNEL_LOCATION:
        raise ValueError(
            f"CowClip-Adam table {table.name} needs compute kernel fused or fused_uvm (dense for data_parallel), "
            f"the plan says {kernel.value}"
        )
    location = _KERNEL_LOCATION[kernel]
    if location == "managed" and (fused_params or {}).get("uvm_host_mapped"):
        location = "host_mapped"
    return location


def state_location(config: GroupedEmbeddingConfig) -> str:
    """The one location of a CowClip group's tables (``split_by_location`` made it uniform)."""
    locations = {table_location(t, config.fused_params) for t in config.embedding_tables}
    if len(locations) != 1:
        raise ValueError(
            f"CowClip-Adam tables {[t.name for t in config.embedding_tables]}: one kernel holds "
            f"tables of one location, got {sorted(locations)}"
        )
    return locations.pop()


def split_by_location(configs: list[GroupedEmbeddingConfig]) -> list[GroupedEmbeddingConfig]:
    """torchrec groups ``fused`` and ``fused_uvm`` tables of equal fused params into one group (FBGEMM
    places each table of a TBE on its own); a CowClip TBE keeps its tables in one flat buffer, so
    each CowClip group is cut into runs of consecutive tables with the same location. The order of
    tables, hence of features and output columns across the lookup's groups, is unchanged."""
    out: list[GroupedEmbeddingConfig] = []
    for config in configs:
        if not is_cowclip(config.fused_params):
            out.append(config)
            continue
        runs: list[tuple[str, list[Any]]] = []
        for t in config.embedding_tables:
            loc = table_location(t, config.fused_params)
            if runs and runs[-1][0] == loc:
                runs[-1][1].append(t)
            else:
                runs.append((loc, [t]))
        if len(runs) == 1:
            out.append(config)
        else:
            out.extend(dataclasses.replace(config, embedding_tables=tables) for _, tables in runs)
    return out


def tag_cowclip_adam(params: Iterable[nn.Parameter], hyper: CowClipHyper | None = None, **kw: Any) -> None:
    """Select CowClip-Adam for these embedding tables (``kw``: fields of ``CowClipHyper``; ``lr``
    is accepted for ``learning_rate``)."""
    if "lr" in kw:
        kw["learning_rate"] = kw.pop("lr")
    hyper = hyper or CowClipHyper(**kw)
    apply_optimizer_in_backward(TrecAdam, list(params), cowclip_fused_params(hyper))
