"""CowClip-Adam as a drop-in for TorchRec pipelines: one sharder, one per-table tag
(``EmbeddingCollection`` tables: ``recsys.optim.cowclip.sequence``, built on the kernel and
lookup pieces here).

    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam
    tag_cowclip_adam(ebc.parameters(), lr=1e-4)                  # which tables, which hyperparameters
    dmp = DistributedModelParallel(model, sharders=[CowClipEmbeddingBagCollectionSharder()], ...)

Untagged tables of the same EBC keep the stock FBGEMM kernels. The tag is
``apply_optimizer_in_backward(torchrec.optim.Adam, ..., {"optimizer": COWCLIP_ADAM, ...})``: the
explicit ``optimizer`` key stops torchrec from mapping the class to an FBGEMM type, and the class
``torchrec.optim.Adam`` makes the planner count 2 extra floats per weight (Adam's moments).

How it plugs in (docs/design/cowclip.md section 1): ``ShardedCowClipEmbeddingBagCollection``
overrides ``_create_lookups`` so every sharding type's lookup is our subclass, whose
``_create_embedding_kernel`` builds ``CowClipEmbeddingBag`` for tagged groups. The plan keeps the
kernels it already names (``fused`` for model-parallel, ``dense`` for data-parallel), so the
planner's estimates and torchrec's state-dict plumbing (ShardedTensors per table) stay as they
are, and the optimizer state goes through torchrec's ``EmbeddingFusedOptimizer`` into the DMP's
``fused_optimizer`` state dict, i.e. into ``torch.distributed.checkpoint``.

Every sharding type updates inside the backward, so a loop that steps only its dense optimizer
(torchrec's ``TrainPipelineSparseDist`` handed a dense optimizer, as in torchrec's
``examples/golden_training/train_dlrm.py``) trains every CowClip table; ``fused_optimizer.step()``
has nothing left to do for them (it only passes the param group's lr on). Table-wise, row-wise and
table-row-wise kernels update in their own backward. Column-wise, table-column-wise and
data-parallel kernels stage their rows there, and the lookup's exchange node
(``_ExchangeAfterBackward``) runs the cross-rank exchange and the update right after them, in the
same backward (``recsys.optim.cowclip.exchange``).

Why a collective inside backward is sound here (gloo matches collectives by their order per
process group, so every rank of the group must issue them in the same order):

* The node exists on every rank of the sharding's group whenever the plan has CowClip tables of
  that type (the list comes from the plan, identical everywhere), also on ranks that hold none
  of them: it is joined into the lookup's output (``_JoinAnchor``), which flows into torchrec's
  output dist on every rank, so backward always reaches it.
* torch's autograd engine runs the CPU nodes of one backward on one thread, taking the ready node
  with the highest sequence number (creation order in forward). The nodes that issue collectives
  (torchrec's output-dist all-to-all backward, DDP's bucket all-reduces of the dense part, this
  node) are created in the same forward order on every rank and become ready from the same
  nodes. The only rank-dependent nodes are the kernels below a lookup; they start no collective,
  and the kernels that gate the exchange node were created after it (higher sequence number), so
  they always run before any node it could be reordered with. Hence every rank issues these
  collectives in the same order (an argument, checked by tests/integration/cowclip/test_cowclip_dropin.py under
  ``TrainPipelineSparseDist``, and by tests/integration/cowclip/test_cowclip_sharded.py with ranks that hold none of
  a type's tables). On CUDA the nodes of one device likewise share one engine thread, and the
  exchange node lives on the features' device; not run on a GPU in this project.
* ``TrainPipelineSparseDist`` starts the next batch's input dist before this backward, in the same
  program order on every rank; those all-to-alls are merely still in flight (gloo matches them
  by their earlier position), nothing of the pipeline issues collectives from inside backward.
* The alternative, applying the staged update at the next forward, would leave the weights stale
  for anything that reads them in between (``state_dict`` for a checkpoint on some ranks only, an
  eval forward) and would have needed collectives outside any forward; doing it in backward
  leaves nothing pending.

If the exchange is ever skipped after a kernel staged rows (an exception in backward, a kernel
called outside its lookup), the next forward of that kernel raises instead of reading stale
weights. Calling backward twice on one graph (``retain_graph``) updates twice, like every fused
torchrec optimizer.

Compute kernels (what the planner may choose for an EBC this sharder shards, docs/cowclip.md
"CowClip tables in host memory"): ``fused`` (state in device memory), and on CUDA ``fused_uvm``
(weights, both moments and ``row_step`` in host memory through FBGEMM's unified-memory
allocator, ``CowClipAdamTBE(location="managed")``, or ``"host_mapped"`` with the fused param
``uvm_host_mapped``; torchrec groups fused and fused_uvm tables together, ``split_by_location``
cuts CowClip groups by location); ``dense`` for data-parallel. Never ``fused_uvm_caching``: FBGEMM's cache of
hot weight rows cannot be kept coherent with an update that is not FBGEMM's own backward (see
``recsys.optim.cowclip.tbe``). torchrec asks a sharder per sharding type, not per table, so the
untagged tables of these EBCs get the same choice.

Relies on private torchrec 1.8 attributes of the sharding objects (``_grouped_embedding_configs``,
``_grouped_embedding_configs_per_rank``, ``_rank``, ``_pg``, ``_env``, ``_device``);
``tests/integration/cowclip/test_cowclip_sharded.py`` guards them so an upgrade fails loudly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag, EmbeddingFusedOptimizer
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import Adam as TrecAdam
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule

from recsys.optim.cowclip.exchange import ExchangeTable, column_wise_step, data_parallel_step
from recsys.optim.cowclip.tbe import (
    COWCLIP_ADAM,
    CowClipAdamTBE,
    CowClipHyper,
    check_fused_params,
    cowclip_fused_params,
)
from sharding.compat import SEBC_WRAPS_DP_IN_INIT, ddp_wrap_skipping

# the plan's compute kernel -> where CowClipAdamTBE keeps weights + state (fused_uvm: see state_location)
_KERNEL_LOCATION = {
    EmbeddingComputeKernel.FUSED: "device",
    EmbeddingComputeKernel.DENSE: "device",
    EmbeddingComputeKernel.FUSED_UVM: "managed",
}

__all__ = [
    "COWCLIP_ADAM",
    "take_update_stats",
    "CowClipEmbeddingBag",
    "CowClipEmbeddingBagCollectionSharder",
    "ShardedCowClipEmbeddingBagCollection",
    "is_cowclip",
    "tag_cowclip_adam",
]

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


# ---- the kernel -------------------------------------------------------------------------------
class ReplicatedCowClipFusedOptimizer(FusedOptimizer):
    """Optimizer state of data-parallel CowClip tables: plain tensors, identical on every replica
    (torchrec's EmbeddingFusedOptimizer needs ShardedTensor metadata, which DP tables lack)."""

    def __init__(self, config: GroupedEmbeddingConfig, tbe: CowClipAdamTBE) -> None:
        self._tbe = tbe
        params: dict[str, Tensor] = {}
        state: dict[Any, Any] = {}
        for table, weight, st in zip(config.embedding_tables, tbe.split_embedding_weights(), tbe.get_optimizer_state()):
            params[f"{table.name}.weight"] = weight
            state[weight] = {
                f"{table.name}.momentum1": st["exp_avg"],
                f"{table.name}.exp_avg_sq": st["exp_avg_sq"],
                f"{table.name}.row_step": st["row_step"],
            }
        super().__init__(params, state, [{"params": list(params.values()), "lr": tbe.get_learning_rate()}])

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._tbe.set_learning_rate(self.param_groups[0]["lr"])

    def step(self, closure: Any = None) -> None:
        self._tbe.set_learning_rate(self.param_groups[0]["lr"])

    def set_optimizer_step(self, step: int) -> None:
        self._tbe.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        self._tbe.update_hyper_parameters(params_dict)


class CowClipFusedOptimizer(EmbeddingFusedOptimizer):
    """torchrec's ``EmbeddingFusedOptimizer`` for the two Adam moments (pointwise ShardedTensors,
    checkpointed as ``<t>.momentum1`` / ``<t>.exp_avg_sq``), plus ``<t>.row_step`` built here.

    Why not let torchrec build ``row_step`` too: it classifies a state tensor with one element as a
    per-table scalar, so a row-wise shard holding a single row (small tables split over ranks) gets
    a different global layout on that rank than on the others and DCP rejects the checkpoint."""

    def __init__(self, config: GroupedEmbeddingConfig, tbe: CowClipAdamTBE, pg: dist.ProcessGroup | None) -> None:
        states = tbe.get_optimizer_state()
        super().__init__(config, tbe, pg, all_optimizer_states=[{k: v for k, v in st.items() if k != "row_step"} for st in states])  # type: ignore[arg-type]
        local: dict[str, list[tuple[Tensor, ShardMetadata]]] = {}
        for table, st in zip(config.embedding_tables, states):
            local.setdefault(table.name, []).append((st["row_step"], table.local_metadata))
        done: set[str] = set()
        for table in config.embedding_tables:
            if table.name in done:
                continue
            done.add(table.name)
            weight = self.params[f"{table.name}.weight"]
            self.state[weight][f"{table.name}.row_step"] = _rowwise_sharded(table, local[table.name], pg)


def _rowwise_sharded(table: Any, local: list[tuple[Tensor, ShardMetadata]], pg: dist.ProcessGroup | None) -> ShardedTensor:
    """A per-row state as a 1-D ShardedTensor laid out like torchrec's row-wise optimizer states:
    row offsets of the weight's shards; for column-wise tables one full-length block per shard."""
    shards = list(table.global_metadata.shards_metadata)
    column_wise = table.local_cols != table.embedding_dim
    if column_wise:
        shards.sort(key=lambda m: m.shard_offsets[1])
    mapping = {}
    for i, m in enumerate(shards):
        off = i * m.shard_sizes[0] if column_wise else m.shard_offsets[0]
        mapping[m] = ShardMetadata(shard_sizes=[m.shard_sizes[0]], shard_offsets=[off], placement=m.placement)
    size = table.global_metadata.size[0] * (len(shards) if column_wise else 1)
    meta = ShardedTensorMetadata(
        shards_metadata=list(mapping.values()),
        size=torch.Size([size]),
        tensor_properties=TensorProperties(dtype=torch.long, layout=torch.strided, requires_grad=False),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=[Shard(t, mapping[m]) for t, m in local],
        sharded_tensor_metadata=meta,
        process_group=pg,
    )


class CowClipKernel:
    """What the pooled (EBC) and unpooled (EC) CowClip kernels share: a ``CowClipAdamTBE`` behind
    torchrec's kernel API (its fused optimizer, flush, per-table parameters). Mixed in before
    torchrec's ``BaseBatchedEmbeddingBag`` / ``BaseBatchedEmbedding``, whose constructor fills
    ``_local_rows``, ``_local_cols``, ``_feature_table_map`` and ``_embedding_dims``."""

    _emb_module: CowClipAdamTBE
    _optim: FusedOptimizer

    def _build_cowclip(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        mode: str,
        replicated: bool,
        location: str,
        pooling_mode: Any,
    ) -> None:
        hyper = CowClipHyper.from_fused_params(config.fused_params)
        self._emb_module = CowClipAdamTBE(
            list(zip(self._local_rows, self._local_cols)),
            self._feature_table_map,
            hyper,  # type: ignore[attr-defined]
            full_dims=self._embedding_dims,
            mode=mode,
            pooling_mode=pooling_mode,
            device=device,  # type: ignore[attr-defined]
            location=location,
        )
        self.table_names = [t.name for t in config.embedding_tables]
        self._emb_module.table_names = self.table_names
        self.replicated = replicated
        self._optim = (
            ReplicatedCowClipFusedOptimizer(config, self._emb_module) if replicated else CowClipFusedOptimizer(config, self._emb_module, pg)
        )
        self.init_parameters()  # type: ignore[attr-defined]

    @property
    def emb_module(self) -> CowClipAdamTBE:
        return self._emb_module

    def flush(self) -> None:
        """torchrec flushes every lookup's kernels before it reads the tables (the sharded module's
        state_dict pre-hook; for FBGEMM's caching kernels it writes the cache back). Ours has no
        cache; with ``update_scope="catchup"`` its pending work is the rows behind the current step,
        so flushing catches them all up: a stock loop's ``dmp.state_dict()`` (DCP, torch.save) then
        saves the dense reference's tables without a call to ``catch_up_all_tables``. The
        optimizer's state_dict (torchrec's CombinedOptimizer) holds views of the same moments and
        calls nothing of ours: take the model's state_dict before the optimizer's is serialized
        (DCP writes both after both are built), or call ``catch_up_all_tables`` first."""
        self._emb_module.catch_up_all()

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    @property
    def _param_per_table(self) -> dict[str, TableBatchedEmbeddingSlice]:
        out = {}
        tbe = self._emb_module
        counts = dict(self.table_name_to_count)  # type: ignore[attr-defined]
        for t, (rows, dim) in enumerate(tbe.embedding_specs):
            name = self.table_names[t]
            if name not in counts:
                continue
            n = counts.pop(name)  # shards of one table in one kernel are adjacent (CW on one rank)
            off = tbe.weights_physical_offsets[t]
            sl = TableBatchedEmbeddingSlice(tbe.weights, off, off + n * rows * dim, -1, dim)
            sl._in_backward_optimizers = [EmptyFusedOptimizer()]  # keeps it away from the dense optimizer
            out[name] = sl
        return out

    @_param_per_table.setter
    def _param_per_table(self, v: dict[str, TableBatchedEmbeddingSlice]) -> None:
        self.__dict__["_param_per_table"] = v

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        yield from ()  # fused parameters are not buffers for outside optimizers (torchrec convention)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for name, tensor in self.named_split_embedding_weights(prefix, recurse, remove_duplicate):  # type: ignore[attr-defined]
            param = nn.Parameter(tensor, requires_grad=False)
            param._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
            yield name, param


class CowClipEmbeddingBag(CowClipKernel, BaseBatchedEmbeddingBag[Tensor], FusedOptimizerModule):
    """torchrec embedding-bag kernel over ``CowClipAdamTBE``; shaped like ``BatchedFusedEmbeddingBag``."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        sharding_type: ShardingType | None,
        mode: str,
        replicated: bool,
        location: str = "device",
    ) -> None:
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        self._build_cowclip(config, pg, device, mode, replicated, location, self._pooling)


# ---- lookups ----------------------------------------------------------------------------------
class CowClipLookup:
    """What the pooled and the sequence CowClip lookups share: the CowClip kernels among the
    lookup's ``_emb_modules``, and ``module`` (torchrec unwraps data-parallel lookups with it)."""

    _cowclip_mode: str

    def cowclip_kernels(self) -> list[CowClipKernel]:
        return [m for m in self._emb_modules if isinstance(m, CowClipKernel)]  # type: ignore[attr-defined]

    @property
    def module(self) -> "CowClipLookup":
        """``_initialize_torch_state`` unwraps DP lookups with ``.module`` (DDP); ours is not wrapped."""
        return self

    @property
    def cowclip_update_mode(self) -> str:
        """The TBE's update mode for this lookup's sharding type (``tbe`` module docstring)."""
        return "inline" if self._cowclip_mode == "inline" else "deferred"


class CowClipGroupedPooledEmbeddingsLookup(CowClipLookup, GroupedPooledEmbeddingsLookup):
    """A torchrec grouped lookup that builds ``CowClipEmbeddingBag`` for tagged groups."""

    def __init__(self, grouped_configs: list[GroupedEmbeddingConfig], *, cowclip_mode: str, **kw: Any) -> None:
        object.__setattr__(self, "_cowclip_mode", cowclip_mode)  # read by _create_embedding_kernel
        super().__init__(split_by_location(grouped_configs), **kw)

    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):  # type: ignore[override]
        if not is_cowclip(config.fused_params):
            return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
        return CowClipEmbeddingBag(
            config,
            pg,
            device,
            sharding_type,
            mode=self.cowclip_update_mode,
            replicated=self._cowclip_mode == "dp",
            location=state_location(config),
        )


