"""Where the CowClip catch-up's per-gap error comes from: block variants on the gaps of a dense
reference run.

The catch-up (recsys/optim/cowclip/catchup.py) advances an absent row over a gap in blocks, each a
frozen Adam step raised to the block's power. This script replays every gap of the dense float64
reference run of tests/integration/cowclip/test_cowclip_catchup_reference.py (its batches,
initial tables and reference, loaded from that module: the gaps are the ones the test asserts on)
from the reference's own state, through block variants, and reports per cell of the grid lr x l2
x zeta the worst
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
import sys
from pathlib import Path

import torch

B1, B2, EPS = 0.9, 0.999, 1e-8
VARIANTS = ("uncapped", "library", "traj", "uncapped+traj")


def reference_test():
    """tests/integration/cowclip/test_cowclip_catchup_reference.py as a module (it imports its
    sibling test module and tests.support by those names)."""
    root = Path(__file__).resolve().parents[2]
    for p in (root, root / "tests" / "integration" / "cowclip"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import test_cowclip_catchup_reference as ref

    assert (ref.B1, ref.B2, ref.EPS) == (B1, B2, EPS), "the reference test's Adam constants changed"
    return ref


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

    def g_of(feed):  # lr * mean G at the 2 Gauss-Legendre nodes, the feed spread as if uniform
        out = torch.zeros_like(wd)
        for x in (mid - half * C._GL, mid + half * C._GL):
            bx = torch.exp(x * math.log(b2))
            vx = (bx * vd + feed * (1 - bx) / (1 - bk)).clamp(min=0)
            t = t0 + x
            bc1, bc2 = -torch.expm1(t * math.log(b1)), -torch.expm1(t * math.log(b2))
            out += bc2.sqrt() / (bc1 * (vx.sqrt() + eps)) if keras else 1.0 / (bc1 * (vx.sqrt() / bc2.sqrt() + eps))
        return (0.5 * lr * out).clamp(max=2.0 * (1.0 + b1) / ((1.0 - b1) * c))

    # the library's g (straight predicted w path), then g again from the trajectory's v
    g0 = C._block_g(w, w * w, m, v, t0, k, c, lr, b1, b2, eps, keras)
    w_k, m_k = C._frozen_power(wd, md, g0, k, c, b1)
    s, ok = _traj_feed(wd, md, w_k, m_k, g0, k, c)
    feed = (1 - b2) * c * c * s
    g1 = torch.where(ok, g_of(torch.where(ok, feed, torch.zeros_like(feed))), g0)
    w_k, m_k = C._frozen_power(wd, md, g1, k, c, b1)
    s, ok2 = _traj_feed(wd, md, w_k, m_k, g1, k, c)
    v_k = bk * vd + (1 - b2) * c * c * s
    ok2 = ok & ok2
    return (
        torch.where(ok2, w_k.float(), w_e),
        torch.where(ok2, m_k.float(), m_e),
        torch.where(ok2, v_k.float(), v_e),
    )


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


def run_cell(ref, bs, init, *, lr: float, l2: float, zeta: float, variants) -> list[dict]:
    _final, hist = ref.tf_dense_reference(init, bs, ref.TABLES, lr=lr, l2=l2, zeta=zeta, history=True)
    res = {x: {"worst_ratio": 1.0, "rows_over_1_05": 0, "worst_w_err_lr": 0.0, "pieces": 0, "gaps": 0} for x in variants}
    for i, (n, d) in enumerate(ref.TABLES):
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
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    ref = reference_test()
    bs, init = ref._batches(args.steps, ref.TABLES, ref.B), ref._init(ref.TABLES)
    summary: dict[str, dict] = {}
    for lr in args.lr:
        for l2 in args.l2:
            for zeta in args.zeta:
                for row in run_cell(ref, bs, init, lr=lr, l2=l2, zeta=zeta, variants=args.variants):
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
