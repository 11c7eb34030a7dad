"""The catch-up half of ``CowClipAdamTBE`` (``update_scope="catchup"``, docs/cowclip.md): the
global step, bringing the rows a lookup reads (or every row, before a checkpoint) from their last
update to the current step, and the lazy update that follows. A mixin, so the TBE's storage and
per-batch update (tbe.py) read apart from the catch-up's bookkeeping."""

from __future__ import annotations


import torch
from torch import Tensor

from recsys.optim.cowclip.catchup import catch_up
from recsys.optim.cowclip.kernels.cpp_op import fused_catch_up_tables
from recsys.optim.cowclip.kernels.dispatch import catchup_backend, catchup_kwargs


class CatchUpMixin:
    """Methods of ``CowClipAdamTBE`` for ``update_scope="catchup"``; they read its tables,
    ``row_step`` and hyperparameters."""

    # ---- update_scope="catchup" (recsys/optim/cowclip/catchup.py) ------------------------------
    def dense_step(self, cache: bool = True) -> int:
        """Global step (updates done) of the catch-up mode; first derived from ``row_step``.
        ``cache=False`` derives it without keeping it: what a state_dict taken before a checkpoint
        is loaded in place (DCP's pattern) must use, or the fresh model's step 0 would stick."""
        if self._dense_step is not None:
            return self._dense_step
        step = int(self.row_step.max()) if self.row_step.numel() else 0
        if cache:
            self._dense_step = step
        return step

    def forget_dense_step(self) -> None:
        """The tables were loaded in place (a checkpoint): derive the global step from the loaded
        ``row_step`` again at the next use (the sharded EBC's load_state_dict post-hook calls this)."""
        self._dense_step = None

    def _resolve_catchup_op(self) -> None:
        """``catchup_op="auto"`` becomes what this device runs, on first use (loading the op may build it)."""
        if self.catchup_op == "auto":
            self.catchup_op = catchup_backend(self.weights.device)

    @torch.no_grad()
    def catch_up_lookup(self, indices: Tensor, offsets: Tensor) -> None:
        """Bring the rows a lookup reads to the current global step (before the forward reads them)."""
        if indices.numel() == 0:
            return
        step = self.dense_step()
        self._resolve_catchup_op()
        if self.catchup_op == "fused":  # find, read and advance each row once, in C++
            hp = self.hyper
            fused_catch_up_tables(
                self.weights,
                self.momentum1,
                self.momentum2,
                self.row_step,
                self._fused_feature_meta()[0],
                indices,
                offsets,
                step,
                **catchup_kwargs(hp, self.lr, self.catchup_growth),
            )
            return
        if self.catchup_op == "triton":  # the same in one launch, no host synchronisation
            from recsys.optim.cowclip.kernels.triton_catchup import triton_catch_up_lookup

            hp = self.hyper
            triton_catch_up_lookup(
                self.weights,
                self.momentum1,
                self.momentum2,
                self.row_step,
                self._device_feature_meta(),
                indices,
                offsets,
                step,
                max_dim=max(d for _, d in self.embedding_specs),
                **catchup_kwargs(hp, self.lr, self.catchup_growth),
            )
            return
        grows = self.global_rows(indices, offsets)
        behind = grows[self.row_step.index_select(0, grows) < step]
        if behind.numel():
            self._catch_up_rows(torch.unique(behind), step)

    @torch.no_grad()
    def catch_up_all(self, chunk_rows: int = 1 << 20) -> int:
        """Bring every row to the current global step (before a checkpoint, an export or a merge
        reads the tables; eval lookups catch up their own rows). Returns the rows advanced."""
        if self.hyper.update_scope != "catchup":
            return 0
        step, done = self.dense_step(cache=False), 0
        for lo in range(0, self.row_step.numel(), chunk_rows):
            rows = lo + torch.nonzero(self.row_step[lo : lo + chunk_rows] < step).flatten()
            if rows.numel():
                self._catch_up_rows(rows, step)
                done += rows.numel()
        return done

    def _fused_catch_up_rows(self, grows: Tensor, table: Tensor, starts: Tensor, step: int) -> None:
        """``_catch_up_rows`` by the C++ op the CPU lookups use: the rows, ascending, as one bag per
        table of a lookup over a table-by-table meta (why: the torch version took about 60 s per
        checkpoint of the raw Criteo tables on 2 ranks, most of a checkpoint's time; the op reads
        and writes each row once, without the torch version's gathers and per-block passes)."""
        hp = self.hyper
        T = len(self.embedding_specs)
        bounds = torch.searchsorted(table, torch.arange(T + 1))  # ascending rows: each table's stretch
        meta = torch.tensor(
            [[self.weights_physical_offsets[t], rows, dim, 0, self.row_starts[t], 0] for t, (rows, dim) in enumerate(self.embedding_specs)],
            dtype=torch.long,
        )
        advanced = fused_catch_up_tables(
            self.weights,
            self.momentum1,
            self.momentum2,
            self.row_step,
            meta,
            grows - starts[table],
            bounds,
            step,
            **catchup_kwargs(hp, self.lr, self.catchup_growth),
        )
        if int(advanced.sum()) != grows.numel():  # every row given is behind: each must move once
            raise RuntimeError(f"catch-up advanced {int(advanced.sum())} of {grows.numel()} rows behind step {step}")

    def _catch_up_rows(self, grows: Tensor, step: int) -> None:
        """Advance unique global rows ``grows`` (ascending, all behind ``step``) to ``step``: the C++
        op (``catchup_op="fused"``), one launch of the Triton kernel (``"triton"``), else the torch
        version grouped by dim."""
        hp = self.hyper
        dev = grows.device
        self._resolve_catchup_op()
        starts = torch.tensor(self.row_starts, dtype=torch.long, device=dev)
        table = torch.searchsorted(starts, grows, right=True) - 1
        if self.catchup_op == "fused":
            self._fused_catch_up_rows(grows, table, starts, step)
            return
        dims = torch.tensor([d for _, d in self.embedding_specs], dtype=torch.long, device=dev)
        phys = torch.tensor(self.weights_physical_offsets[: len(self.embedding_specs)], dtype=torch.long, device=dev)
        row_dim = dims[table]
        if self.catchup_op == "triton":
            from recsys.optim.cowclip.kernels.triton_catchup import triton_catch_up_rows

            triton_catch_up_rows(
                self.weights,
                self.momentum1,
                self.momentum2,
                self.row_step,
                phys[table] + (grows - starts[table]) * row_dim,
                grows,
                row_dim,
                step,
                max_dim=max(d for _, d in self.embedding_specs),
                **catchup_kwargs(hp, self.lr, self.catchup_growth),
            )
            return
        dim_set = sorted({d for _, d in self.embedding_specs})
        for dim in dim_set:
            if len(dim_set) == 1:
                g, t = grows, table
            else:
                mask = row_dim == dim
                g, t = grows[mask], table[mask]
                if g.numel() == 0:
                    continue
            rs = self.row_step.index_select(0, g)
            rs, order = torch.sort(rs, stable=True)  # longest gaps first: catch_up's prefixes
            g, t = g[order], t[order]
            bufs = (self.weights, self.momentum1, self.momentum2)
            if (
                len(dim_set) == 1
                and self.weights.numel() % dim == 0
                and all(o % dim == 0 for o in self.weights_physical_offsets[: len(self.embedding_specs)])
            ):  # whole rows
                pos = phys[t] // dim + (g - starts[t])
                bufs = tuple(x.view(-1, dim) for x in bufs)
                w, m, v = (x.index_select(0, pos) for x in bufs)
            else:  # element positions in the flat buffers
                pos = ((phys[t] + (g - starts[t]) * dim).unsqueeze(1) + torch.arange(dim, device=dev)).reshape(-1)
                w, m, v = (x.index_select(0, pos).view(-1, dim) for x in bufs)
            w, m, v = catch_up(
                w,
                m,
                v,
                rs,
                step,
                presorted=True,
                **catchup_kwargs(hp, self.lr, self.catchup_growth),
            )
            for x, new in zip(bufs, (w, m, v)):
                x.index_copy_(0, pos, new.reshape((-1,) + tuple(x.shape[1:])))
        self.row_step.index_fill_(0, grows, step)

    @torch.no_grad()
    def backward_update_catchup(self, grad_out: Tensor, indices: Tensor, offsets: Tensor, psw: Tensor | None) -> None:
        """The batch's rows, caught up to step S-1 by the forward, get the lazy kernel's update
        (L2 + clip with their count + Adam); its ``t = row_step + 1`` is then the global step S,
        as in the dense reference. No second catch-up here: between this lookup's forward and
        its backward the step does not move (an eval forward in between catches up to the same
        step)."""
        self._dense_step = self.dense_step() + 1
        self.backward_update(grad_out, indices, offsets, psw)
