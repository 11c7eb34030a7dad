"""CowClip-Adam for embedding tables, as plain torch ops: the math layer (and test oracle) for the
fused, sharded kernel of docs/design/cowclip.md.

CowClip (Zheng et al., arXiv 2204.06240; reference code bytedance/LargeBatchCTR ``clip.py`` and
``train.py``). Per table of N rows and dimension D, and per step:

1. Row gradients of a pooled-sum embedding bag (FBGEMM layout: 1-D ``indices``, ``offsets`` of
   length B+1, bag b = sample b, ``grad_output`` [B, D], optional per-index weights ``psw``)::

       g_k   = sum over occurrences i of k:  grad_output[bag(i)] * psw[i]
       cnt_k = number of distinct bags (samples) that contain k   (repeats in a bag count once)

2. L2 (``l2`` = lambda of a Keras ``l2(lambda)`` regulariser, i.e. the loss term
   ``lambda * sum ||w_k||^2``)::

       g_k <- g_k + 2 * lambda * w_k                                       (before clipping)

   Why before clipping and why ``2*lambda``: the reference builds the model with DeepCTR's
   ``Embedding(embeddings_regularizer=l2(args.l2))``, puts ``self.losses`` into the loss
   (``compiled_loss(..., regularization_losses=self.losses)``), takes ``tape.gradient`` of that
   total loss and only then calls ``clip_id_norm``. So the regulariser's gradient is part of the g
   that is clipped, and Keras' ``l2(l)`` is ``l * reduce_sum(square(w))`` whose gradient is
   ``2*l*w``. The regulariser is not divided by the batch size while the data loss is a batch
   mean (``SUM_OVER_BATCH_SIZE``): pass ``grad_output`` of a *mean* loss to match the reference's
   hyperparameters (l2 = 1e-5 at batch 1K).

3. Clip (skipped with ``clip=False``, the reference's choice for the dim-1 wide/linear tables)::

       zeta'  = r * sqrt(D) * zeta
       clip_k = r * cnt_k * max(||w_k||, zeta')
       g_k   <- g_k * clip_k / max(||g_k||, clip_k)        (||g_k|| = 0 leaves g_k = 0, no NaN)

4. Adam on g_k, with ``eps_mode="torch"`` (torch.optim.Adam)::

       m <- b1 m + (1-b1) g;   v <- b2 v + (1-b2) g^2
       w <- w - lr * (m / (1-b1^t)) / (sqrt(v) / sqrt(1-b2^t) + eps)

   or ``eps_mode="keras"`` (tf.keras Adam as used by the reference, eps=1e-7 there; also
   torch.optim.SparseAdam)::

       w <- w - lr * sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps)

Scopes (``update_scope``):

* ``"batch"`` (default; what the fused kernel does): lazy/sparse Adam. Only the U unique rows of
  the batch are read and written; every other row of weight, exp_avg, exp_avg_sq and row_step is
  left bit-identical. The bias-correction step t is, by default (``bias_correction="row"``), the
  row's own update count ``row_step[k]`` (incremented when k is in the batch). Reason: a lazy row's
  moments are an EMA over *its own* updates only, so ``1-b^row_step`` is the exact correction of
  that EMA's zero-initialisation bias; with the global step (TF LazyAdam, torch SparseAdam, FBGEMM
  ADAM) the first update of a row first seen late gets m/sqrt(v) = (1-b1)/sqrt(1-b2) ~ 3.2 instead
  of 1 (a 3x overshoot, on exactly the rare ids CowClip is about). ``bias_correction="global"``
  uses the table's call count ``step`` instead, for comparison with those.
* ``"all"``: the reference's dense semantics. The reference's L2 gradient is dense, so TF turns the
  embedding gradient into a dense tensor, ``clip_id_norm`` runs on every row (rows absent from the
  batch get ``cnt = 1``: ``tensor_scatter_nd_update(ones, ids, cnts)``) and Keras Adam updates every
  row with the global step: absent rows get their moments decayed, keep moving on their momentum
  and, with ``l2_scope="all"``, are decayed by L2. O(N*D) per step: for validation, not speed.
  Every row's ``row_step`` is incremented; the default bias correction is the global ``step``.

``l2_scope``: ``"batch"`` adds the L2 gradient to the batch's rows only (the lazy choice);
``"all"`` to every row (the reference; needs ``update_scope="all"``, since with lazy Adam no update
reaches the absent rows).

How this differs from FBGEMM's ``WeightDecayMode.COWCLIP`` (``CowClipDefinition``): FBGEMM
clips with ``c * max(coef*||w||, lower_bound)`` where ``c`` is a lifetime (optionally decayed)
count of *batches* in which the row appeared, not ``cnt_k`` in the current batch; it exists only
for EXACT_ROWWISE_ADAGRAD (not Adam) and its accumulator sees the unclipped gradient. Here the
count is per batch (distinct samples), the optimizer is Adam, and both Adam moments see the
clipped gradient, as in the paper.

All functions are device-agnostic tensor code (CPU or CUDA, no Python loop over rows). Host
synchronisations: ``torch.unique``'s output size and the id bounds check (one min/max).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "CowClipAdamState",
    "CowClipStats",
    "batch_row_gradients",
    "cowclip_threshold",
    "cowclip_clip",
    "cowclip_adam_step",
]

_UPDATE_SCOPES = ("batch", "all")
_L2_SCOPES = ("batch", "all")
_BIAS_CORRECTIONS = ("row", "global")
_EPS_MODES = ("torch", "keras")


def batch_row_gradients(
    indices: Tensor,
    offsets: Tensor,
    grad_output: Tensor,
    per_sample_weights: Tensor | None = None,
    num_rows: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Row gradients of one table's pooled-sum embedding bag, from its backward input.

    Returns ``(unique_rows [U] int64 sorted, row_grads [U, D] in grad_output's dtype,
    counts [U] int64)``; ``counts`` is the number of distinct bags (samples) containing the row,
    which is CowClip's ``cnt``, not the number of occurrences. With ``num_rows`` the ids are
    bounds-checked (one host sync), like FBGEMM's bounds check.
    """
    if indices.dim() != 1 or offsets.dim() != 1:
        raise ValueError("indices and offsets must be 1-D")
    if grad_output.dim() != 2:
        raise ValueError(f"grad_output must be [num_bags, D], got shape {tuple(grad_output.shape)}")
    num_bags = offsets.numel() - 1
    if num_bags != grad_output.shape[0]:
        raise ValueError(f"offsets has {num_bags} bags (+1 entries) but grad_output has {grad_output.shape[0]} rows")
    if per_sample_weights is not None and per_sample_weights.shape != indices.shape:
        raise ValueError("per_sample_weights must have one weight per index")
    indices = indices.long()
    offsets = offsets.long()
    dim = grad_output.shape[1]
    device = grad_output.device
    if indices.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, grad_output.new_zeros(0, dim), empty.clone()
    if num_rows is not None and bool((indices.min() < 0) | (indices.max() >= num_rows)):
        raise ValueError(f"embedding ids out of range [0, {num_rows})")

    # bag id of every occurrence (offsets -> lengths -> repeat); output_size avoids a sync
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.repeat_interleave(torch.arange(num_bags, device=device), lengths, output_size=indices.numel())
    rows, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    contrib = grad_output.index_select(0, bags)
    if per_sample_weights is not None:
        contrib = contrib * per_sample_weights.to(contrib.dtype).unsqueeze(1)
    row_grads = grad_output.new_zeros(rows.numel(), dim).index_add_(0, inverse, contrib)
    # distinct (row, bag) pairs -> samples per row: a sample counts once however often k repeats
    pairs = torch.unique(inverse * num_bags + bags)
    counts = torch.bincount(pairs // num_bags, minlength=rows.numel())
    return rows, row_grads, counts


def cowclip_threshold(weights_rows: Tensor, counts: Tensor, r: float = 1.0, zeta: float = 1e-5) -> Tensor:
    """Per-row clip value ``r * cnt * max(||w||, zeta')`` with ``zeta' = r * sqrt(D) * zeta``.

    The zeta' floor keeps freshly initialised (near-zero) rows from being frozen at zero.
    """
    dim = weights_rows.shape[-1]
    zeta_prime = r * math.sqrt(dim) * zeta
    wnorm = torch.linalg.vector_norm(weights_rows, dim=-1)
    return r * counts.to(weights_rows.dtype) * torch.clamp(wnorm, min=zeta_prime)


def _clip_scale(grads: Tensor, clip_t: Tensor) -> tuple[Tensor, Tensor]:
    """(scale [U], clipped mask [U]) for ``g * clip / max(||g||, clip)``. A zero denominator
    (||g|| = 0 and clip = 0) gives scale 1 (g stays zero) instead of 0/0."""
    gnorm = torch.linalg.vector_norm(grads, dim=-1)
    denom = torch.maximum(gnorm, clip_t)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scale = torch.where(denom > 0, clip_t / safe, torch.ones_like(denom))
    return scale, gnorm > clip_t


def cowclip_clip(row_grads: Tensor, weights_rows: Tensor, counts: Tensor, r: float = 1.0, zeta: float = 1e-5) -> Tensor:
    """CowClip: ``g * clip / max(||g||, clip)`` per row (a new tensor; inputs untouched)."""
    if row_grads.shape != weights_rows.shape:
        raise ValueError(f"row_grads {tuple(row_grads.shape)} and weights_rows {tuple(weights_rows.shape)} differ")
    clip_t = cowclip_threshold(weights_rows.to(row_grads.dtype), counts, r, zeta)
    scale, _ = _clip_scale(row_grads, clip_t)
    return row_grads * scale.unsqueeze(-1)


@dataclass
class CowClipAdamState:
    """Adam state of one table. ``row_step[k]``: Adam updates row k has received (the lazy
    bias-correction step); ``step``: calls of ``cowclip_adam_step`` on this table (0-dim int64,
    the global step of ``update_scope="all"``). Tensors, so they checkpoint like any state."""

    exp_avg: Tensor  # [N, D]
    exp_avg_sq: Tensor  # [N, D]
    row_step: Tensor  # [N] int64
    step: Tensor  # [] int64

    @classmethod
    def zeros_like(cls, weight: Tensor) -> "CowClipAdamState":
        n = weight.shape[0]
        return cls(
            exp_avg=torch.zeros_like(weight),
            exp_avg_sq=torch.zeros_like(weight),
            row_step=torch.zeros(n, dtype=torch.long, device=weight.device),
            step=torch.zeros((), dtype=torch.long, device=weight.device),
        )

    def state_dict(self) -> dict[str, Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "row_step": self.row_step, "step": self.step}


@dataclass
class CowClipStats:
    """Per-step numbers for logging. Tensors stay on the device (call ``.item()`` when logging)."""

    unique_rows: int  # rows of the batch (U)
    clipped_rows: Tensor  # [] int64: batch rows whose gradient was scaled down (||g|| > clip)
    clipped_fraction: Tensor  # [] float: clipped_rows / max(U, 1)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {'|'.join(choices)}, got {value!r}")


def _adam_rows(
    w: Tensor, m: Tensor, v: Tensor, g: Tensor, t: Tensor, lr: float, beta1: float, beta2: float, eps: float, eps_mode: str
) -> None:
    """In-place Adam on row blocks w, m, v [R, D] with gradient g and bias-correction step t
    (a 0-dim or [R] tensor, >= 1)."""
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    t = t.to(w.dtype)
    bc1 = 1 - torch.pow(beta1, t)
    bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, t))
    if t.dim() == 1:
        bc1, bc2_sqrt = bc1.unsqueeze(1), bc2_sqrt.unsqueeze(1)
    if eps_mode == "torch":
        w.sub_(lr * (m / bc1) / (v.sqrt() / bc2_sqrt + eps))
    else:
        w.sub_(lr * bc2_sqrt / bc1 * (m / (v.sqrt() + eps)))