class _ExchangeOptimizer(FusedOptimizer):
    """No state and nothing to do: the column-wise / data-parallel update already ran in backward
    (``_ExchangeAfterBackward``). Kept so the lookup stays a ``FusedOptimizerModule``."""

    def __init__(self) -> None:
        super().__init__({}, {}, [{"params": [], "lr": 0.0}])

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def step(self, closure: Any = None) -> None:
        pass


class _ExchangeAfterBackward(torch.autograd.Function):
    """Identity on an empty seed; its output is every CowClip kernel's autograd anchor, so its
    backward runs after all of them: it runs the lookup's exchange and update (module docstring)."""

    @staticmethod
    def forward(ctx, seed: Tensor, lookup: "ExchangeLookup") -> Tensor:  # type: ignore[override]
        ctx.lookup = lookup
        return seed.new_empty(0)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        ctx.lookup.exchange_and_update()
        return None, None


class _JoinAnchor(torch.autograd.Function):
    """The lookup's output, unchanged, with the exchange node as a second input, so that backward
    reaches the exchange on every rank, also where this rank's lookup has no CowClip kernel."""

    @staticmethod
    def forward(ctx, out: Tensor, anchor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.anchor_meta = (anchor.shape, anchor.dtype, anchor.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        shape, dtype, device = ctx.anchor_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


class ExchangeLookup(CowClipLookup):
    """A lookup of a column-wise, table-column-wise or data-parallel sharding with CowClip tables
    (on any rank: ranks that hold none of them still join the exchange, so the collectives
    match). Its training forward wires the exchange node that updates them in backward. Mixed
    in before the pooled or sequence CowClip lookup."""

    exchange_tables: list[ExchangeTable]
    exchange_pg: dist.ProcessGroup | None

    def __init__(
        self,
        grouped_configs: list[GroupedEmbeddingConfig],
        *,
        exchange_tables: list[ExchangeTable],
        exchange_pg: dist.ProcessGroup | None,
        **kw: Any,
    ) -> None:
        super().__init__(grouped_configs, **kw)  # the pooled or sequence CowClip lookup after it in the MRO
        self.exchange_tables = exchange_tables
        self.exchange_pg = exchange_pg
        self._exchange_optim = _ExchangeOptimizer()

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._exchange_optim

    def forward(self, sparse_features: Any) -> Tensor:
        """Training forward: the kernels' anchors come from the exchange node, and the output is
        joined to it (module docstring). Eval / no-grad forwards are torchrec's own."""
        if not (torch.is_grad_enabled() and self.exchange_tables):
            return super().forward(sparse_features)  # type: ignore[misc]
        # on the features' device: the engine queues a node by its inputs' device, as torchrec's
        seed = torch.empty(0, device=sparse_features.device(), requires_grad=True)
        anchor = _ExchangeAfterBackward.apply(seed, self)
        tbes = [k.emb_module for k in self.cowclip_kernels()]
        for tbe in tbes:
            tbe.autograd_anchor = anchor
        try:
            out = super().forward(sparse_features)  # type: ignore[misc]
        finally:
            for tbe in tbes:
                tbe.autograd_anchor = None
        return _JoinAnchor.apply(out, anchor)

    def exchange_and_update(self) -> None:
        if not self.exchange_tables:
            return
        tbes = [(k.emb_module, k.table_names) for k in self.cowclip_kernels()]
        for k in self.cowclip_kernels():  # the fused optimizer's lr (schedules) applies to step's update
            k.emb_module.set_learning_rate(k.fused_optimizer.param_groups[0]["lr"])
        if self._cowclip_mode == "dp":
            data_parallel_step(self.exchange_tables, tbes, self.exchange_pg)
        else:
            column_wise_step(self.exchange_tables, tbes, self.exchange_pg)


class CowClipExchangeLookup(ExchangeLookup, CowClipGroupedPooledEmbeddingsLookup, FusedOptimizerModule):
    """The pooled ``ExchangeLookup`` (column-wise, table-column-wise, data-parallel EBC tables)."""


def _lookup_for(sharding: Any, cowclip_tables: dict[str, list[ExchangeTable]]) -> GroupedPooledEmbeddingsLookup:
    """Mirrors the five torchrec ``create_lookup`` bodies (tw/rw/cw/twrw/dp_sharding.py)."""
    L: Any = CowClipGroupedPooledEmbeddingsLookup
    kw: dict[str, Any] = dict(device=sharding._device, env=sharding._env)
    if isinstance(sharding, DpPooledEmbeddingSharding):
        pg = sharding._env.process_group
        return CowClipExchangeLookup(
            sharding._grouped_embedding_configs,
            pg=pg,
            scale_weight_gradients=False,
            cowclip_mode="dp",
            exchange_tables=cowclip_tables.get(_DP, []),
            exchange_pg=pg,
            **kw,
        )
    if isinstance(sharding, TwRwPooledEmbeddingSharding):
        return L(
            sharding._grouped_embedding_configs_per_rank[sharding._rank],
            pg=sharding._pg,
            sharding_type=ShardingType.TABLE_ROW_WISE,
            cowclip_mode="inline",
            **kw,
        )
    if isinstance(sharding, RwPooledEmbeddingSharding):
        return L(sharding._grouped_embedding_configs, pg=sharding._pg, sharding_type=ShardingType.ROW_WISE, cowclip_mode="inline", **kw)
    if isinstance(sharding, CwPooledEmbeddingSharding):  # TwCw is a subclass; one sharding per type
        st = ShardingType.TABLE_COLUMN_WISE.value if isinstance(sharding, TwCwPooledEmbeddingSharding) else (ShardingType.COLUMN_WISE.value)
        return CowClipExchangeLookup(
            sharding._grouped_embedding_configs,
            pg=sharding._pg,
            cowclip_mode="cw",
            exchange_tables=list(cowclip_tables.get(st, [])),
            exchange_pg=sharding._pg,
            **kw,
        )
    if isinstance(sharding, TwPooledEmbeddingSharding):
        return L(sharding._grouped_embedding_configs, pg=sharding._pg, cowclip_mode="inline", **kw)
    raise NotImplementedError(f"CowClip sharder: sharding {type(sharding).__name__} is not supported")


def cowclip_tables_by_sharding_type(
    module: nn.Module, params: dict[str, ParameterSharding], fused_params: dict[str, Any] | None
) -> dict[str, list[ExchangeTable]]:
    """The plan's CowClip tables per sharding type of an EBC or EC: the same on every rank (plan +
    module tags)."""
    out: dict[str, list[ExchangeTable]] = {}
    for cfg, w in module_tables(module):
        if cfg.name not in params:
            continue
        kwargs = (getattr(w, "_optimizer_kwargs", None) or [{}])[0]
        tagged = is_cowclip(kwargs) or ("optimizer" not in kwargs and is_cowclip(fused_params))
        if tagged:
            st = params[cfg.name].sharding_type
            out.setdefault(st, []).append(ExchangeTable(cfg.name, cfg.num_embeddings, cfg.embedding_dim))
    for v in out.values():
        v.sort(key=lambda t: t.name)
    return out


def module_tables(module: nn.Module) -> list[tuple[Any, nn.Parameter]]:
    """(table config, weight) of an EmbeddingBagCollection or EmbeddingCollection."""
    if isinstance(module, EmbeddingBagCollection):
        return [(c, module.embedding_bags[c.name].weight) for c in module.embedding_bag_configs()]
    return [(c, module.embeddings[c.name].weight) for c in module.embedding_configs()]  # type: ignore[operator, index]


def is_cowclip_dp_lookup(lookup: Any) -> bool:
    return isinstance(lookup, ExchangeLookup) and bool(lookup.cowclip_kernels())


def forget_dense_steps(module: Any, incompatible_keys: Any) -> None:
    for k in module._cowclip_kernels():
        k.emb_module.forget_dense_step()


class CowClipShardedModule:
    """What the sharded EBC and EC share: their CowClip kernels and the catch-up of all rows.
    Mixed in before torchrec's sharded module, whose ``_lookups`` it reads."""

    _lookups: list[Any]

    def _cowclip_kernels(self) -> list[CowClipKernel]:
        """The CowClip kernels of every lookup (they sit in torchrec's plain ``_lookups`` list)."""
        return [k for lk in self._lookups for k in (lk.cowclip_kernels() if isinstance(lk, CowClipLookup) else [])]

    def catch_up_all(self) -> int:
        """``update_scope="catchup"`` tables: every row to the current step (the kernels sit in
        torchrec's plain ``_lookups`` list, out of ``modules()``; ``catch_up_all_tables`` finds
        this method instead). Returns the rows advanced."""
        return sum(k.emb_module.catch_up_all() for k in self._cowclip_kernels())


class ShardedCowClipEmbeddingBagCollection(CowClipShardedModule, ShardedEmbeddingBagCollection):
    """``ShardedEmbeddingBagCollection`` whose lookups build CowClip kernels for tagged tables."""

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        **kw: Any,
    ) -> None:
        object.__setattr__(self, "_cowclip_tables", cowclip_tables_by_sharding_type(module, table_name_to_parameter_sharding, fused_params))
        if SEBC_WRAPS_DP_IN_INIT:  # torchrec < 1.7 (sharding/compat.py): CowClip DP lookups stay unwrapped
            with ddp_wrap_skipping(is_cowclip_dp_lookup):
                super().__init__(module, table_name_to_parameter_sharding, env, fused_params, device, **kw)
            self.init_data_parallel()  # as torchrec 1.7+ calls it from __init__
        else:
            super().__init__(module, table_name_to_parameter_sharding, env, fused_params, device, **kw)
        # loading writes row_step in place: the catch-up kernels must derive their step again
        self.register_load_state_dict_post_hook(forget_dense_steps)

    def _create_lookups(self) -> None:
        for sharding in self._embedding_shardings:
            self._lookups.append(_lookup_for(sharding, self._cowclip_tables))

    def init_data_parallel(self) -> None:
        init_data_parallel(self, list(self._embedding_shardings), DpPooledEmbeddingSharding)


def init_data_parallel(module: Any, shardings: list[Any], dp_type: type) -> None:
    """A sharded EBC's / EC's ``init_data_parallel``: stock DDP-wraps data-parallel lookups;
    CowClip DP tables are merged by the exchange instead (their kernel has no autograd gradient
    for DDP to reduce). Replicas start from the same weights: broadcast from the group's first
    rank, as DDP's constructor would."""
    cowclip_dp = [
        (i, lk) for i, (s, lk) in enumerate(zip(shardings, module._lookups)) if isinstance(s, dp_type) and is_cowclip_dp_lookup(lk)
    ]
    for _, lk in cowclip_dp:
        others = [m for m in lk._emb_modules if not isinstance(m, CowClipKernel)]
        if others:
            raise NotImplementedError(
                f"CowClip sharder: data-parallel tables of one {type(module).__name__} must all be CowClip-Adam "
                f"or none (found {len(others)} other data-parallel kernel(s))"
            )
    keep = {i for i, _ in cowclip_dp}
    device = module._device
    for i, (s, lk) in enumerate(zip(shardings, module._lookups)):
        if not isinstance(s, dp_type) or i in keep or isinstance(lk, DistributedDataParallel):
            continue  # (torchrec < 1.7 wrapped the others already)
        # the stock wrap (torchrec's ShardedEmbeddingBagCollection / ShardedEmbeddingCollection.init_data_parallel)
        module._lookups[i] = DistributedDataParallel(
            module=lk,
            device_ids=[device] if device is not None and device.type in {"cuda", "mtia"} else None,
            process_group=module._env.process_group,
            gradient_as_bucket_view=True,
            broadcast_buffers=True,
            static_graph=True,
        )
    pg = module._env.process_group
    if pg is not None and dist.get_world_size(pg) > 1:
        src = dist.get_global_rank(pg, 0)
        for _, lk in cowclip_dp:
            for k in lk.cowclip_kernels():
                dist.broadcast(k.emb_module.weights, src=src, group=pg)


class CowClipEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Drop-in for ``EmbeddingBagCollectionSharder``: tagged tables train with CowClip-Adam.

    Takes ``EmbeddingBagCollectionSharder``'s arguments. ``fused_params`` are checked here: a key
    that is neither CowClip-Adam's (``cowclip_fused_params``; ``lr`` is ``learning_rate``) nor
    torchrec's/FBGEMM's is one line naming it, never a setting silently ignored."""

    trains_cowclip_adam = True  # what the planners' check_cowclip_sharders looks for

    def __init__(self, fused_params: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> None:
        check_fused_params(fused_params, "CowClipEmbeddingBagCollectionSharder")
        super().__init__(fused_params, *args, **kwargs)

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedCowClipEmbeddingBagCollection:
        return ShardedCowClipEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )

    @property
    def sharded_module_type(self) -> type[ShardedCowClipEmbeddingBagCollection]:  # type: ignore[override]
        return ShardedCowClipEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """Row-wise and table-row-wise run on CPU too (torchrec offers them on CUDA only)."""
        types = super().sharding_types(compute_device_type)
        for st in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
            if st not in types:
                types.append(st)
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return cowclip_compute_kernels(sharding_type, compute_device_type)


def cowclip_compute_kernels(sharding_type: str, compute_device_type: str) -> list[str]:
    """What the CowClip kernel supports (module docstring): ``fused``, plus ``fused_uvm`` on CUDA;
    ``dense`` for data-parallel. No UVM caching, no key-value kernels."""
    if sharding_type == _DP:
        return [EmbeddingComputeKernel.DENSE.value]
    if compute_device_type == "cuda":
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM.value]
    return [EmbeddingComputeKernel.FUSED.value]


def cowclip_tbes(model: nn.Module) -> list[CowClipAdamTBE]:
    """This rank's CowClip tables. torchrec 1.8 keeps a sharded module's lookups in a plain list
    (``_lookups``), out of ``modules()``, so look there."""
    out: list[CowClipAdamTBE] = []
    for m in model.modules():
        for lk in getattr(m, "_lookups", []) or []:
            lk = getattr(lk, "module", lk)  # DDP-wrapped data-parallel lookups
            out.extend(x for x in lk.modules() if isinstance(x, CowClipAdamTBE))
    return out


def take_update_stats(model: nn.Module) -> tuple[int, int]:
    """(rows updated, rows whose gradient CowClip scaled down) since the last call, summed over this
    rank's CowClip kernels; resets the counters. (0, 0) when the model has none."""
    unique = clipped = 0
    for m in cowclip_tbes(model):
        u, c = m.stats.take()
        unique, clipped = unique + u, clipped + c
    return unique, clipped
