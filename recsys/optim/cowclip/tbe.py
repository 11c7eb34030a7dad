"""Table-batched CowClip-Adam embedding bags: the storage, forward and in-backward update that
the sharded CowClip kernel (``recsys.optim.cowclip.sharder``) wraps.

Why a subclass of FBGEMM's ``DenseTableBatchedEmbeddingBagsCodegen``: it already lays out T
tables in one flat buffer (``weights``, ``weights_offsets``, ``D_offsets``) and has a CPU and
CUDA pooled forward; we reuse both. FBGEMM has no Adam on CPU and no paper CowClip at all, so
the backward is ours: the forward runs under ``no_grad`` inside an autograd Function whose
backward receives ``grad_output`` [B, total_D] and updates only the rows of the batch in place.
No weight gradient is ever materialised.

Two update modes, chosen by the sharding type (docs/design/cowclip.md section 3):

* ``inline`` (table-wise, row-wise, table-row-wise): the rank sees every sample that touches its
  rows, with full rows, so counts and norms are global already; the update runs in backward,
  with one call of the fused multi-table C++ op (``recsys.optim.cowclip.kernels.cpp_op``) per group.
* ``deferred`` (column-wise, data-parallel): backward only stages per-row gradients and counts;
  the cross-rank exchange (norms of column shards, union of replicas' rows) and the update run
  later in the same backward, in one autograd node of the lookup that runs after every kernel of
  it (``recsys.optim.cowclip.lookups.CowClipExchangeLookup``, ``recsys.optim.cowclip.exchange``).
  The lookup hands that node's output to the kernels as ``autograd_anchor``; staged rows still
  present at the next forward mean an update was missed, and the forward raises.

Where the state lives (``location``, docs/cowclip.md "CowClip tables in host memory"):

* ``device``: weights, both moments and ``row_step`` in the device's memory (HBM on CUDA; the
  plan's ``fused`` kernel);
* ``managed`` / ``host_mapped``: all four in host memory the GPU reads over PCIe/NVLink-C2C (the
  plan's ``fused_uvm`` kernel), allocated as FBGEMM allocates its own UVM tables
  (``torch.ops.fbgemm.new_unified_tensor``: ``cudaMallocManaged`` or ``cudaHostAlloc``-mapped).
  The forward (FBGEMM's dense CUDA lookup) and the update (Triton kernel, torch ops of the
  exchange) take them as ordinary CUDA tensors. On a CPU device FBGEMM's CPU build of the same
  op hands back plain host memory, so the CPU path is the same code with the same numbers.

There is no UVM-caching variant: FBGEMM's cache keeps hot *weight* rows in HBM, filled and
evicted by its own prefetch and written by its own backward; an update that writes the host row
behind it leaves the cached copy stale, and the optimizer state (2x the weights + 8 B a row)
would stay uncached anyway.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torch import Tensor

from recsys.optim.cowclip.reference import CowClipAdamState, _adam_rows, _clip_scale, batch_row_gradients
from recsys.optim.cowclip.catchup import DEFAULT_GROWTH, check_catchup_hyper
from recsys.optim.cowclip.kernels.cpp_op import advise_huge_pages
from recsys.optim.cowclip.hyper import FUSED_PARAM_KEYS, CowClipHyper
from recsys.optim.cowclip.staging import StagedRows, UpdateStats, mean_pooling_weights, unpooled_as_bags
from recsys.optim.cowclip.tbe_catchup import CatchUpMixin
from recsys.optim.cowclip.kernels.dispatch import table_update_op, tables_update_op, update_kwargs

HUGE_PAGE_MIN_BYTES = 64 << 20  # tables smaller than this stay on whatever pages they got
# where weights + optimizer state live; the values the sharder maps the plan's kernels to
STATE_LOCATIONS = ("device", "managed", "host_mapped")


def unified_zeros(numel: int, dtype: torch.dtype, device: torch.device, host_mapped: bool) -> Tensor:
    """A zero-filled 1-D tensor in unified (host) memory, allocated exactly as FBGEMM's
    ``apply_split_helper`` allocates a ``MANAGED`` table: ``new_unified_tensor`` (managed memory,
    or pinned host memory mapped into the device with ``host_mapped``), then ``zeros(out=)``.
    On CUDA the result is a CUDA tensor backed by host memory; FBGEMM's CPU build returns an
    empty CPU tensor that ``zeros(out=)`` grows, i.e. ordinary host memory."""
    proto = torch.zeros(1, device=device, dtype=dtype)
    try:
        unified = torch.ops.fbgemm.new_unified_tensor(proto, [numel], is_host_mapped=host_mapped)
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"CowClip-Adam UVM table: this fbgemm_gpu cannot allocate unified memory on {device} ({first[:160]})") from None
    return torch.zeros(numel, device=device, dtype=dtype, out=unified)


class _CowClipLookup(torch.autograd.Function):
    """Pooled forward with FBGEMM; backward = CowClip-Adam row update, no gradient returned."""

    @staticmethod
    def forward(ctx, anchor: Tensor, tbe: "CowClipAdamTBE", indices: Tensor, offsets: Tensor, psw: Tensor | None) -> Tensor:
        ctx.tbe = tbe
        ctx.anchor_meta = (anchor.shape, anchor.dtype, anchor.device)
        ctx.save_for_backward(indices, offsets, psw if psw is not None else indices.new_empty(0, dtype=torch.float))
        ctx.has_psw = psw is not None
        with torch.no_grad():
            return tbe.lookup(indices, offsets, psw)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        indices, offsets, psw = ctx.saved_tensors
        w = psw if ctx.has_psw else None
        if ctx.tbe.pooling_mode == PoolingMode.NONE:
            grad_out, offsets = unpooled_as_bags(grad_out, offsets, len(ctx.tbe.feature_table_map))
        elif ctx.tbe.pooling_mode == PoolingMode.MEAN:
            # a bag's mean is its sum with every id weighted 1/len(bag): the same row gradients as a
            # weighted SUM bag, so every kernel (they all take per-sample weights) serves MEAN too
            w = mean_pooling_weights(offsets, indices.numel(), w)
        update = {"all": ctx.tbe.backward_update_all_rows, "catchup": ctx.tbe.backward_update_catchup}.get(
            ctx.tbe.hyper.update_scope, ctx.tbe.backward_update
        )
        update(grad_out, indices, offsets, w)
        shape, dtype, device = ctx.anchor_meta
        # an (empty) gradient for the anchor: the node that produced it (the exchange) waits for it
        return torch.zeros(shape, dtype=dtype, device=device), None, None, None, None


class CowClipAdamTBE(CatchUpMixin, DenseTableBatchedEmbeddingBagsCodegen):
    """T local table (shards) in one flat buffer, with Adam moments of the same layout and a
    per-row update counter (lazy Adam's bias-correction step, see ``recsys.optim.cowclip.reference``).

    ``full_dims[t]``: the table's full embedding dim (zeta' uses it; a column shard holds fewer).
    ``clip[t]``: whether table t is clipped. ``mode``: ``inline`` or ``deferred`` (module doc).
    ``location``: ``device``, ``managed`` or ``host_mapped`` (module doc, "Where the state lives").
    """

    def __init__(
        self,
        embedding_specs: list[tuple[int, int]],
        feature_table_map: list[int],
        hyper: CowClipHyper,
        full_dims: list[int],
        mode: str,
        pooling_mode: PoolingMode = PoolingMode.SUM,
        device: torch.device | None = None,
        tables_op: Callable[..., Tensor] | None | str = "auto",
        location: str = "device",
        catchup_growth: float = DEFAULT_GROWTH,
        catchup_op: str = "auto",
    ) -> None:
        """``tables_op``: the multi-table update op for inline mode; ``"auto"`` picks it by device
        on first use (the C++ op on CPU, the Triton kernel on CUDA: ``kernels/dispatch.py``),
        ``None`` forces the per-table path. ``catchup_growth``: block growth of the catch-up
        (``update_scope="catchup"``; the default 2: about log2(gap) + 1 blocks; 1: the exact
        step-by-step iteration).
        ``catchup_op``: how a lookup catches its rows up: ``fused`` (the C++ op, CPU), ``triton``
        (recsys/optim/cowclip/kernels/triton_catchup.py: CUDA, or CPU under ``TRITON_INTERPRET=1``), ``torch``
        (recsys/optim/cowclip/catchup.py, any device), ``auto`` (fused on CPU, triton on CUDA, where
        they can run; else torch)."""
        device = torch.device(device or "cpu")
        if location not in STATE_LOCATIONS:
            raise ValueError(f"CowClip-Adam kernel: location must be {'|'.join(STATE_LOCATIONS)}, got {location!r}")
        if pooling_mode not in (PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE):
            raise NotImplementedError(f"CowClip-Adam kernel: pooling SUM, MEAN or NONE, got {pooling_mode}")
        if pooling_mode == PoolingMode.NONE and len({d for _, d in embedding_specs}) > 1:
            raise NotImplementedError(
                "CowClip-Adam kernel: unpooled tables of one kernel share one dim "
                f"(FBGEMM's unpooled output is [ids, D]), got {[d for _, d in embedding_specs]}"
            )
        if mode not in ("inline", "deferred"):
            raise ValueError(f"mode must be inline|deferred, got {mode!r}")
        if len(set(feature_table_map)) != len(feature_table_map):
            raise NotImplementedError("CowClip-Adam kernel: a table read by several features is not supported")
        unified = location != "device"
        # a UVM table is one that does not fit the device: FBGEMM's constructor draws the initial
        # weights where it computes, so draw them in host memory and move only the small buffers
        super().__init__(
            embedding_specs,
            feature_table_map,
            weights_precision=SparseType.FP32,
            pooling_mode=pooling_mode,
            use_cpu=device.type == "cpu" or unified,
        )
        # our weights are updated in place by the optimizer, never by autograd: a buffer, not a Parameter
        w = self.weights.detach()
        del self.weights
        if device.type != "cpu":
            self.to(device)  # offsets and the like (and, on the device, the weights: below)
            self.current_device = device
            self.use_cpu = False
        total_rows = sum(r for r, _ in embedding_specs)
        if unified:
            host_mapped = location == "host_mapped"
            state = [unified_zeros(w.numel(), w.dtype, device, host_mapped) for _ in range(3)]
            state[0].copy_(w)
            del w
            state.append(unified_zeros(total_rows, torch.long, device, host_mapped))
        else:
            w = w.to(device)
            state = [w, torch.zeros_like(w), torch.zeros_like(w), torch.zeros(total_rows, dtype=torch.long, device=device)]
        for name, t in zip(("weights", "momentum1", "momentum2", "row_step"), state):
            self.register_buffer(name, t)
        self.location = location
        w = self.weights
        if w.device.type == "cpu" and w.numel() * 4 >= HUGE_PAGE_MIN_BYTES:
            # lazy Adam touches 4 random rows per id (w, m, v, row_step): 2 MB pages save the page
            # walks (benchmarks/2026-11-22-cowclip-kernel.md: 20.8 -> 13.7 ms at 26 x 1M rows, batch 8K)
            advise_huge_pages([self.weights, self.momentum1, self.momentum2, self.row_step])
        self.hyper = hyper
        self.lr = float(hyper.learning_rate)
        self.full_dims = list(full_dims)
        self.clip = [hyper.cowclip] * len(embedding_specs)
        self.mode = mode
        self.feature_table_map = list(feature_table_map)
        self.feature_of_table = {t: f for f, t in enumerate(feature_table_map)}
        row_starts = [0]
        for r, _ in embedding_specs:
            row_starts.append(row_starts[-1] + r)
        self.row_starts = row_starts
        self.staged: list[StagedRows] = []
        # set by the owning lookup around a training forward (deferred mode): the autograd input
        # of the kernel, produced by the node that runs the exchange after this kernel's backward
        self.autograd_anchor: Tensor | None = None
        self.table_names: list[str] = []  # for error messages; set by the sharded kernel
        self.stats = UpdateStats()
        self._tables_op = tables_op
        self._states = [self._state_views(t) for t in range(len(embedding_specs))]
        # update_scope="catchup": the global step (completed updates); None = not known yet, then
        # max(row_step) (a checkpoint taken after catch_up_all has every row at it)
        self._dense_step: int | None = None
        self.catchup_growth = float(catchup_growth)
        if catchup_op not in ("auto", "fused", "triton", "torch"):
            raise ValueError(f"catchup_op must be auto|fused|triton|torch, got {catchup_op!r}")
        self.catchup_op = catchup_op
        if hyper.update_scope == "catchup":
            # deferred mode (column-wise, data-parallel) too: an absent row's catch-up is per
            # coordinate (no norm, no clip), so each column shard or replica advances its own part
            check_catchup_hyper(hyper.l2, hyper.cowclip_r, hyper.cowclip)

    # ---- views -------------------------------------------------------------------------------
    def _view(self, flat: Tensor, t: int) -> Tensor:
        rows, dim = self.embedding_specs[t]
        off = self.weights_physical_offsets[t]
        return flat[off : off + rows * dim].view(rows, dim)

    def _state_views(self, t: int) -> CowClipAdamState:
        return CowClipAdamState(
            exp_avg=self._view(self.momentum1, t),
            exp_avg_sq=self._view(self.momentum2, t),
            row_step=self.row_step[self.row_starts[t] : self.row_starts[t + 1]],
            step=torch.zeros((), dtype=torch.long, device=self.weights.device),
        )

    def split_embedding_weights(self) -> list[Tensor]:
        return [self._view(self.weights, t) for t in range(len(self.embedding_specs))]

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        """Per table, in the order torchrec's ``EmbeddingFusedOptimizer`` checkpoints: the first key
        becomes ``<table>.momentum1``, the others keep their names."""
        return [{"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "row_step": s.row_step} for s in self._states]

    # ---- the API torchrec's EmbeddingFusedOptimizer calls --------------------------------------
    def get_learning_rate(self) -> float:
        return self.lr

    def set_learning_rate(self, lr: float) -> None:
        self.lr = float(lr)

    def set_optimizer_step(self, step: int) -> None:
        """Lazy mode: nothing to set, bias correction uses each row's own ``row_step`` (checkpointed).
        ``update_scope="catchup"``: the global step the rows are caught up to (the training loop calls
        this on resume with the checkpoint's step)."""
        if self.hyper.update_scope == "catchup":
            self._dense_step = int(step)

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        kw = {k: v for k, v in params_dict.items() if k in FUSED_PARAM_KEYS and k != "optimizer"}
        if "lr" in params_dict:
            kw["learning_rate"] = params_dict["lr"]
        self.hyper = CowClipHyper(**{**self.hyper.__dict__, **kw})
        self.lr = float(self.hyper.learning_rate)

    # ---- forward / backward --------------------------------------------------------------------
    def forward(  # type: ignore[override]
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        feature_requires_grad: Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
    ) -> Tensor:
        if batch_size_per_feature_per_rank is not None:
            raise NotImplementedError("CowClip-Adam kernel: variable batch size per feature (VBE) is not supported")
        if self.staged:
            names = sorted({self.table_names[s.table] if s.table < len(self.table_names) else f"#{s.table}" for s in self.staged})
            raise RuntimeError(
                f"CowClip-Adam tables {names}: the previous backward staged rows whose column-wise/data-parallel "
                "update never ran (no exchange after backward); refusing to read stale weights"
            )
        offsets = offsets.to(indices.dtype)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.detach().float()
        if self.hyper.update_scope == "catchup":  # the lookup reads rows as the dense steps left them
            self.catch_up_lookup(indices, offsets)
        if not torch.is_grad_enabled():
            return self.lookup(indices, offsets, per_sample_weights)
        anchor = self.autograd_anchor
        if anchor is None:
            anchor = torch.empty(0, device=self.weights.device, requires_grad=True)
        return _CowClipLookup.apply(anchor, self, indices, offsets, per_sample_weights)

    def lookup(self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None) -> Tensor:
        """The forward without autograd: FBGEMM's pooled lookup; unpooled, the rows themselves
        ([ids, D]: FBGEMM's dense CPU op pools whatever its pooling mode says, so gather here)."""
        if self.pooling_mode != PoolingMode.NONE:
            return DenseTableBatchedEmbeddingBagsCodegen.forward(self, indices, offsets, per_sample_weights)
        if per_sample_weights is not None:
            raise NotImplementedError("CowClip-Adam kernel: unpooled lookups take no per-sample weights")
        D = self.embedding_specs[0][1]
        return self.weights.view(-1, D).index_select(0, self.global_rows(indices, offsets))

    def global_rows(self, indices: Tensor, offsets: Tensor) -> Tensor:
        """Each id's row in the flat buffer's row numbering (``row_starts`` of its feature's table)."""
        F = len(self.feature_table_map)
        B = (offsets.numel() - 1) // F
        bounds = offsets[::B] if B > 0 else offsets.new_zeros(F + 1)
        starts = torch.tensor([self.row_starts[t] for t in self.feature_table_map], dtype=torch.long, device=indices.device)
        per_feature = (bounds[1:] - bounds[:-1]).long()
        return indices.long() + torch.repeat_interleave(starts, per_feature, output_size=indices.numel())

    def _feature_slices(self, grad_out: Tensor, indices: Tensor, offsets: Tensor, psw: Tensor | None):
        """Per local table t: (t, indices, offsets from 0, grad_output [B, D_t], psw) of its feature."""
        F = len(self.feature_table_map)
        B = (offsets.numel() - 1) // F
        if B * F + 1 != offsets.numel() or grad_out.shape[0] != B:
            raise RuntimeError(f"CowClip backward: {offsets.numel()} offsets for {F} features and {grad_out.shape[0]} bags")
        D_offsets = self.D_offsets.tolist()
        bounds = offsets[::B].tolist() if B > 0 else [0] * (F + 1)
        for t in range(len(self.embedding_specs)):
            f = self.feature_of_table[t]
            lo, hi = int(bounds[f]), int(bounds[f + 1])
            idx = indices[lo:hi]
            offs = offsets[f * B : (f + 1) * B + 1] - lo
            go = grad_out[:, D_offsets[f] : D_offsets[f + 1]]
            yield t, idx, offs, go, (psw[lo:hi] if psw is not None else None)

    def _fused_feature_meta(self) -> tuple[Tensor, Tensor]:
        """The fused ops' per-feature table description (``FEATURE_META_COLUMNS``) and zeta,
        rebuilt only when what it depends on changes."""
        key = (self.hyper.cowclip_zeta, tuple(self.clip), tuple(self.full_dims))
        cached = getattr(self, "_fused_meta", None)
        if cached is None or cached[0] != key:
            D_offsets = self.D_offsets.tolist()
            meta = torch.tensor(
                [
                    [
                        self.weights_physical_offsets[t],
                        self.embedding_specs[t][0],
                        self.embedding_specs[t][1],
                        D_offsets[f],
                        self.row_starts[t],
                        int(bool(self.clip[t])),
                    ]
                    for f, t in enumerate(self.feature_table_map)
                ],
                dtype=torch.long,
            )
            zeta = torch.tensor([self._zeta_for_full_dim(t) for t in self.feature_table_map], dtype=torch.float64)
            cached = self._fused_meta = (key, meta, zeta)
        return cached[1], cached[2]

    def _device_feature_meta(self) -> Tensor:
        """``_fused_feature_meta``'s table on the weights' device, copied once per change of it (the
        Triton catch-up reads it there every lookup)."""
        meta = self._fused_feature_meta()[0]
        cached = getattr(self, "_device_meta", None)
        if cached is None or cached[0] is not meta:
            cached = self._device_meta = (meta, meta.to(self.weights.device))
        return cached[1]

    @torch.no_grad()
    def backward_update(self, grad_out: Tensor, indices: Tensor, offsets: Tensor, psw: Tensor | None) -> None:
        """Inline mode: one call of the multi-table op for all tables (``tables_op``: C++ on CPU, Triton on CUDA),
        else one ``fused_cowclip_adam_step`` per table. Deferred mode: stage per-table row
        gradients and counts for the exchange."""
        grad_out = grad_out.float()
        if self._tables_op == "auto":  # resolved on first use: loading the op may build it
            self._tables_op = tables_update_op(self.weights.device)
        update = self._tables_op if self.mode == "inline" else None
        if update is not None:
            F = len(self.feature_table_map)
            B = (offsets.numel() - 1) // F
            if B * F + 1 != offsets.numel() or grad_out.shape[0] != B:
                raise RuntimeError(f"CowClip backward: {offsets.numel()} offsets for {F} features and {grad_out.shape[0]} bags")
            hp = self.hyper
            meta, zeta = self._fused_feature_meta()
            stats = update(
                self.weights,
                self.momentum1,
                self.momentum2,
                self.row_step,
                meta,
                zeta,
                indices,
                offsets,
                grad_out,
                psw,
                **update_kwargs(hp, self.lr),
            )
            self.stats.add_counts(stats)
            return
        for t, idx, offs, go, w in self._feature_slices(grad_out, indices, offsets, psw):
            if self.mode == "inline":
                st = table_update_op(self.weights.device)(
                    self._view(self.weights, t),
                    self._states[t],
                    idx,
                    offs,
                    go.contiguous(),
                    w,
                    zeta=self._zeta_for_full_dim(t),
                    clip=self.clip[t],
                    **update_kwargs(self.hyper, self.lr),
                )
                self.stats.add(st.unique_rows, int(st.clipped_rows))
            else:
                rows_local = self.embedding_specs[t][0]
                rows, g, cnt = batch_row_gradients(idx, offs, go, w, num_rows=rows_local)
                self.staged.append(StagedRows(t, rows, g, cnt))

    @torch.no_grad()
    def backward_update_all_rows(self, grad_out: Tensor, indices: Tensor, offsets: Tensor, psw: Tensor | None) -> None:
        """``update_scope="all"``: the reference's dense step, every row every step, as a few in-place
        passes over the shard instead of the reference's full-table gradient.

        A row absent from the batch has g = 2*l2*w and cnt = 1; its clip r*max(||w||, zeta') is
        above ||g|| = 2*l2*||w|| whenever 2*l2 < r, so it is never clipped and its Adam step is the
        closed form below. Rows of the batch get the batch update (clip with cnt, Adam) from
        their values before that pass. All rows share the step (every row moves every step)."""
        if self.mode != "inline":
            raise NotImplementedError("CowClip update_scope='all' needs table-wise or row-wise sharding")
        hp = self.hyper
        if 2 * hp.l2 >= hp.cowclip_r:
            raise ValueError(f"CowClip update_scope='all' assumes 2*l2 < cowclip_r (l2={hp.l2}, r={hp.cowclip_r})")
        b1, b2 = hp.beta1, hp.beta2
        for t, idx, offs, go, w_psw in self._feature_slices(grad_out.float(), indices, offsets, psw):
            weight, st = self._view(self.weights, t), self._states[t]
            if weight.shape[0] == 0:
                continue
            rows, g, cnt = batch_row_gradients(idx, offs, go.contiguous(), w_psw, num_rows=weight.shape[0])
            saved = [x.index_select(0, rows) for x in (weight, st.exp_avg, st.exp_avg_sq)]
            step = int(st.row_step[0]) + 1
            m, v = st.exp_avg, st.exp_avg_sq
            m.mul_(b1)
            v.mul_(b2)
            if hp.l2:
                m.add_(weight, alpha=(1 - b1) * 2 * hp.l2)
                v.addcmul_(weight, weight, value=(1 - b2) * 4 * hp.l2 * hp.l2)
            bc1, bc2 = 1 - b1**step, 1 - b2**step
            if hp.eps_mode == "keras":
                weight.addcdiv_(m, v.sqrt().add_(hp.eps), value=-self.lr * math.sqrt(bc2) / bc1)
            else:
                weight.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(hp.eps), value=-self.lr / bc1)
            st.row_step.fill_(step)
            # the batch rows: back to their values before this step, then the real update
            for x, old in zip((weight, m, v), saved):
                x.index_copy_(0, rows, old)
            st.row_step.index_fill_(0, rows, step - 1)
            self.apply_rows(t, rows, g, cnt, add_l2=True)

    def _zeta_for_full_dim(self, t: int) -> float:
        """The fused op computes zeta' = r * sqrt(local D) * zeta; a table-wise/row-wise shard has
        the full D, so this is zeta unchanged (kept explicit for column shards' sake)."""
        local_d = self.embedding_specs[t][1]
        return self.hyper.cowclip_zeta * math.sqrt(self.full_dims[t] / local_d)

    # ---- the update half, used by the exchange -------------------------------------------------
    @torch.no_grad()
    def apply_rows(
        self, t: int, rows: Tensor, g: Tensor, counts: Tensor, wsq: Tensor | None = None, gsq: Tensor | None = None, add_l2: bool = True
    ) -> None:
        """Clip (with full-row squared norms ``wsq``/``gsq`` when given, else this shard's) and
        apply Adam to ``rows`` of local table t. ``g`` must already hold the L2 term when
        ``add_l2`` is False (column shards add it before their partial norms)."""
        if rows.numel() == 0:
            return
        hp = self.hyper
        st = self._states[t]
        if hp.update_scope == "catchup":
            # a data-parallel replica updates rows other ranks' samples touched, which its own
            # lookup did not catch up: bring them to the step before this update first (column
            # shards saw the global ids, so for them this finds nothing behind)
            prev = self.dense_step() - 1
            behind = rows[st.row_step.index_select(0, rows) < prev]
            if behind.numel():
                self._catch_up_rows(torch.unique(behind) + self.row_starts[t], prev)
        weight = self._view(self.weights, t)
        w = weight.index_select(0, rows)
        g = g.to(w.dtype)
        if add_l2 and hp.l2:
            g = g + (2 * hp.l2) * w
        n_clipped = 0
        if self.clip[t]:
            wnorm = torch.sqrt(wsq) if wsq is not None else torch.linalg.vector_norm(w, dim=-1)
            zeta_p = hp.cowclip_r * math.sqrt(self.full_dims[t]) * hp.cowclip_zeta
            clip_t = hp.cowclip_r * counts.to(w.dtype) * torch.clamp(wnorm, min=zeta_p)
            if gsq is not None:
                gnorm = torch.sqrt(gsq)
                denom = torch.maximum(gnorm, clip_t)
                safe = torch.where(denom > 0, denom, torch.ones_like(denom))
                scale = torch.where(denom > 0, clip_t / safe, torch.ones_like(denom))
                clipped = gnorm > clip_t
            else:
                scale, clipped = _clip_scale(g, clip_t)
            g = g * scale.unsqueeze(1)
            n_clipped = int(clipped.sum())
        m = st.exp_avg.index_select(0, rows)
        v = st.exp_avg_sq.index_select(0, rows)
        row_step = st.row_step.index_select(0, rows) + 1
        _adam_rows(w, m, v, g, row_step, self.lr, hp.beta1, hp.beta2, hp.eps, hp.eps_mode)
        weight.index_copy_(0, rows, w)
        st.exp_avg.index_copy_(0, rows, m)
        st.exp_avg_sq.index_copy_(0, rows, v)
        st.row_step.index_copy_(0, rows, row_step)
        self.stats.add(rows.numel(), n_clipped)

    def take_staged(self) -> list[StagedRows]:
        out, self.staged = self.staged, []
        return out
