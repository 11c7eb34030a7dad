"""Fused CowClip-Adam update as a Triton kernel: the CUDA twin of the C++ CPU op
``torch.ops.recsys.cowclip_adam_tables_`` (``recsys/optim/csrc/cowclip_adam.cpp``).

``triton_cowclip_adam_tables`` has exactly the contract of
``recsys.optim.cowclip.kernels.cpp_op.fused_cowclip_adam_tables`` (same arguments, same in-place effect on the
flat ``weights``/``momentum1``/``momentum2``/``row_step`` buffers, same int64 [F, 2] result of
(unique rows, clipped rows) per feature), so the caller picks one by device:
``dispatch.tables_update_op(weights.device)``. Per table it is the update of
``cowclip_adam_step(..., update_scope="batch", l2_scope="batch", bias_correction="row")``:
lazy Adam on the batch's unique rows, per-row bias correction, rows absent from the batch never read
or written (bit-identical), L2 (``2*l2*w``) added to the batch rows' gradient before the clip.

How (one sort, one kernel launch for all tables of the group):

* pre-pass in torch ops on the device, O(L) for L ids: every occurrence gets its bag
  (``repeat_interleave`` of the offsets) and a key ``table_base[f] + id`` that is unique across
  the features; ONE stable ``torch.sort`` of the keys groups each row's occurrences, still in bag
  order, and ``unique_consecutive`` gives the segments. Why a sort and not a hash: a GPU radix
  sort of 200K int64 keys takes tens of microseconds (84 us for 213K keys on an H200), and it
  makes the result independent of thread scheduling (no atomics anywhere: the summation order is fixed, reruns are bit-identical),
  and the stable order lets the kernel count *distinct* samples per row by comparing neighbours.
* the kernel: one program per unique row (of any table). It sums the row's gradient over its
  occurrences in chunks of ``CHUNK`` (a [CHUNK, BLOCK_D] tile of ``grad_output`` rows, times the
  per-sample weights), counts the distinct samples (``cnt``), then reads w, m, v, row_step of that
  row once, applies L2, the clip ``r*cnt*max(||w||, r*sqrt(D)*zeta)``, Adam with
  ``t = ++row_step`` (torch or keras eps placement) and writes w, m, v, row_step back, in place.
  Tables of different dims share the launch (``BLOCK_D`` = the largest dim, masked).

Host synchronisation: one, small: the offsets and id bounds checks together (ids out of range
are an error naming the feature and the id, raised before anything is written). The number of
unique rows U stays on the device: the grid has one program per occurrence (an upper bound on U)
and the programs past U return at once, and the per-feature counts are returned as a device
tensor. (A synchronisation stops the host from queueing ahead of the device. On an H100 at 26
tables x batch 8K the step is host-bound either way, 2.6 ms against 0.4 ms of device time: its
kernel launches, not its waits, are what costs; docs/install.md "What the GPU run shows".)

Triton is optional and imported on first use: without it this module imports,
``triton_available()`` is False and ``dispatch.tables_update_op`` never returns the Triton op.
With ``TRITON_INTERPRET=1`` (set before triton
is imported) the same kernel runs on CPU tensors through Triton's interpreter: that is how CI checks
it against the torch reference (``tests/integration/cowclip/kernels/test_triton_update.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Iterator

import torch
from torch import Tensor

from recsys.optim.cowclip.reference import CowClipAdamState, CowClipStats

# Optional dependency, imported on first use (``_import_triton``), not with this module: importing
# the TBE must not import triton, because triton fixes interpreter vs compiled mode when it is first
# imported (a test that wants the interpreter imports it itself, with TRITON_INTERPRET=1).
triton = None
tl = None
_TRITON_TRIED = False

__all__ = [
    "CHUNK",
    "triton_available",
    "triton_cowclip_adam_step",
    "triton_cowclip_adam_tables",
]

CHUNK = 32  # occurrences summed per iteration of a row's loop (hot rows: cnt/CHUNK iterations)


def _import_triton() -> bool:
    """Imports triton once (the kernel's globals ``triton`` and ``tl``); False when not installed."""
    global triton, tl, _TRITON_TRIED
    if not _TRITON_TRIED:
        _TRITON_TRIED = True
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError:  # a CPU install without triton keeps working
            return False
        triton, tl = _triton, _tl
    return triton is not None


def _interpreted() -> bool:
    """Whether triton runs kernels in its interpreter in this process. Triton decides when it is
    imported (``TRITON_INTERPRET=1`` at ``import triton`` makes its own library functions such as
    ``tl.sum`` interpreted), so this asks triton rather than the environment now."""
    return triton is not None and type(tl.sum).__name__ == "InterpretedFunction"


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernel can run on tensors of ``device``: triton importable, and the
    device is CUDA, or CPU when triton was imported under ``TRITON_INTERPRET=1`` (tests)."""
    if not _import_triton():
        return False
    if device is None:
        return True
    dev = torch.device(device)
    return dev.type == "cuda" or (dev.type == "cpu" and _interpreted())


def _cowclip_adam_rows(
    W,
    M1,
    M2,
    RS,  # flat state: weights, momentum1, momentum2 (float32), row_step (int64)
    G,
    stride_g,  # grad_output [B, total_D] float32, unit column stride
    SEG,
    SEG_FEAT,
    SEG_ROW,  # [>=U+1] segment bounds in sorted order, [>=U] feature, [>=U] row in its table
    NSEG,  # [1] int64: U, the number of segments (programs u >= U do nothing)
    SORT_SAMPLE,
    SORT_PSW,  # [L] sample (bag within the feature) and per-sample weight, sorted order
    META,
    ZETA_P,  # [F, 6] int64 feature_meta, [F] float32 zeta' = r*sqrt(D)*zeta
    CLIPPED,  # [U] int32 out: 1 where the gradient was scaled down
    lr,
    b1,
    b2,
    omb1,
    omb2,
    eps,
    l2x2,
    r,
    log2_b1,
    log2_b2,
    HAS_PSW: tl.constexpr,
    HAS_L2: tl.constexpr,
    KERAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per unique row of any table: sum its gradient over its occurrences, count its
    distinct samples, then L2 + clip + Adam on that row in place (see the module docstring).
    The grid may hold more programs than rows (its size is known before U is, so that the host
    need not wait for the device): those beyond U read nothing and write nothing."""
    u = tl.program_id(0).to(tl.int64)
    valid = u < tl.load(NSEG)
    uu = tl.where(valid, u, 0)  # past U: read a real segment's fields, then write nothing
    start = tl.load(SEG + uu)
    end = tl.where(valid, tl.load(SEG + uu + 1), start)  # past U: no occurrences
    f = tl.load(SEG_FEAT + uu)
    k = tl.load(SEG_ROW + uu)
    woff = tl.load(META + f * 6 + 0)
    D = tl.load(META + f * 6 + 2)
    gcol = tl.load(META + f * 6 + 3)
    rstart = tl.load(META + f * 6 + 4)
    clip_on = tl.load(META + f * 6 + 5) != 0
    zeta_p = tl.load(ZETA_P + f)

    d = tl.arange(0, BLOCK_D)
    dmask = d < tl.where(valid, D, 0)  # past U: no lane (a vector compare: masks must be vectors)
    c = tl.arange(0, CHUNK)

    # phase 1: the row's gradient and its count of distinct samples (occurrences are in bag order)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    new_bag = tl.zeros([CHUNK], dtype=tl.int32)
    for j0 in range(start, end, CHUNK):
        j = j0 + c
        jm = j < end
        s = tl.load(SORT_SAMPLE + j, mask=jm, other=0).to(tl.int64)
        sp = tl.load(SORT_SAMPLE + j - 1, mask=jm & (j > start), other=-1).to(tl.int64)
        new_bag += (jm & (s != sp)).to(tl.int32)
        go = tl.load(G + s[:, None] * stride_g + gcol + d[None, :], mask=jm[:, None] & dmask[None, :], other=0.0)
        if HAS_PSW:
            p = tl.load(SORT_PSW + j, mask=jm, other=0.0)
            go = go * p[:, None]
        acc += tl.sum(go, axis=0)
    cnt = tl.sum(new_bag, axis=0).to(tl.float32)

    # phase 2: L2, clip, Adam on the row, in place
    row = woff + k * D
    w = tl.load(W + row + d, mask=dmask, other=0.0)
    g = acc
    if HAS_L2:
        g = g + l2x2 * w
    wnorm = tl.sqrt(tl.sum(w * w, axis=0))
    gnorm = tl.sqrt(tl.sum(g * g, axis=0))
    clip_t = (r * cnt) * tl.maximum(wnorm, zeta_p)
    denom = tl.maximum(gnorm, clip_t)
    scale = tl.where(denom > 0, clip_t / tl.where(denom > 0, denom, 1.0), 1.0)
    scale = tl.where(clip_on, scale, 1.0)
    g = g * scale
    tl.store(CLIPPED + u, (clip_on & (gnorm > clip_t) & valid).to(tl.int32))  # slot u is this program's

    t = tl.load(RS + rstart + k) + 1
    tl.store(RS + rstart + k + d * 0, t + d * 0, mask=d < tl.where(valid, 1, 0))  # one lane; none past U
    tf = t.to(tl.float32)
    bc1 = 1.0 - tl.exp2(tf * log2_b1)
    bc2s = tl.sqrt(1.0 - tl.exp2(tf * log2_b2))

    m = tl.load(M1 + row + d, mask=dmask, other=0.0)
    v = tl.load(M2 + row + d, mask=dmask, other=0.0)
    m = m * b1 + omb1 * g
    v = v * b2 + (omb2 * g) * g
    if KERAS:
        w = w - ((lr * bc2s) / bc1) * (m / (tl.sqrt(v) + eps))
    else:
        w = w - (lr * (m / bc1)) / (tl.sqrt(v) / bc2s + eps)
    tl.store(W + row + d, w, mask=dmask)
    tl.store(M1 + row + d, m, mask=dmask)
    tl.store(M2 + row + d, v, mask=dmask)


_KERNEL: list[Callable] = []


@contextlib.contextmanager
def _triton_mode_env() -> Iterator[None]:
    """``TRITON_INTERPRET`` set to the mode triton was imported in, for the duration of a
    decoration or launch: ``triton.jit`` and modules triton imports lazily during a launch read the
    variable then, and must agree with the import-time choice (interpreted ``tl.sum`` & co.). Only
    the interpreted (test) path ever changes the variable; a process on CUDA without it never does."""
    want = "1" if _interpreted() else None
    old = os.environ.get("TRITON_INTERPRET")
    if (old not in (None, "", "0")) == (want is not None):
        yield
        return
    if want is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = want
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _kernel() -> Callable:
    """``_cowclip_adam_rows`` jitted once (compiled, or interpreted like the rest of triton here)."""
    if not _KERNEL:
        if not _import_triton():
            raise RuntimeError("CowClip Triton kernel: triton not installed")
        with _triton_mode_env():
            _KERNEL.append(triton.jit(_cowclip_adam_rows))
    return _KERNEL[0]


def _check_inputs(
    weights: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    row_step: Tensor,
    feature_meta: Tensor,
    zeta: Tensor,
    indices: Tensor,
    offsets: Tensor,
    grad_output: Tensor,
    psw: Tensor | None,
) -> list[list[int]]:
    """The C++ op's checks, with its messages (RuntimeError, like its TORCH_CHECKs). Returns
    ``feature_meta`` as lists."""

    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise RuntimeError(msg)

    check(weights.dim() == 1, "weights must be the flat 1-D buffer")
    check(weights.dtype == torch.float32, "weights must be float32")
    check(
        weights.is_contiguous() and momentum1.is_contiguous() and momentum2.is_contiguous(),
        "weight, exp_avg, exp_avg_sq must be contiguous",
    )
    check(momentum1.shape == weights.shape and momentum2.shape == weights.shape, "optimizer state shape does not match weight")
    check(momentum1.dtype == torch.float32 and momentum2.dtype == torch.float32, "exp_avg, exp_avg_sq must be float32")
    check(row_step.dim() == 1 and row_step.dtype == torch.long and row_step.is_contiguous(), "row_step must be a contiguous int64 vector")
    dev = weights.device
    check(
        all(x.device == dev for x in (momentum1, momentum2, row_step, indices, offsets, grad_output))
        and (psw is None or psw.device == dev),
        f"all tensors but feature_meta and zeta must be on {dev}",
    )
    check(
        feature_meta.dim() == 2 and feature_meta.shape[1] == 6 and feature_meta.dtype == torch.long,
        "feature_meta must be a contiguous int64 [F, 6] (weights_offset, rows, dim, grad_col, row_start, clip)",
    )
    F = feature_meta.shape[0]
    check(zeta.dim() == 1 and zeta.numel() == F and zeta.dtype == torch.float64, "zeta must be a contiguous float64 [F]")
    check(indices.dim() == 1 and offsets.dim() == 1, "indices and offsets must be 1-D")
    check(
        indices.dtype == offsets.dtype and indices.dtype in (torch.int32, torch.int64),
        "indices and offsets must both be int64 or both int32",
    )
    check(
        grad_output.dim() == 2 and grad_output.dtype == torch.float32 and grad_output.stride(1) == 1,
        "grad_output must be float32 [B, total_D] with unit column stride",
    )
    check(F > 0 and (offsets.numel() - 1) % F == 0, "offsets must have F*B+1 entries")
    B = (offsets.numel() - 1) // F
    check(grad_output.shape[0] == B, f"offsets has {B} bags per feature but grad_output has {grad_output.shape[0]} rows")
    if psw is not None:
        check(
            psw.dim() == 1 and psw.numel() == indices.numel() and psw.dtype == torch.float32,
            "per_sample_weights must be a contiguous float32 [L]",
        )
    meta = feature_meta.tolist()  # feature_meta lives on the host (as the C++ op receives it): no sync
    for f, (woff, n, dim, col, rst, _clip) in enumerate(meta):
        check(woff >= 0 and n >= 0 and dim > 0 and woff + n * dim <= weights.numel(), f"feature {f}: table outside the weights buffer")
        check(col >= 0 and col + dim <= grad_output.shape[1], f"feature {f}: columns outside grad_output")
        check(rst >= 0 and rst + n <= row_step.numel(), f"feature {f}: rows outside row_step")
    for lo_hi in ([(m[0], m[0] + m[1] * m[2]) for m in meta], [(m[4], m[4] + m[1]) for m in meta]):
        spans = sorted(s for s in lo_hi if s[0] != s[1])
        check(all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), "features must read distinct, non-overlapping tables")
    return meta


