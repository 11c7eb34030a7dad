"""Where the CowClip catch-up's per-gap error comes from: block variants on the gaps of a dense
reference run.

The catch-up (recsys/optim/cowclip/catchup.py) advances an absent row over a gap in blocks, each a
frozen Adam step raised to the block's power. This script replays every gap of a dense float64
reference run (written here from the paper code's semantics: data gradient + 2 l2 w on every row,
clip r cnt max(||w||, r sqrt(D) zeta), torch-eps Adam with the global step) from the reference's
own state, through block variants, and reports per cell of the grid lr x l2 x zeta the worst
ratio of the norm the next clip reads, max(||w||, zeta'), to the reference's, the rows beyond
1.05x, the worst weight error (in lr) and the pieces (blocks and exact steps) per gap:

* ``uncapped``: blocks of 1, 2, 4, ... steps from the gap's start, nothing else (the scheme
  before the bias-correction cap);
* ``library``: the library's ``catch_up``: the same blocks, none longer than ``bias_cap`` at its
  start (catchup.py: short blocks early in training, where Adam's bias corrections change fast);
* ``traj``: the library's blocks, each block's end v from the frozen step's own w trajectory
  (closed form, below) instead of a straight w path, and G's mean re-evaluated once from it;
* ``uncapped+traj``: that block without the cap.

The ``traj`` closed form: under a frozen step (w, m) <- A (w, m), y = (w^2, w m, m^2) moves
linearly, y <- K y with K the symmetric square of A, so the EMA feed of a block of k steps,
sum_j b2^(k-j) w_(j-1)^2, is the first entry of (b2 I - K)^-1 (b2^k y_0 - y_k), y_k from the
block's end (w_k, m_k): one 3x3 solve per coordinate, no loop over the block's steps (where
b2 I - K is singular to working precision the straight-path v is kept).

    python tools/experiments/catchup_blocks.py                 # the grid, all variants
    python tools/experiments/catchup_blocks.py --lr 1e-2 --variants uncapped library

One JSON line per cell and variant, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

B1, B2, EPS = 0.9, 0.999, 1e-8
TABLES = [(60, 16), (30, 8)]
BATCH, STEPS = 8, 300
VARIANTS = ("uncapped", "library", "traj", "uncapped+traj")


def batches(steps: int, seed: int = 0) -> list:
    """Per step: one Zipf(1.2) id per sample and table, and the labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = []
        for n, _d in TABLES:
            p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.2
            ids.append(torch.multinomial(p / p.sum(), BATCH, replacement=True, generator=g))
        out.append((ids, (torch.rand(BATCH, generator=g) < 0.3).double()))
    return out


def dense_history(bs: list, *, lr: float, l2: float, zeta: float, r: float = 1.0) -> list:
    """(w, m, v) per table after every step of the dense reference (index 0: the start)."""
    gen = torch.Generator().manual_seed(1)
    w = [torch.randn(n, d, generator=gen, dtype=torch.float64) * 0.05 for n, d in TABLES]
    proj = [torch.randn(d, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64) for i, (_n, d) in enumerate(TABLES)]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    hist = [([x.clone() for x in w], [x.clone() for x in m], [x.clone() for x in v])]
    for t, (ids, labels) in enumerate(bs, 1):
        z = sum(w[i][ids[i]] @ proj[i] for i in range(len(TABLES)))
        dz = (torch.sigmoid(z) - labels) / len(labels)
        for i, (n, d) in enumerate(TABLES):
            g = torch.zeros(n, d, dtype=torch.float64).index_add_(0, ids[i], dz[:, None] * proj[i][None, :]) + 2.0 * l2 * w[i]
            cnt = torch.bincount(ids[i], minlength=n).double().clamp(min=1.0)
            clip = r * cnt * w[i].norm(dim=1).clamp(min=r * math.sqrt(d) * zeta)
            gn = g.norm(dim=1)
            g = g * torch.where(gn > clip, clip / gn, torch.ones_like(gn))[:, None]
            m[i] = B1 * m[i] + (1 - B1) * g
            v[i] = B2 * v[i] + (1 - B2) * g * g
            w[i] = w[i] - lr * (m[i] / (1 - B1**t)) / (v[i].sqrt() / math.sqrt(1 - B2**t) + EPS)
        hist.append(([x.clone() for x in w], [x.clone() for x in m], [x.clone() for x in v]))
    return hist


