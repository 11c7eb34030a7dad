"""The torchrec embedding kernel of CowClip-Adam tables: ``CowClipEmbeddingBag`` (a
``BaseBatchedEmbeddingBag`` over ``CowClipAdamTBE``) and the fused optimizers torchrec's
``KeyedOptimizer`` sees (the update itself runs inside the backward)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag, EmbeddingFusedOptimizer
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule

from recsys.optim.cowclip.tbe import CowClipAdamTBE
from recsys.optim.cowclip.hyper import CowClipHyper

# the plan's compute kernel -> where CowClipAdamTBE keeps weights + state (fused_uvm: see state_location)


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
