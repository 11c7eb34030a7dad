"""The Triton kernel bodies of the catch-up (their launch, arguments and scratch are in
``triton_catchup.py``): ``_advance_row``, one row's walk over its schedule of pieces, and the two
kernels that call it, one row per program (``_catch_up_rows_kernel``) or 32 ids per program with
an atomic claim of each row behind (``_claim_advance_kernel``).

These are plain Python functions until ``triton_catchup._jit_all`` jits them; it binds this
module's globals ``tl`` (triton.language) and ``_advance_row_jit`` (the jitted row body), the
names the kernels use, because triton resolves a kernel's globals from the module that defines
it."""

from __future__ import annotations

import math
from typing import Callable

tl = None  # triton.language, bound on first use
_advance_row_jit: Callable | None = None
_GL = 1.0 / math.sqrt(3.0)  # 2-node Gauss-Legendre on [-1, 1]


def _advance_row(
    W,
    M,
    V,  # flat float32 weights / momentum1 / momentum2
    woff,
    D,
    rs,
    step,  # the row's element offset and dim, its row_step, the global step
    HP,  # float64 [8]: lr, b1, b2, eps, c = 2*l2, growth, ln b1, ln b2 (a Python float argument would be float32)
    CONST,
    n_const,  # float64 [n_const, 16]: the k-only factors of full piece i (_piece_table)
    b1f,
    b2f,
    c_m,
    c_v,
    c2,
    epsf,  # float32 factors of the exact step (as the C++ op's CatchHyper)
    KERAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Advance one row's w, m, v in place from step ``rs`` to ``step`` (``row_step`` is the
    caller's): the body both kernels share."""
    lr = tl.load(HP + 0)
    b1 = tl.load(HP + 1)
    b2 = tl.load(HP + 2)
    eps = tl.load(HP + 3)
    c = tl.load(HP + 4)
    growth = tl.load(HP + 5)
    ln_b1 = tl.load(HP + 6)
    ln_b2 = tl.load(HP + 7)
    ca = c * (1.0 - b1)
    g_max = tl.where(c > 0.0, 2.0 * (1.0 + b1) / ((1.0 - b1) * tl.maximum(c, 1e-300)), 1e300)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    w = tl.load(W + woff + d, mask=dmask, other=0.0)
    m = tl.load(M + woff + d, mask=dmask, other=0.0)
    v = tl.load(V + woff + d, mask=dmask, other=0.0)
    gap = step - rs
    done = gap * 0
    i = gap * 0  # piece index
    size = gap.to(tl.float64) * 0.0 + 1.0
    b1t = tl.exp(rs.to(tl.float64) * ln_b1)  # b^t0 at the piece's first step t0 = rs + done
    b2t = tl.exp(rs.to(tl.float64) * ln_b2)
    while done < gap:
        k_nom = size.to(tl.int64)
        left = gap - done
        # the piece's size: nominal, cut to what is left and to the bias-correction cap at its
        # start t0 (catchup.py's bias_cap, the same formula in double)
        t_cap = tl.maximum((rs + done).to(tl.float64), 1.0)
        rate = (-0.5 * ln_b2) / (tl.exp(-t_cap * ln_b2) - 1.0) + (-ln_b1) / (tl.exp(-t_cap * ln_b1) - 1.0)
        cap = tl.maximum(tl.floor(0.1 / rate), 1.0)  # 0.1: catchup.BIAS_CAP
        kk = tl.minimum(left, k_nom)
        kk = tl.where(cap < kk.to(tl.float64), cap.to(tl.int64), kk)
        exact = kk == 1
        # the exact step at global step t0 + 1
        bc1e = 1.0 - b1t * b1
        bc2e = 1.0 - b2t * b2
        if KERAS:
            e0 = (lr * tl.sqrt(bc2e) / bc1e).to(tl.float32)
            e1 = e0 * 0.0
        else:
            e0 = (lr / bc1e).to(tl.float32)
            e1 = (1.0 / tl.sqrt(bc2e)).to(tl.float32)
        # a block of k steps (make_piece): the factors that depend on k alone come from the host's
        # table for a full piece (CONST row i), and are computed here for a cut or capped one
        if (kk == k_nom) & (i < n_const):
            row = CONST + i * 16  # _piece_table's columns
            b1x1 = tl.load(row + 1)
            b1x2 = tl.load(row + 2)
            b2x1 = tl.load(row + 3)
            b2x2 = tl.load(row + 4)
            b1k = tl.load(row + 5)
            b2k = tl.load(row + 6)
            f13 = tl.load(row + 7).to(tl.float32)
            f17 = tl.load(row + 8).to(tl.float32)
            f18 = tl.load(row + 9).to(tl.float32)
            f19 = tl.load(row + 10).to(tl.float32)
            f20 = tl.load(row + 11).to(tl.float32)
            pa1 = tl.load(row + 12).to(tl.float32)
            pb1 = tl.load(row + 13).to(tl.float32)
            pa2 = tl.load(row + 14).to(tl.float32)
            pb2 = tl.load(row + 15).to(tl.float32)
        else:
            k = kk.to(tl.float64)
            b1k = tl.exp(k * ln_b1)
            half = k / 2.0
            mid = (k + 1.0) / 2.0
            x1 = mid - half * 0.57735026918962576451  # 2-node Gauss-Legendre: 1/sqrt(3)
            x2 = mid + half * 0.57735026918962576451
            b1x1 = tl.exp(x1 * ln_b1)
            b1x2 = tl.exp(x2 * ln_b1)
            b2x1 = tl.exp(x1 * ln_b2)
            b2x2 = tl.exp(x2 * ln_b2)
            f13 = (1.0 / k).to(tl.float32)
            b2k = tl.exp(k * ln_b2)
            one2 = 1.0 - b2k
            a_2 = k - b2 * one2 / (1.0 - b2)
            q_2 = k * k - 2.0 * b2 / (1.0 - b2) * k + b2 * (1.0 + b2) / ((1.0 - b2) * (1.0 - b2)) * one2
            f17 = (c * c * one2).to(tl.float32)
            f18 = (2.0 * c * c * (a_2 - one2)).to(tl.float32)
            f19 = (c * c * (q_2 - 2.0 * a_2 + one2)).to(tl.float32)
            f20 = (1.0 - one2).to(tl.float32)
            # v at the nodes along the predicted w path: EMAs of j-1 and (j-1)^2 over j = 1..x
            o1 = 1.0 - b2x1
            a1_ = x1 - b2 * o1 / (1.0 - b2)
            q1_ = x1 * x1 - 2.0 * b2 / (1.0 - b2) * x1 + b2 * (1.0 + b2) / ((1.0 - b2) * (1.0 - b2)) * o1
            o2 = 1.0 - b2x2
            a2_ = x2 - b2 * o2 / (1.0 - b2)
            q2_ = x2 * x2 - 2.0 * b2 / (1.0 - b2) * x2 + b2 * (1.0 + b2) / ((1.0 - b2) * (1.0 - b2)) * o2
            pa1 = (2.0 * c * c * (a1_ - o1)).to(tl.float32)
            pb1 = (c * c * (q1_ - 2.0 * a1_ + o1)).to(tl.float32)
            pa2 = (2.0 * c * c * (a2_ - o2)).to(tl.float32)
            pb2 = (c * c * (q2_ - 2.0 * a2_ + o2)).to(tl.float32)
        a1 = (1.0 - b2x1).to(tl.float32)
        a2 = (1.0 - b2x2).to(tl.float32)
        # G's bias corrections at the nodes: 1 - b^(t0 + x) = 1 - b^t0 * b^x
        c11 = 1.0 - b1t * b1x1
        c12 = 1.0 - b1t * b1x2
        c21 = tl.sqrt(1.0 - b2t * b2x1)
        c22 = tl.sqrt(1.0 - b2t * b2x2)
        if KERAS:  # G = f1 / (sqrt(vx) + eps)
            p1 = (c21 / c11).to(tl.float32)
            p2 = (c22 / c12).to(tl.float32)
            q1 = p1 * 0.0
            q2 = q1
        else:  # G = 1 / (sqrt(vx) * f1 + f2)
            p1 = (c11 / c21).to(tl.float32)
            p2 = (c12 / c22).to(tl.float32)
            q1 = (c11 * eps).to(tl.float32)
            q2 = (c12 * eps).to(tl.float32)

        # the exact step on the columns
        me = m * b1f + w * c_m
        ve = v * b2f + (w * w) * c_v
        if KERAS:
            we = w - me / (tl.sqrt(ve) + epsf) * e0
        else:
            we = w - (me * e0) / (tl.sqrt(ve) * e1 + epsf)
        # the block on the columns: the frozen-step matrix power (catchup.py, _block and _lucas):
        # g = lr * mean G, A = [[1 - h(1-b1), -g b1], [(1-b1) c, b1]], h = c g capped so A's
        # spectral radius is <= 1, the Lucas sequences U_k, V_k by binary doubling over k's bits,
        # with v at the nodes along the w path the block's first step (the exact step above)
        # predicts, stopped at 0
        ww = w * w
        dv = ww * c2 - v
        sp = we - w
        lim = tl.abs(w) * f13
        sp = tl.where(sp * w < 0.0, tl.minimum(tl.maximum(sp, -lim), lim), sp)
        wsp = w * sp
        ssp = sp * sp
        vx1 = tl.maximum(v + dv * a1 + wsp * pa1 + ssp * pb1, 0.0)
        vx2 = tl.maximum(v + dv * a2 + wsp * pa2 + ssp * pb2, 0.0)
        if KERAS:
            g1 = (1.0 / (tl.sqrt(vx1) + epsf)) * p1
            g2 = (1.0 / (tl.sqrt(vx2) + epsf)) * p2
        else:
            g1 = 1.0 / (tl.sqrt(vx1) * p1 + q1)
            g2 = 1.0 / (tl.sqrt(vx2) * p2 + q2)
        gd = tl.minimum((g1 + g2).to(tl.float64) * (0.5 * lr), g_max)
        a11 = 1.0 - ca * gd
        lp = a11 + b1
        dis = lp * lp - 4.0 * b1
        lu = lp * 0.0 + 1.0  # U_1 = 1, V_1 = P: k's top bit
        lv = lp
        qn = b1
        k_i = kk
        top = k_i * 0
        while (k_i >> (top + 1)) > 0:
            top = top + 1
        bit = top - 1
        while bit >= 0:
            one = ((k_i >> bit) & 1) == 1
            u2 = lu * lv
            v2 = lv * lv - 2.0 * qn
            lu = tl.where(one, (lp * u2 + v2) * 0.5, u2)
            lv = tl.where(one, (dis * u2 + lp * v2) * 0.5, v2)
            qn = qn * qn
            qn = tl.where(one, qn * b1, qn)
            bit = bit - 1
        # A^k = (V_k / 2) I + U_k (A - (P/2) I): no cancellation between large terms
        n11 = (lp - 2.0 * b1) * 0.5
        vh = lv * 0.5
        wd = w.to(tl.float64)
        md = m.to(tl.float64)
        wb = (vh * wd + lu * (n11 * wd - gd * b1 * md)).to(tl.float32)
        mb = (vh * md + lu * (ca * wd - n11 * md)).to(tl.float32)
        s = (wb - w) * f13
        vb = tl.maximum(ww * f17 + (w * s) * f18 + (s * s) * f19 + v * f20, 0.0)

        w = tl.where(exact, we, wb)
        m = tl.where(exact, me, mb)
        v = tl.where(exact, ve, vb)
        # b^t0 of the next piece
        b1t = b1t * tl.where(exact, b1, b1k)
        b2t = b2t * tl.where(exact, b2, b2k)
        done = done + kk
        size = size * growth
        i = i + 1
    tl.store(W + woff + d, w, mask=dmask)
    tl.store(M + woff + d, m, mask=dmask)
    tl.store(V + woff + d, v, mask=dmask)


def _catch_up_rows_kernel(
    W,
    M,
    V,
    RS,  # flat float32 weights / momentum1 / momentum2, int64 row_step
    WOFF,
    RSI,
    DIMS,  # [R] int64 element offset of each row, [R] int64 index in RS, [R] int32 dim
    HP,
    CONST,
    n_const,
    step,
    b1f,
    b2f,
    c_m,
    c_v,
    c2,
    epsf,  # as _advance_row's
    KERAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (distinct) row: advance it from its ``row_step`` to ``step`` in place."""
    r = tl.program_id(0).to(tl.int64)
    woff = tl.load(WOFF + r)
    rsi = tl.load(RSI + r)
    D = tl.load(DIMS + r)
    rs = tl.load(RS + rsi)
    _advance_row_jit(W, M, V, woff, D, rs, step, HP, CONST, n_const, b1f, b2f, c_m, c_v, c2, epsf, KERAS, BLOCK_D)
    tl.store(RS + rsi, tl.maximum(rs, step))


def _claim_advance_kernel(
    W,
    M,
    V,
    RS,  # as _catch_up_rows_kernel's
    IDX,
    OFFSETS,
    META,  # [L] the lookup's ids (int32/int64), [F*B+1] the KJT's offsets, [F, 6] int64 feature_meta
    L,
    F,
    B,  # ids, features, bags per feature (feature f's ids start at OFFSETS[f * B])
    OUT_WOFF,
    OUT_RS,
    OUT_D,
    COUNTS,  # scratch [L] int64, [L] int64, [L] int32: each program's claimed rows; [programs] int32
    HP,
    CONST,
    n_const,
    step,
    b1f,
    b2f,
    c_m,
    c_v,
    c2,
    epsf,  # as _advance_row's
    BLOCK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    KERAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """BLOCK ids per program (one warp: an id per lane). First the claim: find each id's feature
    (a binary search over the feature starts in OFFSETS) and claim every row behind ``step`` by an
    atomic max of its ``row_step`` to ``step``; of the ids that hold the same row (repeats in a
    bag, across bags or programs, or features that share a table) exactly one sees the old value
    below ``step``. Then the program advances the rows it won, one after the other, from a list in
    its own stretch of the scratch (COUNTS[program] = their number). Ids outside their table are
    left alone (the update op's bounds check names them)."""
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < L
    k = tl.load(IDX + i, mask=inb, other=-1).to(tl.int64)
    lo = i * 0  # invariant OFFSETS[lo * B] <= i < OFFSETS[hi * B]
    hi = lo + F
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        up = tl.load(OFFSETS + mid * B, mask=inb, other=0) <= i
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid)
    n_rows = tl.load(META + lo * 6 + 1, mask=inb, other=0)
    ok = inb & (k >= 0) & (k < n_rows)
    D = tl.load(META + lo * 6 + 2, mask=ok, other=0)
    woff = tl.load(META + lo * 6 + 0, mask=ok, other=0) + k * D
    rsi = tl.load(META + lo * 6 + 4, mask=ok, other=0) + k
    rs = tl.load(RS + rsi, mask=ok, other=0)
    behind = ok & (rs < step)
    # (rs * 0 + step: int64 as row_step; triton passes a small int argument as int32)
    old = tl.atomic_max(RS + rsi, rs * 0 + step, mask=behind)
    won = behind & (old < step)
    n_won = won.to(tl.int32)
    total = tl.sum(n_won, 0)
    tl.store(COUNTS + pid, total)
    slot = pid * BLOCK + tl.cumsum(n_won, 0) - n_won
    tl.store(OUT_WOFF + slot, woff, mask=won)
    tl.store(OUT_RS + slot, old, mask=won)
    tl.store(OUT_D + slot, D.to(tl.int32), mask=won)
    tl.debug_barrier()  # the lanes' stores above, visible to the loads below
    for r in range(0, total):
        s = pid * BLOCK + r
        _advance_row_jit(
            W,
            M,
            V,
            tl.load(OUT_WOFF + s),
            tl.load(OUT_D + s),
            tl.load(OUT_RS + s),
            step,
            HP,
            CONST,
            n_const,
            b1f,
            b2f,
            c_m,
            c_v,
            c2,
            epsf,
            KERAS,
            BLOCK_D,
        )