def cowclip_adam_step(
    weight: Tensor,
    state: CowClipAdamState,
    indices: Tensor,
    offsets: Tensor,
    grad_output: Tensor,
    per_sample_weights: Tensor | None = None,
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    r: float = 1.0,
    zeta: float = 1e-5,
    l2: float = 0.0,
    clip: bool = True,
    update_scope: str = "batch",
    l2_scope: str = "batch",
    bias_correction: str | None = None,
    eps_mode: str = "torch",
) -> CowClipStats:
    """One CowClip-Adam step of one table, in place on ``weight`` [N, D] and ``state``.

    See the module docstring for the math. ``bias_correction`` defaults to ``"row"`` for
    ``update_scope="batch"`` and ``"global"`` for ``"all"``. With ``update_scope="batch"`` rows
    absent from the batch are not read or written (bit-identical).
    """
    _check_choice("update_scope", update_scope, _UPDATE_SCOPES)
    _check_choice("l2_scope", l2_scope, _L2_SCOPES)
    _check_choice("eps_mode", eps_mode, _EPS_MODES)
    if bias_correction is None:
        bias_correction = "row" if update_scope == "batch" else "global"
    _check_choice("bias_correction", bias_correction, _BIAS_CORRECTIONS)
    if update_scope == "batch" and l2_scope == "all":
        raise ValueError("l2_scope='all' needs update_scope='all' (lazy Adam never updates absent rows)")
    if weight.dim() != 2 or grad_output.dim() != 2 or grad_output.shape[1] != weight.shape[1]:
        raise ValueError(f"weight [N, D] and grad_output [B, D] disagree: {tuple(weight.shape)} vs {tuple(grad_output.shape)}")
    if state.exp_avg.shape != weight.shape or state.exp_avg_sq.shape != weight.shape:
        raise ValueError("optimizer state shape does not match weight")
    beta1, beta2 = betas
    num_rows = weight.shape[0]

    with torch.no_grad():
        rows, g, counts = batch_row_gradients(indices, offsets, grad_output, per_sample_weights, num_rows)
        g = g.to(weight.dtype)
        n_unique = rows.numel()
        state.step.add_(1)

        if update_scope == "batch":
            w = weight.index_select(0, rows)
            if l2:
                g = g + (2 * l2) * w
            clipped = torch.zeros(n_unique, dtype=torch.bool, device=weight.device)
            if clip:
                scale, clipped = _clip_scale(g, cowclip_threshold(w, counts, r, zeta))
                g = g * scale.unsqueeze(1)
            m = state.exp_avg.index_select(0, rows)
            v = state.exp_avg_sq.index_select(0, rows)
            row_step = state.row_step.index_select(0, rows) + 1
            t = row_step if bias_correction == "row" else state.step
            _adam_rows(w, m, v, g, t, lr, beta1, beta2, eps, eps_mode)
            weight.index_copy_(0, rows, w)
            state.exp_avg.index_copy_(0, rows, m)
            state.exp_avg_sq.index_copy_(0, rows, v)
            state.row_step.index_copy_(0, rows, row_step)
        else:
            # dense pass over the whole table, as the TF reference does
            g_full = torch.zeros_like(weight).index_copy_(0, rows, g)
            if l2:
                if l2_scope == "all":
                    g_full.add_(weight, alpha=2 * l2)
                else:
                    g_full.index_add_(0, rows, weight.index_select(0, rows), alpha=2 * l2)
            clipped = torch.zeros(n_unique, dtype=torch.bool, device=weight.device)
            if clip:
                cnt_full = torch.ones(num_rows, dtype=torch.long, device=weight.device).index_copy_(0, rows, counts)
                scale, clipped_full = _clip_scale(g_full, cowclip_threshold(weight, cnt_full, r, zeta))
                g_full.mul_(scale.unsqueeze(1))
                clipped = clipped_full.index_select(0, rows)
            state.row_step.add_(1)
            t = state.row_step if bias_correction == "row" else state.step
            _adam_rows(weight, state.exp_avg, state.exp_avg_sq, g_full, t, lr, beta1, beta2, eps, eps_mode)

        clipped_rows = clipped.sum()
        return CowClipStats(
            unique_rows=n_unique,
            clipped_rows=clipped_rows,
            clipped_fraction=clipped_rows.to(torch.float32) / max(n_unique, 1),
        )
