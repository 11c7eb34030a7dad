"""CowClip-Adam for ``EmbeddingCollection`` tables (unpooled: sequence features, two-tower ids):
the sharder, the sharded module, its lookups and kernel.

    tag_cowclip_adam(ec.parameters(), lr=1e-4)
    sharders = [CowClipEmbeddingBagCollectionSharder(), CowClipEmbeddingCollectionSharder()]

It plugs in as the pooled sharder does (``recsys.optim.cowclip.sharder`` module docstring: the
tag, the in-backward update, the exchange of column-wise and data-parallel tables, checkpoint
layout): ``ShardedCowClipEmbeddingCollection`` overrides ``_create_lookups``, and the lookups
build ``CowClipEmbedding`` for tagged groups, a ``CowClipAdamTBE`` with ``PoolingMode.NONE``.

What "the per-row formula" means for unpooled ids: each id of the batch is a bag of one, so a
row's batch gradient is the sum of the gradients of its occurrences and its count is the number
of occurrences (what the paper's ``tf.unique`` over the batch's ids gives; the pooled formula
with every id its own bag). EmbeddingCollection's sharding types are table-wise, row-wise
(inline update), column-wise and data-parallel (exchange after backward).

Not supported, each a one-line error at sharding time: index deduplication
(``use_index_dedup=True``, or torchrec's global ``set_ec_index_dedup``): torchrec then looks each
id up once per batch and sums its occurrences' gradients before the kernel sees them, so the
kernel cannot count occurrences and CowClip's threshold would silently use count 1; a table read
by several features (the kernel's own limit, as for bags).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import Tensor
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.fused import FusedOptimizerModule

from recsys.optim.cowclip.exchange import ExchangeTable
from recsys.optim.cowclip.embedding_kernel import CowClipKernel
from recsys.optim.cowclip.lookups import CowClipLookup, ExchangeLookup
from recsys.optim.cowclip.sharder import (
    CowClipShardedModule,
    forget_dense_steps,
    is_cowclip_dp_lookup,
    cowclip_compute_kernels,
    cowclip_tables_by_sharding_type,
    init_data_parallel,
    module_tables,
)
from recsys.optim.cowclip.tables import is_cowclip, split_by_location, state_location
from recsys.optim.cowclip.hyper import COWCLIP_ADAM, check_fused_params
from sharding.compat import ddp_wrap_skipping

__all__ = ["CowClipEmbedding", "CowClipEmbeddingCollectionSharder", "ShardedCowClipEmbeddingCollection"]

_DP = ShardingType.DATA_PARALLEL.value


class CowClipEmbedding(CowClipKernel, BaseBatchedEmbedding[Tensor], FusedOptimizerModule):
    """torchrec embedding kernel (unpooled) over ``CowClipAdamTBE``; shaped like ``BatchedFusedEmbedding``."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        mode: str,
        replicated: bool,
        location: str = "device",
    ) -> None:
        BaseBatchedEmbedding.__init__(self, config, pg, device)
        self._build_cowclip(config, pg, device, mode, replicated, location, PoolingMode.NONE)


class CowClipGroupedEmbeddingsLookup(CowClipLookup, GroupedEmbeddingsLookup):
    """torchrec's sequence lookup that builds ``CowClipEmbedding`` for tagged groups."""

    def __init__(self, grouped_configs: list[GroupedEmbeddingConfig], *, cowclip_mode: str, **kw: Any) -> None:
        object.__setattr__(self, "_cowclip_mode", cowclip_mode)  # read by _create_embedding_kernel
        super().__init__(split_by_location(grouped_configs), **kw)

    def _create_embedding_kernel(self, config, pg, device, env=None):  # type: ignore[override]
        if not is_cowclip(config.fused_params):
            return super()._create_embedding_kernel(config, pg, device, env)
        return CowClipEmbedding(
            config, pg, device, mode=self.cowclip_update_mode, replicated=self._cowclip_mode == "dp", location=state_location(config)
        )


class CowClipSequenceExchangeLookup(ExchangeLookup, CowClipGroupedEmbeddingsLookup, FusedOptimizerModule):
    """The sequence ``ExchangeLookup`` (column-wise and data-parallel EC tables)."""


def _sequence_lookup_for(sharding: Any, cowclip_tables: dict[str, list[ExchangeTable]]) -> GroupedEmbeddingsLookup:
    """Mirrors the four torchrec ``create_lookup`` bodies (tw/rw/cw/dp_sequence_sharding.py)."""
    kw: dict[str, Any] = dict(device=sharding._device, env=sharding._env)
    if isinstance(sharding, DpSequenceEmbeddingSharding):
        pg = sharding._env.process_group
        return CowClipSequenceExchangeLookup(
            sharding._grouped_embedding_configs, pg=pg, cowclip_mode="dp", exchange_tables=cowclip_tables.get(_DP, []), exchange_pg=pg, **kw
        )
    if isinstance(sharding, CwSequenceEmbeddingSharding):
        return CowClipSequenceExchangeLookup(
            sharding._grouped_embedding_configs,
            pg=sharding._pg,
            cowclip_mode="cw",
            exchange_tables=list(cowclip_tables.get(ShardingType.COLUMN_WISE.value, [])),
            exchange_pg=sharding._pg,
            **kw,
        )
    if isinstance(sharding, (TwSequenceEmbeddingSharding, RwSequenceEmbeddingSharding)):
        return CowClipGroupedEmbeddingsLookup(sharding._grouped_embedding_configs, pg=sharding._pg, cowclip_mode="inline", **kw)
    raise NotImplementedError(f"CowClip EmbeddingCollection sharder: sharding {type(sharding).__name__} is not supported")