def _traj_feed(wd, md, w_k, m_k, g, k, c):
    """sum_{j=1..k} b2^(k-j) w_(j-1)^2 along the frozen step's trajectory (module doc), float64;
    None where b2 I - K is singular to working precision."""
    a = 1.0 - (c * (1.0 - B1)) * g
    b = -g * B1
    cc = (1.0 - B1) * c
    d = B1
    # K (y = (w^2, wm, m^2)); M = (b2 I - K)^T, solve M z = e1 by Cramer's rule
    k11, k12, k13 = a * a, 2 * a * b, b * b
    k21, k22, k23 = a * cc, a * d + b * cc, b * d
    k31, k32, k33 = cc * cc, 2 * cc * d, d * d
    m11, m12, m13 = B2 - k11, -k21, -k31
    m21, m22, m23 = -k12, B2 - k22, -k32
    m31, m32, m33 = -k13, -k23, B2 - k33
    det = m11 * (m22 * m33 - m23 * m32) - m12 * (m21 * m33 - m23 * m31) + m13 * (m21 * m32 - m22 * m31)
    z1 = (m22 * m33 - m23 * m32) / det
    z2 = -(m21 * m33 - m23 * m31) / det
    z3 = (m21 * m32 - m22 * m31) / det
    bk = torch.exp(k * math.log(B2))
    s = z1 * (bk * wd * wd - w_k * w_k) + z2 * (bk * wd * md - w_k * m_k) + z3 * (bk * md * md - m_k * m_k)
    ok = (det.abs() > 1e-12) & torch.isfinite(s) & (s >= 0)
    return s, ok


def traj_block(w, m, v, t0, k, c, lr, b1, b2, eps, keras):
    """The library's block, then its end v from the frozen trajectory and G's mean re-evaluated
    once from it (module doc): the ``traj`` variant's block."""
    from recsys.optim.cowclip import catchup as C

    w_e, m_e, v_e = C._block(w, m, v, t0, k, c, lr, b1, b2, eps, keras)
    if c == 0:
        return w_e, m_e, v_e
    wd, md, vd = w.double(), m.double(), v.double()
    bk = torch.exp(k * math.log(b2))
    half, mid = k / 2, (k + 1) / 2

    def lucas_end(g):
        a11 = 1.0 - (c * (1.0 - b1)) * g
        u_k, v_k = C._lucas(a11 + b1, k, b1)
        n11 = (a11 - b1) * 0.5
        return v_k * 0.5 * wd + u_k * (n11 * wd - (g * b1) * md), v_k * 0.5 * md + u_k * (((1.0 - b1) * c) * wd - n11 * md)

    def g_of(feed):  # lr * mean G at the 2 Gauss-Legendre nodes, the feed spread as if uniform
        out = torch.zeros_like(wd)
        for x in (mid - half * C._GL, mid + half * C._GL):
            bx = torch.exp(x * math.log(b2))
            vx = (bx * vd + feed * (1 - bx) / (1 - bk)).clamp(min=0)
            t = t0 + x
            bc1, bc2 = -torch.expm1(t * math.log(b1)), -torch.expm1(t * math.log(b2))
            out += bc2.sqrt() / (bc1 * (vx.sqrt() + eps)) if keras else 1.0 / (bc1 * (vx.sqrt() / bc2.sqrt() + eps))
        return (0.5 * lr * out).clamp(max=2.0 * (1.0 + b1) / ((1.0 - b1) * c))

    # g the library used, recovered from its straight-path v: re-derive it as the library does
    g0 = _library_g(w, m, v, t0, k, c, lr, b1, b2, eps, keras)
    w_k, m_k = lucas_end(g0)
    s, ok = _traj_feed(wd, md, w_k, m_k, g0, k, c)
    feed = (1 - b2) * c * c * s
    g1 = torch.where(ok, g_of(torch.where(ok, feed, torch.zeros_like(feed))), g0)
    w_k, m_k = lucas_end(g1)
    s, ok2 = _traj_feed(wd, md, w_k, m_k, g1, k, c)
    v_k = bk * vd + (1 - b2) * c * c * s
    ok2 = ok & ok2
    return (
        torch.where(ok2, w_k.float(), w_e),
        torch.where(ok2, m_k.float(), m_e),
        torch.where(ok2, v_k.float(), v_e),
    )


def _library_g(w, m, v, t0, k, c, lr, b1, b2, eps, keras):
    """g = lr * mean G of the library's _block (straight predicted w path), float64."""
    from recsys.optim.cowclip import catchup as C

    ww = w * w
    d = torch.addcmul(-v, ww, torch.tensor(c * c, dtype=w.dtype))
    w1, _, _ = C._exact_step(w, m, v, t0 + 1, c, lr, b1, b2, eps, keras)
    sp = w1 - w
    lim = w.abs() * (1 / k).float()
    sp = torch.where(sp * w < 0, torch.minimum(torch.maximum(sp, -lim), lim), sp)
    half, mid = k / 2, (k + 1) / 2
    g = C._g_path(v, d, w * sp, sp * sp, mid - half * C._GL, t0, c, b1, b2, eps, keras)
    g = (g + C._g_path(v, d, w * sp, sp * sp, mid + half * C._GL, t0, c, b1, b2, eps, keras)).double() * (0.5 * lr)
    return g.clamp(max=2.0 * (1.0 + b1) / ((1.0 - b1) * c))


