"""Grouped lookups over CowClip kernels: the pooled lookup for sharding types whose update runs
inline, and the exchange lookup (column-wise, data-parallel) whose one autograd node runs the
cross-rank exchange and update after every kernel's backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule

from recsys.optim.cowclip.exchange import ExchangeTable, column_wise_step, data_parallel_step
from recsys.optim.cowclip.tables import is_cowclip, split_by_location, state_location
from recsys.optim.cowclip.embedding_kernel import CowClipEmbeddingBag, CowClipKernel

# the plan's compute kernel -> where CowClipAdamTBE keeps weights + state (fused_uvm: see state_location)


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