_DEVICE_META: dict[tuple, tuple[Tensor, Tensor]] = {}


def _device_meta(meta: list[list[int]], zeta: list[float], r: float, dev: torch.device) -> tuple[Tensor, Tensor]:
    """``feature_meta`` and zeta' = r*sqrt(D)*zeta (float32, rounded from double like the C++ op) on
    the device, cached by value: the TBE passes the same description every step, so the two small
    host-to-device copies happen once, not per step."""
    key = (tuple(map(tuple, meta)), tuple(zeta), float(r), str(dev))
    hit = _DEVICE_META.get(key)
    if hit is None:
        if len(_DEVICE_META) >= 16:
            _DEVICE_META.clear()
        hit = _DEVICE_META[key] = (
            torch.tensor(meta, dtype=torch.long, device=dev),
            torch.tensor([float(r * math.sqrt(m[2]) * z) for m, z in zip(meta, zeta)], dtype=torch.float32, device=dev),
        )
    return hit


def triton_cowclip_adam_tables(
    weights: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    row_step: Tensor,
    feature_meta: Tensor,
    zeta: Tensor,
    indices: Tensor,
    offsets: Tensor,
    grad_output: Tensor,
    per_sample_weights: Tensor | None = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    r: float = 1.0,
    l2: float = 0.0,
    eps_mode: str = "torch",
) -> Tensor:
    """One lazy CowClip-Adam step of every table of a table-batched group, in place, in ONE kernel
    launch. Arguments and result exactly as ``fused_cowclip_adam_tables`` (see its docstring):
    ``feature_meta`` int64 [F, 6] and ``zeta`` float64 [F] on the host, everything else on the
    device of ``weights``. Returns int64 [F, 2] (unique rows, clipped rows) on that device.
    """
    if eps_mode not in ("torch", "keras"):
        raise ValueError(f"eps_mode must be torch|keras, got {eps_mode!r}")
    if not triton_available(weights.device):
        raise RuntimeError(
            f"CowClip Triton kernel not available for {weights.device} tensors "
            f"({'triton not installed' if triton is None else 'CPU tensors need TRITON_INTERPRET=1 before triton is imported'})"
        )
    feature_meta = feature_meta.cpu()
    zeta = zeta.cpu()
    if grad_output.dtype != torch.float32 or grad_output.stride(-1) != 1:
        grad_output = grad_output.to(torch.float32).contiguous()
    if offsets.dtype != indices.dtype:
        offsets = offsets.to(indices.dtype)
    if indices.dtype not in (torch.int32, torch.int64):
        indices, offsets = indices.long(), offsets.long()
    psw = per_sample_weights
    if psw is not None:
        psw = psw.detach().to(torch.float32).contiguous()
    meta = _check_inputs(weights, momentum1, momentum2, row_step, feature_meta, zeta, indices, offsets, grad_output, psw)
    dev = weights.device
    F = feature_meta.shape[0]
    FB = offsets.numel() - 1
    B = FB // F
    L = indices.numel()
    stats = torch.zeros(F, 2, dtype=torch.long, device=dev)
    if L == 0:
        return stats

    if FB == 0:
        raise RuntimeError("offsets must start at 0 and end at len(indices)")
    with torch.no_grad():
        offsets = offsets.long()
        lengths = offsets[1:] - offsets[:-1]
        meta_d, zeta_p = _device_meta(meta, zeta.tolist(), r, dev)
        n_rows = meta_d[:, 1]
        # the offsets and the ids are checked with one synchronisation: each id's feature comes
        # from the feature boundaries (a searchsorted that malformed offsets cannot break; the
        # offsets' errors are raised first), the bags after the check (repeat_interleave would
        # fail on malformed offsets with a message of its own)
        feat = torch.searchsorted(offsets[B::B].contiguous(), torch.arange(L, device=dev), right=True).clamp_(max=F - 1)
        ids = indices.long()
        bad = (ids < 0) | (ids >= n_rows.index_select(0, feat))
        first, last, min_len, any_bad = torch.stack([offsets[0], offsets[-1], lengths.min(), bad.any().long()]).tolist()  # sync 1
        if first != 0 or last != L:
            raise RuntimeError("offsets must start at 0 and end at len(indices)")
        if min_len < 0:
            raise RuntimeError("offsets must be non-decreasing")
        if any_bad:  # the error path may take its time
            i = int(bad.nonzero()[0, 0])
            f = int(feat[i])
            raise RuntimeError(f"embedding ids out of range [0, {int(feature_meta[f, 1])}): {int(ids[i])} (feature {f})")
        bag = torch.repeat_interleave(torch.arange(FB, device=dev), lengths, output_size=L)
        base = torch.cumsum(n_rows, 0) - n_rows  # first key of each feature's table
        key = base.index_select(0, feat) + ids
        sorted_key, perm = torch.sort(key, stable=True)  # stable: each row's occurrences stay in bag order
        # the segments (unique rows) without asking the device how many there are: U stays on the
        # device, the grid has L programs (L >= U) and those past U return at once
        is_start = torch.ones(L, dtype=torch.bool, device=dev)
        torch.ne(sorted_key[1:], sorted_key[:-1], out=is_start[1:])
        seg_id = torch.cumsum(is_start, 0) - 1  # [L] the segment of each sorted occurrence
        nseg = seg_id[-1:] + 1  # [1] U, on the device
        seg = torch.full((L + 1,), L, dtype=torch.long, device=dev)  # entries U.. stay L: seg[U] = L
        seg.scatter_reduce_(0, seg_id, torch.arange(L, device=dev), reduce="amin")
        first = seg[:L].clamp(max=L - 1)  # first occurrence of each segment (clamped past U)
        sorted_feat = feat.index_select(0, perm)
        seg_feat = sorted_feat.index_select(0, first)
        seg_row = sorted_key.index_select(0, first) - base.index_select(0, seg_feat)
        sort_sample = (bag - feat * B).index_select(0, perm)
        sort_sample = sort_sample.int() if B < 2**31 else sort_sample
        sort_psw = psw.index_select(0, perm) if psw is not None else sort_sample  # (a dummy when unused)
        clipped = torch.zeros(L, dtype=torch.int32, device=dev)

        b1, b2 = float(betas[0]), float(betas[1])
        b1f, b2f = float(torch.tensor(b1, dtype=torch.float32)), float(torch.tensor(b2, dtype=torch.float32))
        log2_b1 = math.log2(b1f) if b1f > 0 else -math.inf
        log2_b2 = math.log2(b2f) if b2f > 0 else -math.inf
        block_d = max(16, triton.next_power_of_2(max(m[2] for m in meta)))
        with _triton_mode_env():
            _kernel()[(L,)](
                weights,
                momentum1,
                momentum2,
                row_step,
                grad_output,
                grad_output.stride(0),
                seg,
                seg_feat,
                seg_row,
                nseg,
                sort_sample,
                sort_psw,
                meta_d,
                zeta_p,
                clipped,
                float(lr),
                b1,
                b2,
                1.0 - b1,
                1.0 - b2,
                float(eps),
                2.0 * float(l2),
                float(r),
                log2_b1,
                log2_b2,
                HAS_PSW=psw is not None,
                HAS_L2=float(l2) != 0.0,
                KERAS=eps_mode == "keras",
                BLOCK_D=block_d,
                CHUNK=CHUNK,
                num_warps=1 if block_d * CHUNK <= 1024 else 4,
                enable_fp_fusion=True,  # FMA, Triton's default up to 3.9 (said explicitly: 3.10 changes it)
            )
        # per-feature counts, still without a synchronisation: unique rows = segment starts of the
        # feature, clipped rows = flags of its segments (0 past U)
        stats[:, 0].index_add_(0, sorted_feat, is_start.long())
        stats[:, 1].index_add_(0, seg_feat, clipped.long())
    return stats