def catch_up_variant(w, m, v, row_step, step, *, lr, l2, variant: str, growth: float = 2.0):
    """The schedule (blocks 1, 2, 4, ..., each cut to what is left and, unless ``uncapped``, to
    ``bias_cap``) row by row, advanced by the library's or the ``traj`` block; returns (w, pieces)."""
    from recsys.optim.cowclip import catchup as C

    if variant == "library":  # the library itself (its pieces counted by the loop below)
        out = C.catch_up(w, m, v, row_step, step, lr=lr, betas=(B1, B2), eps=EPS, eps_mode="torch", l2=l2, growth=growth)[0]
        return out, catch_up_variant(w, m, v, row_step, step, lr=lr, l2=l2, variant="count", growth=growth)[1]
    block = traj_block if variant.endswith("traj") else C._block
    c = 2.0 * l2
    gap = (step - row_step.long()).clamp(min=0).to(torch.float64).unsqueeze(1)
    w, m, v = w.float().clone(), m.float().clone(), v.float().clone()
    done = torch.zeros_like(gap)
    t0 = row_step.long().to(torch.float64).unsqueeze(1)
    size, pieces = 1.0, 0
    while bool((done < gap).any()):
        k = torch.clamp(gap - done, max=float(int(size)))
        if not variant.startswith("uncapped"):
            k = torch.minimum(k, C.bias_cap(t0 + done, B1, B2))
        k = k.clamp(min=0)
        ex, bl = (k == 1).squeeze(1), (k >= 2).squeeze(1)
        if variant != "count":
            if bool(ex.any()):
                w[ex], m[ex], v[ex] = C._exact_step(w[ex], m[ex], v[ex], t0[ex] + done[ex] + 1, c, lr, B1, B2, EPS, False)
            if bool(bl.any()):
                w[bl], m[bl], v[bl] = block(w[bl], m[bl], v[bl], t0[bl] + done[bl], k[bl], c, lr, B1, B2, EPS, False)
        pieces += int((k > 0).sum())
        done = done + k
        size *= growth
    return w, pieces


def run_cell(bs, *, lr: float, l2: float, zeta: float, variants) -> list[dict]:
    hist = dense_history(bs, lr=lr, l2=l2, zeta=zeta)
    res = {x: {"worst_ratio": 1.0, "rows_over_1_05": 0, "worst_w_err_lr": 0.0, "pieces": 0, "gaps": 0} for x in variants}
    for i, (n, d) in enumerate(TABLES):
        floor = math.sqrt(d) * zeta
        by_end: dict[int, list[tuple[int, int]]] = {}
        last = [0] * n
        for t, (ids, _l) in enumerate(bs, 1):
            for k in sorted(set(ids[i].tolist())):
                if t - 1 - last[k] >= 2:
                    by_end.setdefault(t - 1, []).append((k, last[k]))
                last[k] = t
        for end, rows in by_end.items():
            ks = torch.tensor([k for k, _ in rows])
            starts = torch.tensor([s for _, s in rows])
            w0, m0, v0 = (torch.stack([hist[s][j][i][k] for k, s in rows]).float() for j in range(3))
            want = hist[end][0][i][ks]
            for x in variants:
                got, pieces = catch_up_variant(w0, m0, v0, starts, end, lr=lr, l2=l2, variant=x)
                r = got.double().norm(dim=1).clamp(min=floor) / want.norm(dim=1).clamp(min=floor)
                r = torch.maximum(r, 1 / r)
                e = res[x]
                e["worst_ratio"] = max(e["worst_ratio"], float(r.max()))
                e["rows_over_1_05"] += int((r > 1.05).sum())
                e["worst_w_err_lr"] = max(e["worst_w_err_lr"], float((got.double() - want).abs().max()) / lr)
                e["pieces"] += pieces
                e["gaps"] += len(rows)
    return [
        {"lr": lr, "l2": l2, "zeta": zeta, "variant": x, **{k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()}}
        for x, e in res.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    ap.add_argument("--l2", type=float, nargs="+", default=[1e-5, 1e-3, 1e-2])
    ap.add_argument("--zeta", type=float, nargs="+", default=[1e-5, 1e-2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    bs = batches(args.steps)
    summary: dict[str, dict] = {}
    for lr in args.lr:
        for l2 in args.l2:
            for zeta in args.zeta:
                for row in run_cell(bs, lr=lr, l2=l2, zeta=zeta, variants=args.variants):
                    print(json.dumps(row), flush=True)
                    s = summary.setdefault(
                        row["variant"], {"worst_ratio": 1.0, "rows_over_1_05": 0, "worst_w_err_lr": 0.0, "pieces_per_gap": []}
                    )
                    s["worst_ratio"] = max(s["worst_ratio"], row["worst_ratio"])
                    s["rows_over_1_05"] += row["rows_over_1_05"]
                    s["worst_w_err_lr"] = max(s["worst_w_err_lr"], row["worst_w_err_lr"])
                    s["pieces_per_gap"].append(row["pieces"] / max(row["gaps"], 1))
    for s in summary.values():
        s["pieces_per_gap"] = round(sum(s["pieces_per_gap"]) / len(s["pieces_per_gap"]), 2)
    print(json.dumps({"summary": summary, "steps": args.steps}))


if __name__ == "__main__":
    main()