class ShardedCowClipEmbeddingCollection(CowClipShardedModule, ShardedEmbeddingCollection):
    """``ShardedEmbeddingCollection`` whose lookups build CowClip kernels for tagged tables."""

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        **kw: Any,
    ) -> None:
        tables = cowclip_tables_by_sharding_type(module, table_name_to_parameter_sharding, fused_params)
        object.__setattr__(self, "_cowclip_tables", tables)
        if tables:
            _refuse_index_dedup(bool(kw.get("use_index_dedup")), sorted(t.name for v in tables.values() for t in v))
        if not hasattr(ShardedEmbeddingCollection, "init_data_parallel"):
            # torchrec < 1.7 wraps data-parallel lookups inline in __init__ (sharding/compat.py)
            with ddp_wrap_skipping(is_cowclip_dp_lookup, "torchrec.distributed.embedding"):
                super().__init__(module, table_name_to_parameter_sharding, env, fused_params, device, **kw)
            self.init_data_parallel()
        else:
            super().__init__(module, table_name_to_parameter_sharding, env, fused_params, device, **kw)
        self.register_load_state_dict_post_hook(forget_dense_steps)

    @classmethod
    def create_grouped_sharding_infos(
        cls, module: Any, table_name_to_parameter_sharding: dict[str, ParameterSharding], fused_params: dict[str, Any] | None
    ) -> dict[str, list[Any]]:
        """torchrec's, keeping the CowClip tag. Unlike the EBC's, torchrec's EC version sets
        ``optimizer`` from the tag's optimizer class even where the tag names one, and does so in
        the parameter's own kwargs: the tables would go to FBGEMM as Adam (which rejects our
        keys), and the tag would be lost for the next sharding. Restore both."""
        tags = {}
        for cfg, w in module_tables(module):
            kwargs = (getattr(w, "_optimizer_kwargs", None) or [None])[0]
            if kwargs is not None and is_cowclip(kwargs):
                tags[cfg.name] = (kwargs, dict(kwargs))
        try:
            infos = super().create_grouped_sharding_infos(module, table_name_to_parameter_sharding, fused_params)
        finally:
            for kwargs, saved in tags.values():
                kwargs.clear()
                kwargs.update(saved)
        for per_type in infos.values():
            for info in per_type:
                if info.embedding_config.name in tags:
                    info.fused_params["optimizer"] = COWCLIP_ADAM
        return infos

    def _create_lookups(self) -> None:
        for sharding in self._sharding_type_to_sharding.values():
            if self.enable_embedding_update and sharding.enable_embedding_update:
                raise NotImplementedError(
                    "CowClip EmbeddingCollection sharder: tables with enable_embedding_update (written by the model) are not supported"
                )
            self._lookups.append(_sequence_lookup_for(sharding, self._cowclip_tables))

    def init_data_parallel(self) -> None:
        init_data_parallel(self, list(self._sharding_type_to_sharding.values()), DpSequenceEmbeddingSharding)


def _refuse_index_dedup(requested: bool, names: list[str]) -> None:
    from torchrec.distributed.embedding import get_ec_index_dedup

    if requested or get_ec_index_dedup():
        raise NotImplementedError(
            f"CowClip-Adam tables {', '.join(names)}: EmbeddingCollection index dedup (use_index_dedup / "
            "set_ec_index_dedup) hides how often an id occurs in the batch, which CowClip's clip threshold counts; "
            "turn it off"
        )


class CowClipEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """Drop-in for ``EmbeddingCollectionSharder``: tagged tables train with CowClip-Adam.

    Takes ``EmbeddingCollectionSharder``'s arguments; ``fused_params`` are checked as the pooled
    sharder checks them, and ``use_index_dedup=True`` is refused (module docstring)."""

    trains_cowclip_adam = True  # what the planners' check_cowclip_sharders looks for

    def __init__(
        self, fused_params: dict[str, Any] | None = None, qcomm_codecs_registry: Any = None, use_index_dedup: bool = False
    ) -> None:
        check_fused_params(fused_params, "CowClipEmbeddingCollectionSharder")
        if use_index_dedup:
            raise ValueError(
                "CowClipEmbeddingCollectionSharder: use_index_dedup=True hides how often an id occurs "
                "in the batch, which CowClip's clip threshold counts; leave it False"
            )
        super().__init__(fused_params, qcomm_codecs_registry, use_index_dedup)

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedCowClipEmbeddingCollection:
        return ShardedCowClipEmbeddingCollection(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
        )

    @property
    def sharded_module_type(self) -> type[ShardedCowClipEmbeddingCollection]:  # type: ignore[override]
        return ShardedCowClipEmbeddingCollection

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return cowclip_compute_kernels(sharding_type, compute_device_type)
