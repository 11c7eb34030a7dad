"""The enumerator given to torchrec's planner as ``enumerator=``: torchrec's, with a model's
constraints, column-wise variants cut finer (``finer_column_splits``), key_value (SSD) options
sized by ``sharding/planner/ssd_tier.py`` and a fixed order.
"""

from __future__ import annotations

import copy
import time

from torch import nn
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ShardingOption, Topology
from torchrec.distributed.types import ModuleSharder

from sharding.planner.ssd_tier import apply_key_value_storage
from sharding.planner.torchrec_speedups import no_search_space_copy

# column-wise variants the planner adds: each device-resident table cut into 2 and 4 column shards
DEFAULT_COLUMN_SPLITS = (2, 4)


_TYPE_ORDER = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise", "grid_shard", "data_parallel")
_KERNEL_ORDER = ("fused", "fused_uvm_caching", "fused_uvm", "dense", "quant", "key_value")


def finer_column_splits(
    enumerator, space: list[ShardingOption], splits: tuple[int, ...], world: int, local_world: int
) -> list[ShardingOption]:
    """Column-wise / table-column-wise variants of each device-resident option cut into ``k`` in
    ``splits`` equal column shards (at least 4 columns each, FBGEMM's alignment, and at most one
    shard per rank; per host for table-column-wise), estimated by the enumerator's estimators.

    torchrec cuts columns in blocks of ``min_partition`` (default 128), so tables of dim <= 128
    (all of a Criteo DLRM's) get one column shard, the same as table-wise: balance then comes
    in whole tables (26 tables on 8 or 16 ranks leave ranks with one table more than others).
    Tables whose ``ParameterConstraints.min_partition`` is set keep the user's choice. The cost
    model charges each column shard the table's ids (input dist), so finer is not free."""
    from torchrec.distributed.planner.types import Shard
    from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets

    cons = enumerator.constraints
    out: list[ShardingOption] = []
    for so in space:
        if so.sharding_type not in ("column_wise", "table_column_wise") or so.compute_kernel != "fused":
            continue
        c = cons.get(so.name)
        if c is not None and c.min_partition is not None:
            continue
        dim = int(so.tensor.shape[1])
        limit = local_world if so.sharding_type == "table_column_wise" else world
        for k in splits:
            part = dim // k
            if k <= len(so.shards) or k > limit or part < 4 or part % 4 or dim % k:
                continue
            sizes, offsets = calculate_shard_sizes_and_offsets(
                tensor=so.tensor,
                world_size=world,
                local_world_size=local_world,
                sharding_type=so.sharding_type,
                col_wise_shard_dim=part,
                device_memory_sizes=enumerator._device_memory_sizes,
            )
            if len(sizes) != k:
                continue
            new = copy.copy(so)
            new.shards = [Shard(size=sz, offset=off) for sz, off in zip(sizes, offsets)]
            out.append(new)
    if out:
        enumerator.populate_estimates(out)
    return out


def _sorted_enumeration(enumerate_fn, extra=None):
    """The search space in a fixed order: tables as the enumerator first lists them, then sharding
    type, kernel, load factor, shard count. torchrec builds each table's types and kernels with
    ``list(set(...) & set(...))``, so its order (and with it the proposers' order and which of two
    equally rated plans wins) changed with PYTHONHASHSEED from one process to the next.
    ``extra(space)``: more options to add (before sorting)."""

    def run(*args, **kwargs):
        space = enumerate_fn(*args, **kwargs)
        if extra is not None:
            space = list(space) + extra(space)
        first: dict[str, int] = {}
        for so in space:
            first.setdefault(so.fqn, len(first))

        def key(so):
            st, k = so.sharding_type, so.compute_kernel
            return (
                first[so.fqn],
                _TYPE_ORDER.index(st) if st in _TYPE_ORDER else len(_TYPE_ORDER),
                st,
                _KERNEL_ORDER.index(k) if k in _KERNEL_ORDER else len(_KERNEL_ORDER),
                k,
                so.cache_load_factor if so.cache_load_factor is not None else -1.0,
                len(so.shards),
            )

        return sorted(space, key=key)

    return run


class TopologyEnumerator(EmbeddingEnumerator):
    """torchrec's enumerator with the planner's additions, given through the planner's
    ``enumerator=`` argument: the constraints of the model being planned (a new enumerator per
    ``TopologyAwarePlanner.plan``, because the defaults depend on the model's tables), column-wise
    variants cut into ``column_splits`` shards (``finer_column_splits``), the storage of key_value
    options (the SSD tier, ``apply_key_value_storage``: torchrec's estimate counts no HBM cache),
    and a fixed order of the search space (``_sorted_enumeration``); the last search space is kept
    (``last_search_space``) for bounds (``sharding/planner/bounds.py``), with the seconds its enumeration
    took (``last_enumerate_s``). key_value options exist only where the constraints ask for them
    (torchrec guards the kernel) and torchrec's ``Topology`` has SSD capacity."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        column_splits: tuple[int, ...] = DEFAULT_COLUMN_SPLITS,
        constraints: dict[str, ParameterConstraints] | None = None,
    ) -> None:
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints)
        self.constraints: dict[str, ParameterConstraints] = dict(constraints or {})
        self.column_splits = tuple(column_splits)
        self.world_size = topology.world_size
        self.local_world_size = topology.local_world_size
        self.last_search_space: list[ShardingOption] = []
        self.last_enumerate_s = 0.0

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        def extra(space: list[ShardingOption]) -> list[ShardingOption]:
            if not self.column_splits:
                return []
            return finer_column_splits(self, space, self.column_splits, self.world_size, self.local_world_size)

        parent = super().enumerate

        def base(module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
            space = parent(module=module, sharders=sharders)
            apply_key_value_storage(space, sharders)
            return space

        t0 = time.perf_counter()
        # torchrec's cache of the last search space (a deep copy, for a second call with the same
        # module) is neither made nor read: enumeration is once per plan
        self._last_stored_module = None
        with no_search_space_copy():
            self.last_search_space = _sorted_enumeration(base, extra=extra)(module=module, sharders=sharders)
        self._last_stored_module = self._last_stored_search_space = None
        self.last_enumerate_s += time.perf_counter() - t0
        return self.last_search_space
