"""The catch-up of rows behind the global step as a Triton kernel: the CUDA twin of the C++ op
``torch.ops.recsys.cowclip_catch_up_tables_`` (``update_scope="catchup"``).

``recsys/optim/cowclip/catchup.py`` has the math (the block scheme and its measured error bound)
and the torch version, which CUDA runs used before this kernel: on an H200, 26 tables of 1.3M rows
(the raw Criteo total), batch 8K, it cost 22x the lazy Triton update per step, a few hundred
small torch ops per lookup; with this kernel catch-up plus update cost 1.7x (benchmarks/2026-11-26-triton-gpu.md,
"Triton kernels on a GPU"; measured with the block formula this kernel had before the frozen-step
matrix power and the predicted w path, which have not run on a GPU yet). One program advances
one row: it reads the row's w, m, v and ``row_step`` once, walks the row's schedule (blocks of
1, 2, 4, ... steps, ``growth``, each cut to ``catchup.bias_cap`` early in training), gets each
piece's scalar factors in float64 (those that depend on the block size alone from a table built
once on the host, as the C++ op's per-piece constants; the bias
corrections from ``b^t0``, carried from piece to piece; a cut or capped piece computes all of
them), applies the piece to the row's columns (G in float32, the block's matrix power and the
new w and m in float64: the same formulas as the C++ op's ``advance_piece``), and writes w, m, v
and ``row_step = step`` back.

Two entry points share that row body (``_advance_row``):

* ``triton_catch_up_lookup``: what a lookup runs (``CowClipAdamTBE.catch_up_lookup``). It takes the
  KJT's ids as they are (repeats included), 32 per program: a program claims each row behind
  among its ids with an atomic max on the row's ``row_step`` (one id per row wins) and advances
  the rows it won. One launch, no host synchronisation.
* ``triton_catch_up_rows``: the caller passes distinct rows (``catch_up_all`` before a checkpoint,
  the column-wise exchange): each row's element offset in the flat buffers, its index in
  ``row_step`` and its dim.

Rows of several dims share a launch, masked to ``BLOCK_D``. Triton is imported on first use, as in
``recsys.optim.cowclip.kernels.triton_update``; under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors, which
is how CI checks it against the torch version.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

import recsys.optim.cowclip.kernels.triton_catchup_kernel as _body
import recsys.optim.cowclip.kernels.triton_update as _ct
from recsys.optim.cowclip.catchup import DEFAULT_GROWTH

__all__ = ["triton_catch_up_lookup", "triton_catch_up_rows"]

_KERNEL: list[Callable] = []


def _jit_all() -> None:
    """Jit the shared row body and both kernels once, in the mode triton was imported in (compiled,
    or interpreted). The body is bound as ``triton_catchup_kernel._advance_row_jit``, the name the
    kernels call it by (triton resolves a kernel's globals when it compiles it)."""
    if not _KERNEL:
        if not _ct._import_triton():
            raise RuntimeError("CowClip Triton catch-up: triton not installed")
        _body.tl = _ct.tl
        with _ct._triton_mode_env():
            _body._advance_row_jit = _ct.triton.jit(_body._advance_row)
            _KERNEL.extend([_ct.triton.jit(f) for f in (_body._catch_up_rows_kernel, _body._claim_advance_kernel)])


def _kernel() -> Callable:
    """The per-row kernel (``triton_catch_up_rows``)."""
    _jit_all()
    return _KERNEL[0]


def _lookup_kernel() -> Callable:
    """``triton_catch_up_lookup``'s kernel (claim the rows behind, advance them)."""
    _jit_all()
    return _KERNEL[1]


_F32_FACTORS: dict[tuple, tuple[float, ...]] = {}


def _f32(x: float) -> float:
    """x rounded to float32, as the C++ op's float factors are."""
    return float(torch.tensor(x, dtype=torch.float32))


def _launch_args(
    weights: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    row_step: Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    eps_mode: str,
    l2: float,
    growth: float,
    max_dim: int,
) -> tuple[tuple, dict]:
    """Both kernels' checks and their shared arguments: (HP, CONST, n_const, step and the float32
    factors), and the constexprs."""
    if eps_mode not in ("torch", "keras"):
        raise ValueError(f"eps_mode must be torch|keras, got {eps_mode!r}")
    if growth < 1.0:
        raise ValueError(f"growth must be >= 1, got {growth}")
    b1, b2 = (float(b) for b in betas)
    if not (0.0 < b1 < 1.0 and 0.0 < b2 < 1.0):
        raise ValueError(f"betas must be in (0, 1), got {betas}")
    if not _ct.triton_available(weights.device):
        raise RuntimeError(f"CowClip Triton catch-up not available for {weights.device} tensors")
    for name, x, dt in (
        ("weights", weights, torch.float32),
        ("momentum1", momentum1, torch.float32),
        ("momentum2", momentum2, torch.float32),
        ("row_step", row_step, torch.long),
    ):
        if x.dtype != dt or not x.is_contiguous() or x.device != weights.device:
            raise RuntimeError(f"{name} must be a contiguous {dt} tensor on {weights.device}")
    dev = weights.device
    c = 2.0 * float(l2)
    values = (float(lr), b1, b2, float(eps), c, float(growth), math.log(b1), math.log(b2))
    table = _piece_table(values, int(step), dev)
    f32 = _F32_FACTORS.get(values)
    if f32 is None:  # (rounding through torch costs a few microseconds each: once per setting)
        if len(_F32_FACTORS) >= 16:
            _F32_FACTORS.clear()
        f32 = _F32_FACTORS[values] = (_f32(b1), _f32(b2), _f32((1.0 - b1) * c), _f32((1.0 - b2) * c * c), _f32(c * c), _f32(float(eps)))
    args = (_device_hyper(values, dev), table, table.shape[0], int(step), *f32)
    consts = dict(KERAS=eps_mode == "keras", BLOCK_D=max(16, _ct.triton.next_power_of_2(int(max_dim))), num_warps=1)
    return args, consts


def triton_catch_up_rows(
    weights: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    row_step: Tensor,
    elem_offset: Tensor,
    row_index: Tensor,
    dims: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    eps_mode: str = "torch",
    l2: float = 0.0,
    growth: float = DEFAULT_GROWTH,
    max_dim: int | None = None,
) -> None:
    """Advance rows to global step ``step`` in place, by the block scheme of
    ``recsys.optim.cowclip.catchup.catch_up``: row i starts at ``weights[elem_offset[i]:+dims[i]]``
    (likewise in the moments) and is current at ``row_step[row_index[i]]``, which becomes ``step``
    (a row already current is left as it is). Rows must be distinct. Everything on one device
    (CUDA, or CPU under ``TRITON_INTERPRET=1``). ``max_dim``: the largest of ``dims`` when the caller
    knows it (saves a device-to-host read)."""
    R = elem_offset.numel()
    dev = weights.device
    dims = dims.to(device=dev, dtype=torch.int32).contiguous()
    args, consts = _launch_args(
        weights,
        momentum1,
        momentum2,
        row_step,
        step,
        lr,
        betas,
        eps,
        eps_mode,
        l2,
        growth,
        max_dim if max_dim is not None else (int(dims.max()) if R else 1),
    )
    if R == 0:
        return
    with _ct._triton_mode_env():
        _kernel()[(R,)](
            weights,
            momentum1,
            momentum2,
            row_step,
            elem_offset.to(device=dev, dtype=torch.long).contiguous(),
            row_index.to(device=dev, dtype=torch.long).contiguous(),
            dims,
            *args,
            **consts,
        )


def triton_catch_up_lookup(
    weights: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    row_step: Tensor,
    feature_meta: Tensor,
    indices: Tensor,
    offsets: Tensor,
    step: int,
    *,
    lr: float,
    max_dim: int,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    eps_mode: str = "torch",
    l2: float = 0.0,
    growth: float = DEFAULT_GROWTH,
) -> Tensor | None:
    """Advance every row a lookup reads that is behind ``step`` to ``step``, in place: the CUDA
    twin of the C++ op ``fused_catch_up_tables`` (same buffers, same ``feature_meta`` [F, 6] int64,
    here on the device; the KJT's ``indices`` and ``offsets`` [F*B+1], repeats allowed). Returns
    int32 counts on the device whose sum is the number of rows advanced, or None for an empty
    lookup; nothing here synchronises, and the counts are a view of scratch that the next call on
    the same stream overwrites (sum or clone them before).

    Why one kernel over the ids and no ``torch.unique``: on an H100 at the raw Criteo sizes the
    catch-up's GPU time was about 0.2 ms of the 0.6-0.8 ms it added per step; the rest was the host
    finding the rows behind (a boolean mask and ``torch.unique``, each a device-to-host
    synchronisation, and a dozen small ops and copies). Here each program claims the rows behind
    among its 32 ids (an atomic max of their ``row_step`` to ``step``: exactly one id per row wins)
    and advances the ones it won; one launch, no synchronisation, and the result does not depend on
    which id won. Tried before it (benchmarks/2026-11-26-triton-gpu.md): one program per id with the advance inline
    (the advance's registers cap the programs in flight; each id's chain of dependent loads made it
    0.8-1.7 ms slower at batches 64K-128K), and a claim kernel listing the rows for a second,
    persistent advance kernel (as fast, with a second launch and a counter to zero)."""
    L = indices.numel()
    F = feature_meta.shape[0]
    args, consts = _launch_args(weights, momentum1, momentum2, row_step, step, lr, betas, eps, eps_mode, l2, growth, max_dim)
    if feature_meta.dtype != torch.long or feature_meta.device != weights.device or feature_meta.dim() != 2:
        raise RuntimeError(f"feature_meta must be an int64 [F, 6] tensor on {weights.device}")
    if (offsets.numel() - 1) % max(F, 1) != 0:
        raise ValueError(f"offsets must have F*B+1 entries (F={F}), got {offsets.numel()}")
    B = (offsets.numel() - 1) // max(F, 1)
    if L == 0 or B == 0 or F == 0:
        return None
    programs = _ct.triton.cdiv(L, LOOKUP_BLOCK)
    out_woff, out_rs, out_d, counts = _scratch(weights.device, L, programs)
    with _ct._triton_mode_env():
        _lookup_kernel()[(programs,)](
            weights,
            momentum1,
            momentum2,
            row_step,
            indices.contiguous(),
            offsets.contiguous(),
            feature_meta.contiguous(),
            L,
            F,
            B,
            out_woff,
            out_rs,
            out_d,
            counts,
            *args,
            BLOCK=LOOKUP_BLOCK,
            SEARCH_STEPS=max(1, math.ceil(math.log2(F))),
            **consts,
        )
    return counts


LOOKUP_BLOCK = 32  # ids per program of the lookup's kernel (one warp: an id per lane)
_SCRATCH: dict[tuple, tuple[Tensor, ...]] = {}


def _scratch(dev: torch.device, L: int, programs: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The lookup kernel's scratch lists (each program writes its own stretch before it reads it),
    kept across calls per device and CUDA stream and grown as needed (the step's catch-up is
    host-bound at batch 8K: allocating the four each call took 29 us of host time on one H100
    machine; keeping them costs the current-stream lookup, 17 us on another whose host was slower
    throughout). Reuse is safe because a stream runs its kernels in order, and another stream
    gets its own."""
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (str(dev), stream)
    bufs = _SCRATCH.get(key)
    if bufs is None or bufs[0].numel() < L or bufs[3].numel() < programs:
        if len(_SCRATCH) >= 8:
            _SCRATCH.clear()
        n = max(L, 1024)
        bufs = _SCRATCH[key] = (
            torch.empty(n, dtype=torch.long, device=dev),
            torch.empty(n, dtype=torch.long, device=dev),
            torch.empty(n, dtype=torch.int32, device=dev),
            torch.empty(_ct.triton.cdiv(n, LOOKUP_BLOCK), dtype=torch.int32, device=dev),
        )
    return bufs[0], bufs[1], bufs[2], bufs[3][:programs]


_DEVICE_HYPER: dict[tuple, Tensor] = {}
_PIECE_TABLES: dict[tuple, Tensor] = {}
TABLE_COLS = 16  # columns of _piece_table
MAX_TABLE_PIECES = 64  # pieces beyond (only with growth near 1) compute their factors in the kernel


def _piece_table(values: tuple[float, ...], step: int, dev: torch.device) -> Tensor:
    """float64 [P, TABLE_COLS]: per piece index i, the factors of a full block of k = k_nom(i) steps
    that depend on k alone (k, b1^x and b2^x at G's two nodes, b1^k, b2^k, 1/k, the block-end v
    factors, the predicted path's v factors at the two nodes: the C++ op's f[13], f[17..20] and
    f[9..12]), for the pieces a gap of up to ``step`` steps can use (at most MAX_TABLE_PIECES).
    Why: they are the same for every row and step, and computing them per row and piece was most
    of the kernel's float64 work. Cached on the device per setting, rebuilt when ``step`` needs
    more pieces."""
    _lr, _b1, b2, _eps, c, growth, ln_b1, ln_b2 = values
    ks, done, size = [], 0, 1.0
    while done < max(step, 1) and len(ks) < MAX_TABLE_PIECES:
        ks.append(int(size))
        done += int(size)
        size *= growth
    key = (values, len(ks), str(dev))
    hit = _PIECE_TABLES.get(key)
    if hit is not None:
        return hit

    def ema(x: float) -> tuple[float, float, float]:  # 1 - b2^x, EMA of j-1 and of (j-1)^2 (catchup._ema_lin)
        o = 1.0 - math.exp(x * ln_b2)
        a = x - b2 * o / (1.0 - b2)
        q = x * x - 2.0 * b2 / (1.0 - b2) * x + b2 * (1.0 + b2) / ((1.0 - b2) * (1.0 - b2)) * o
        return o, a - o, q - 2.0 * a + o

    rows = []
    for k_nom in ks:
        k = float(k_nom)
        half, mid = k / 2.0, (k + 1.0) / 2.0
        xs = (mid - half * _body._GL, mid + half * _body._GL)
        one2, y2a, y2b = ema(k)
        path = []  # v at the two Gauss-Legendre nodes along the predicted w path (2c^2 y1, c^2 y2)
        for x in xs:
            _o, y1, y2 = ema(x)
            path += [2.0 * c * c * y1, c * c * y2]
        rows.append(
            [
                k,
                *(math.exp(x * ln_b1) for x in xs),
                *(math.exp(x * ln_b2) for x in xs),
                math.exp(k * ln_b1),
                math.exp(k * ln_b2),
                1.0 / k,
                c * c * one2,
                2.0 * c * c * y2a,
                c * c * y2b,
                1.0 - one2,
                *path,
            ]
        )
    if len(_PIECE_TABLES) >= 16:
        _PIECE_TABLES.clear()
    hit = _PIECE_TABLES[key] = torch.tensor(rows, dtype=torch.float64, device=dev)
    return hit


def _device_hyper(values: tuple[float, ...], dev: torch.device) -> Tensor:
    """The kernel's float64 hyper-parameters on the device, cached by value (one small copy per
    setting, not per step)."""
    key = (values, str(dev))
    hit = _DEVICE_HYPER.get(key)
    if hit is None:
        if len(_DEVICE_HYPER) >= 16:
            _DEVICE_HYPER.clear()
        hit = _DEVICE_HYPER[key] = torch.tensor(values, dtype=torch.float64, device=dev)
    return hit
