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

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys.optim.cowclip.exchange import ExchangeTable
from recsys.optim.cowclip.tbe import CowClipAdamTBE
from recsys.optim.cowclip.hyper import check_fused_params
from sharding.compat import SEBC_WRAPS_DP_IN_INIT, ddp_wrap_skipping
from recsys.optim.cowclip.tables import _DP, is_cowclip
from recsys.optim.cowclip.embedding_kernel import CowClipKernel
from recsys.optim.cowclip.lookups import CowClipExchangeLookup, CowClipGroupedPooledEmbeddingsLookup, CowClipLookup, ExchangeLookup
from recsys.optim.cowclip.embedding_kernel import CowClipEmbeddingBag
from recsys.optim.cowclip.hyper import COWCLIP_ADAM
from recsys.optim.cowclip.tables import tag_cowclip_adam

# what a user of this module imports (the module docstring's example); the pieces live beside it
__all__ = [
    "COWCLIP_ADAM",
    "take_update_stats",
    "CowClipEmbeddingBag",
    "CowClipEmbeddingBagCollectionSharder",
    "ShardedCowClipEmbeddingBagCollection",
    "is_cowclip",
    "tag_cowclip_adam",
]


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
