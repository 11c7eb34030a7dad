"""The dense part of a step in micro-batches: one embedding update per global batch, same math.

Why: at large batches the dense tower's activations ([64K, 400] fp32 is 100 MB per layer) no
longer fit in the caches, and a 64K step ran slower per sample than an 8K step
(benchmarks/2026-11-22-train-throughput.md). Running everything after the embedding lookup (FM, DNN, cross layers, heads
and the loss) chunk by chunk keeps each chunk's activations small; gradients of the dense
parameters and of the pooled embeddings are summed over the chunks, so the step's gradients are
those of the whole batch (up to float summation order), the embedding lookup and its fused
update (FBGEMM / CowClip) still run once over the whole batch, and the dense optimizer steps once.

How: `ChunkedOverArch` is an autograd function. Its forward runs, per chunk, the over-arch's
forward and `torch.autograd.grad` of the chunk's share of the mean loss, keeping only the summed
gradients; its backward hands them to autograd (scaled by the incoming gradient of the loss), so
a stock `loss.backward()` -- TorchRec's train pipelines, DDP's gradient hooks inside DMP --
sees ordinary gradients on ordinary parameters and on the sparse arch's output.

A model takes part by splitting its forward in two (`SplitCTRModel`):
``sparse(dense, kjt) -> tuple[Tensor, ...]`` (the embedding lookups, whole batch) and
``over(dense, *sparse_out) -> logits`` (per-sample math only: no batch statistics), plus
``over_parameters()``. torch has no micro-batching for this case (``torch.utils.checkpoint``
recomputes, it does not cut the peak per chunk of a single backward), hence this module.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["SplitCTRModel", "ChunkedOverArch", "MicroBatchedLoss", "chunked_loss"]


@runtime_checkable
class SplitCTRModel(Protocol):
    """A CTR model whose forward is ``over(dense, *sparse(dense, kjt))``."""

    def sparse(self, dense: Tensor, sparse: object) -> tuple[Tensor, ...]: ...

    def over(self, dense: Tensor, *sparse_out: Tensor) -> Tensor: ...

    def over_parameters(self) -> Iterable[nn.Parameter]: ...


class ChunkedOverArch(torch.autograd.Function):
    """(mean BCE loss, logits) of ``over`` on rows [lo, lo + rows) at a time; see the module doc."""

    @staticmethod
    def forward(
        ctx,
        over: Callable[..., Tensor],
        n_params: int,
        rows: int,
        labels: Tensor,  # type: ignore[override]
        *tensors: Tensor,
    ) -> tuple[Tensor, Tensor]:
        params, inputs = tensors[:n_params], tensors[n_params:]
        batch = labels.shape[0]
        wants = [x.requires_grad for x in inputs]
        p_grads: list[Tensor | None] = [None] * n_params
        in_grads = [torch.zeros_like(x) if w else None for x, w in zip(inputs, wants)]
        loss_sum = torch.zeros((), dtype=torch.float32, device=labels.device)
        logits_out: Tensor | None = None
        with torch.enable_grad():
            for lo in range(0, batch, rows):
                hi = min(lo + rows, batch)
                chunk = [x[lo:hi].detach().requires_grad_(w) for x, w in zip(inputs, wants)]
                logits = over(*chunk)
                # this chunk's share of the batch mean: sum over the chunk / whole batch
                loss = F.binary_cross_entropy_with_logits(logits, labels[lo:hi].to(logits.dtype), reduction="sum") / batch
                wrt = list(params) + [c for c, w in zip(chunk, wants) if w]
                grads = torch.autograd.grad(loss, wrt, allow_unused=True) if wrt else ()
                for i, g in enumerate(grads[:n_params]):
                    if g is not None:
                        p_grads[i] = g if p_grads[i] is None else p_grads[i].add_(g)
                gi = iter(grads[n_params:])
                for acc, w in zip(in_grads, wants):
                    if w:
                        g = next(gi)
                        if g is not None:
                            acc[lo:hi] = g
                if logits_out is None:
                    logits_out = logits.new_empty((batch,) + tuple(logits.shape[1:]))
                logits_out[lo:hi] = logits.detach()
                loss_sum += loss.detach().float()
        ctx.p_grads, ctx.in_grads = p_grads, in_grads
        assert logits_out is not None  # batch > 0 (checked by chunked_loss)
        ctx.mark_non_differentiable(logits_out)
        return loss_sum, logits_out

    @staticmethod
    def backward(ctx, g_loss: Tensor, _g_logits: Tensor):  # type: ignore[override]
        p = [None if g is None else g * g_loss for g in ctx.p_grads]
        x = [None if g is None else g * g_loss for g in ctx.in_grads]
        ctx.p_grads = ctx.in_grads = None
        return (None, None, None, None, *p, *x)


def chunked_loss(
    over: Callable[..., Tensor], params: Iterable[nn.Parameter], dense: Tensor, sparse_out: tuple[Tensor, ...], labels: Tensor, rows: int
) -> tuple[Tensor, Tensor]:
    """(mean BCE loss, detached logits) of ``over(dense, *sparse_out)`` against ``labels``,
    computed ``rows`` samples at a time with the gradients of the whole batch (``params``: the
    parameters ``over`` uses)."""
    if rows <= 0:
        raise ValueError(f"micro-batch rows must be > 0, got {rows}")
    if labels.shape[0] == 0:
        raise ValueError("chunked_loss: empty batch")
    trained = [p for p in params if p.requires_grad]
    return ChunkedOverArch.apply(over, len(trained), rows, labels, *trained, dense, *sparse_out)


class MicroBatchedLoss(nn.Module):
    """The over-arch and the loss of a `SplitCTRModel`, in chunks of ``rows`` for a training
    batch larger than that (grad enabled), whole otherwise: -> (mean BCE loss, detached logits).

    It holds the model's ``over`` and ``over_parameters`` as plain callables, not the model as a
    submodule: it then contains no sharded module, so TorchRec's train pipelines, which fx-trace
    the model down to such modules, treat it as one leaf and never trace its control flow."""

    def __init__(self, model: SplitCTRModel, rows: int) -> None:
        super().__init__()
        if rows <= 0:
            raise ValueError(f"micro-batch rows must be > 0, got {rows}")
        self.rows = rows
        self.over = model.over
        self.over_parameters = model.over_parameters

    def forward(self, dense: Tensor, labels: Tensor, *sparse_out: Tensor) -> tuple[Tensor, Tensor]:
        if torch.is_grad_enabled() and labels.shape[0] > self.rows:
            return chunked_loss(self.over, self.over_parameters(), dense, sparse_out, labels, self.rows)
        logits = self.over(dense, *sparse_out)
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype)), logits.detach()