def triton_cowclip_adam_step(
    weight: Tensor,
    state: CowClipAdamState,
    indices: Tensor,
    offsets: Tensor,
    grad_output: Tensor,
    per_sample_weights: Tensor | None = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    r: float = 1.0,
    zeta: float = 1e-5,
    l2: float = 0.0,
    clip: bool = True,
    eps_mode: str = "torch",
) -> CowClipStats:
    """One table [N, D], same contract as ``fused_cowclip_adam_step``: the multi-table kernel with
    one feature; ``state.step`` is incremented here (the kernel only keeps per-row steps)."""
    if weight.dim() != 2 or not (weight.is_contiguous() and state.exp_avg.is_contiguous() and state.exp_avg_sq.is_contiguous()):
        raise RuntimeError("weight, exp_avg, exp_avg_sq must be contiguous [N, D]")
    n, dim = weight.shape
    if grad_output.dim() != 2 or grad_output.shape[1] != dim:
        raise RuntimeError(f"grad_output dim {tuple(grad_output.shape)} != weight dim {dim}")
    meta = torch.tensor([[0, n, dim, 0, 0, int(bool(clip))]], dtype=torch.long)
    out = triton_cowclip_adam_tables(
        weight.view(-1),
        state.exp_avg.view(-1),
        state.exp_avg_sq.view(-1),
        state.row_step,
        meta,
        torch.tensor([float(zeta)], dtype=torch.float64),
        indices,
        offsets,
        grad_output.detach(),
        per_sample_weights,
        lr=lr,
        betas=betas,
        eps=eps,
        r=r,
        l2=l2,
        eps_mode=eps_mode,
    )
    state.step.add_(1)
    n_unique, n_clipped = int(out[0, 0]), out[0, 1]
    return CowClipStats(unique_rows=n_unique, clipped_rows=n_clipped, clipped_fraction=n_clipped.to(torch.float32) / max(n_unique, 1))
