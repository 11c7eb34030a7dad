"""Catch-up of rows absent from batches: the reference's dense CowClip-Adam semantics at the cost
of the lazy kernel.

The reference (bytedance/LargeBatchCTR) puts ``l2 * sum ||w||^2`` into the loss and runs a dense
tf.keras Adam, so EVERY row moves at EVERY step. For a row absent from the batch the gradient is
the L2 term alone, ``g = c * w`` with ``c = 2 * l2``, its count is 1, and its clip
``r * max(||w||, zeta')`` is never reached when ``2 * l2 < r`` (then ``||g|| = 2*l2*||w|| < r*||w||``
and ``< r*zeta'`` below the floor). So per coordinate, independently, an absent row follows::

    m_t = b1 m_{t-1} + (1-b1) c w_{t-1}
    v_t = b2 v_{t-1} + (1-b2) c^2 w_{t-1}^2
    w_t = w_{t-1} - lr * G_t(v_t) * m_t        with the GLOBAL step t in the bias corrections:
    G_t = 1 / (bc1_t * (sqrt(v_t / bc2_t) + eps))          eps_mode="torch"
    G_t = sqrt(bc2_t) / (bc1_t * (sqrt(v_t) + eps))        eps_mode="keras"
    bc1_t = 1 - b1^t,  bc2_t = 1 - b2^t

(``l2 = 0`` included: the row still coasts on its momentum and its moments still decay.)
Iterating that costs O(n) per coordinate for a gap of n steps; summed over training this is the
dense pass. Instead, a row that was last current at global step ``s`` and is needed at step
``s + n`` is advanced in **blocks** of k steps whose nominal size grows by ``growth`` (default 2:
1, 2, 4, 8, ...), the last block cut to what is left, so a gap of n costs about ``log2(n) + 1``
block evaluations. Early in training a block is also cut to ``bias_cap`` (about ``0.2 t`` steps
at global step t below a few hundred; none past a few thousand): there Adam's bias corrections
move G along the block, and a frozen step misses that (see ``bias_cap``). A gap from step 0 to
step 5,500 takes about 60 pieces instead of 13; in the steady state of tools/bench/catchup.py
(raw Criteo sizes, step 5,500) the rows behind take 7.5% more pieces. Inside a block starting
at (w, m, v):

* **The w path the block's first step predicts.** The block's first step is taken exactly, and
  its displacement s, continued over the block (stopped at 0 when it moves toward 0), gives v at
  any step x of the block in closed form: ``v_x = b2^x v + c^2 EMA_x((w + (j-1) s)^2)``. Why: a
  row that L2 pulls from far away (|w| of hundreds of lr, v fed by its own c^2 w^2) descends by
  about lr per step, and its v falls with it; freezing w in v had such rows descend too slowly,
  up to 0.7 lr per gap, errors that add up over a row's gaps (2.8 lr after 300 steps of
  tests/integration/cowclip/test_cowclip_catchup.py's training test, with blocks growing by sqrt(2); with the
  predicted path and doubling blocks 0.4 lr).
* **One frozen step, raised to the k-th power.** With Adam's factor G frozen at its mean over the
  block (``g = lr * mean_j G_j``, G at the 2-node Gauss-Legendre points of [0.5, k+0.5] with v
  there as above), one step is linear in (w, m)::

      (w, m) <- A (w, m),   A = [[1 - h(1-b1), -g b1], [(1-b1) c, b1]],   h = c g

  with trace ``P = 1 + b1 - h(1-b1)`` and determinant ``b1``. By Cayley-Hamilton
  ``A^k = (V_k / 2) I + U_k (A - (P/2) I)``, with the Lucas sequences ``U_n = (l1^n - l2^n)/(l1 - l2)``,
  ``V_n = l1^n + l2^n`` of A's eigenvalues, computed by binary doubling (``_lucas``: about log2(k)
  rounds of a few multiplications, in float64, no special case for real, double or complex
  eigenvalues). Why: an absent row's dynamics has three regimes besides the descent above, and
  this covers the two an exponential integrator (``w e^{-lam}``) gets wrong. (1) v holds old
  data gradients, h is tiny, A's eigenvalues are ~1-h and ~b1: a slow decay (any integrator does well). (2) v is small
  (a row never touched, or v decayed), so h is of order 1 and the eigenvalues are complex, of
  modulus sqrt(b1) whatever h is: the row oscillates around 0 with a period set by h and an
  amplitude that shrinks by sqrt(b1) = 0.95 per step. The exponential decays at rate h per step
  instead: at lr 1e-2 a row absent for the first 56 steps of training came back with ||w|| 77x
  too small, and CowClip's next clip threshold, proportional to max(||w||, zeta'), with it.
  (3) h above the period-2 limit ``2(1+b1)/(1-b1)``: the frozen step grows without bound, where
  the real dynamics feeds v from w^2 and settles on a period-2 cycle of amplitude ~(1-b1)/(2(1+b1)) lr; h is capped
  there (spectral radius 1).
* **v at the block end** in closed form for a w that moves linearly from w to w' inside the block
  (EMAs of j and j^2 have closed forms), so the block's w history feeds the second moment.

A block of one step is the exact step (explicit update, exact moments); gaps of 1 step are exact
to float rounding.

**Error bound (measured, tests/integration/cowclip/test_cowclip_catchup.py).** Against the exact iteration (itself
equal to the project's dense formula ``cowclip_adam_step(update_scope="all", l2_scope="all")``
with batches that contain no row) over gaps n = 1 .. 3000, lr in {1e-4, 1e-3, 1e-2}, l2 in
{0, 1e-5, 1.28e-3}, both eps modes, gaps starting at global steps 1, 50 and 2000, and moments at
the L2 equilibrium or holding data gradients 100x the L2 gradient, every coordinate satisfies

    |w - w_dense| <= ERR_W_LR * lr + ERR_W_REL * |w_dense - w_start|
    |m - m_dense| <= ERR_M_CLR * c * lr + ERR_M_REL * (|m_start| * b1^n + c * |w_dense|)
    |v - v_dense| <= ERR_V_C2LR2 * (c * lr)^2 + ERR_V_REL * v_dense

(constants below; at most 57%, 16% and 8% of them is used). This is a measured bound, not a
proof. Through training, against an independent float64 reference written from the paper code's
semantics (tests/integration/cowclip/test_cowclip_catchup_reference.py: lr 1e-4 to 1e-2, l2 1e-5 to 1e-2, zeta 1e-5
and 1e-2, 300 steps, rows absent for up to ~280 steps; 1,571 gaps per case): every gap, started
from the reference's state, ends within 0.17 lr of it (0.04 lr at lr 1e-4 and 1e-3), and the
norm the next clip reads within 5% of the reference's on all but 2 gaps of one case (lr 1e-2, l2
1e-2, zeta 1e-5: 1.22x, 0.054 lr, rows oscillating around 0 near the lr scale, where a block's v
at its end, from a straight w path, misses what the oscillation feeds it; tools/experiments/catchup_blocks.py
measures a fix); the trained tables end within 0.04-0.14 lr of the reference (0.02-0.21 lr under
table-, row-, table-row-, column-wise and data-parallel sharding on 1 and 2 ranks). One case,
lr 1e-2, l2 1e-3, zeta 1e-5, amplifies any difference (the clip threshold is proportional to
||w||): moving the reference's initial weights by 0.01 lr moves its final ones by 0.9-1.35 lr;
the catch-up ends 0.66 lr away there.
The exact iteration is ``growth=1`` (every block one step), at O(gap) cost.

Not covered: an embedding lr that changes during a gap (the catch-up applies the current lr to
the whole gap; the CowClip rule keeps the embedding lr constant, warm-up acts on the dense lr).

Bookkeeping (``CowClipAdamTBE`` with ``update_scope="catchup"``): ``row_step[k]`` is the global
step up to which row k is current; a row caught up to step S gets ``row_step = S``, so the existing lazy kernel's ``t = row_step + 1``
is then the global step of the dense reference, with no change to the kernel or to the state dict
(checkpoints keep their keys; a row saved behind is caught up when next touched).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "BIAS_CAP",
    "DEFAULT_GROWTH",
    "ERR_M_CLR",
    "ERR_M_REL",
    "ERR_V_C2LR2",
    "ERR_V_REL",
    "ERR_W_LR",
    "ERR_W_REL",
    "catch_up",
    "bias_cap",
    "catch_up_all_tables",
    "check_catchup_hyper",
    "dense_l2_steps",
]

# the bound of the module docstring (asserted by tests/integration/cowclip/test_cowclip_catchup.py; the worst
# coordinates use 57% (w), 16% (m) and 8% (v) of it)
ERR_W_LR, ERR_W_REL = 1.5, 0.05
ERR_M_CLR, ERR_M_REL = 0.5, 0.05
ERR_V_C2LR2, ERR_V_REL = 0.5, 0.1

_GL = 1.0 / math.sqrt(3.0)  # 2-node Gauss-Legendre on [-1, 1]: nodes +-1/sqrt(3), weights 1
# block sizes double (1, 2, 4, ...): about log2(n) + 1 blocks for a gap of n (growth 4 breaks the
# per-gap bound on v: benchmarks/2026-11-29-catchup-step-floor.md)
DEFAULT_GROWTH = 2.0
# no block longer than BIAS_CAP / (the bias corrections' relative change per step): ``bias_cap``
BIAS_CAP = 0.1


def catch_up_all_tables(module: torch.nn.Module) -> int:
    """Call ``catch_up_all()`` on every CowClip table kernel inside ``module`` (a DMP, an EBC, a
    TBE): every row of the ``update_scope="catchup"`` tables is brought to the current step, as
    the dense reference holds it. Call before a checkpoint, an export or a k-step merge reads the
    tables (eval lookups catch up their own rows). Returns the number of rows advanced (local)."""
    done = 0
    for mod in module.modules():
        fn = getattr(mod, "catch_up_all", None)
        if callable(fn):
            done += int(fn())
    return done


def check_catchup_hyper(l2: float, r: float, clip: bool = True) -> None:
    """The catch-up assumes absent rows are never clipped: ``2*l2 < r`` (see the module doc)."""
    if clip and 2 * l2 >= r:
        raise ValueError(f"CowClip catch-up assumes 2*l2 < cowclip_r (l2={l2}, r={r}): absent rows would be clipped")


def _pow(b: float, x: Tensor) -> Tensor:
    """b ** x for a scalar base (one exp instead of pow's scalar-to-tensor round trip)."""
    return torch.exp(x * math.log(b))


def bias_cap(t0: Tensor, b1: float, b2: float) -> Tensor:
    """The longest block that may start at global step ``t0`` (float64, any shape): about
    ``BIAS_CAP`` over the per-step relative change of Adam's bias corrections there,
    ``rate(t) = 0.5 ln(1/b2) / expm1(t ln(1/b2)) + ln(1/b1) / expm1(t ln(1/b1))`` (of sqrt(1 - b2^t)
    and 1 - b1^t; t at least 1), floored, at least 1. Early in training (t of a few hundred
    steps) this is about ``BIAS_CAP * 2t``; past a few thousand steps it exceeds any gap. Why:
    a block freezes Adam's factor G at its mean, and the steps' order matters where G changes
    along the block (the frozen step's matrices do not commute), which it does mostly through
    the bias corrections early on: gaps from the first steps of training (rows not touched
    since the start) ended up to 0.24-0.31 lr off with blocks of 1, 2, 4, ... steps, 0.03-0.04 lr
    with the cap at lr 1e-4 and 1e-3 (tools/experiments/catchup_blocks.py on the gaps of
    tests/integration/cowclip/test_cowclip_catchup_reference.py). The C++ op and the Triton
    kernel use the same formula in double."""
    t = t0.clamp(min=1.0)
    l1, l2 = -math.log(b1), -math.log(b2)
    rate = (0.5 * l2) / torch.expm1(t * l2) + l1 / torch.expm1(t * l1)
    return torch.floor(BIAS_CAP / rate).clamp_(min=1.0)


def _exact_step(
    w: Tensor, m: Tensor, v: Tensor, t: Tensor, c: float, lr: float, b1: float, b2: float, eps: float, keras: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One dense L2-only step at global step t [P, 1] (float64): the exact recursion."""
    m_n = torch.add(m * b1, w, alpha=(1 - b1) * c)
    v_n = torch.addcmul(v * b2, w, w, value=(1 - b2) * c * c)
    bc1 = -torch.expm1(t * math.log(b1))
    bc2 = -torch.expm1(t * math.log(b2))
    if keras:
        step = m_n / (v_n.sqrt() + eps) * (lr * bc2.sqrt() / bc1).float()
    else:
        step = (m_n * (lr / bc1).float()) / (v_n.sqrt() * (1 / bc2.sqrt()).float() + eps)
    return w - step, m_n, v_n


def _ema_lin(b: float, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For an EMA with decay b over y = j-1, j = 1..k (from 0): (sum of weights 1-b^k,
    EMA of y, EMA of y^2), in float64 [P, 1]. EMA_k(f) = sum_j (1-b) b^(k-j) f(j)."""
    bk = _pow(b, k)
    one = 1 - bk
    a = k - b * one / (1 - b)  # EMA of j
    q = k * k - 2 * b / (1 - b) * k + b * (1 + b) / (1 - b) ** 2 * one  # EMA of j^2
    return one, a - one, q - 2 * a + one


def _lucas(p: Tensor, k: Tensor, b1: float) -> tuple[Tensor, Tensor]:
    """(U_k, V_k) of the Lucas sequences U_n(P, Q = b1) = (l1^n - l2^n) / (l1 - l2), l1, l2 the
    roots of l^2 - P l + b1 (the eigenvalues of one frozen step, module doc), for P [R, D] float64
    and integral k [R, 1] >= 2, by the binary doubling rules (U_2n = U_n V_n, V_2n = V_n^2 - 2 Q^n,
    U_2n+1 = (P U_2n + V_2n)/2, V_2n+1 = (Dis U_2n + P V_2n)/2, Dis = P^2 - 4Q): log2(k) rounds of
    a few multiplications, no trigonometry, and no special case for real, double or complex roots;
    V_n = l1^n + l2^n."""
    ki = k.long()
    dis = p * p - 4.0 * b1
    u = torch.zeros_like(p)
    vv = torch.full_like(p, 2.0)  # V_0 = 2
    qn = torch.ones_like(k, dtype=torch.float64)  # Q^n
    for b in range(int(ki.max()).bit_length() - 1, -1, -1):
        u, vv, qn = u * vv, vv * vv - 2.0 * qn, qn * qn  # n -> 2n (U_0 = 0 stays 0 until the first bit)
        one = ((ki >> b) & 1).bool()
        u, vv, qn = (torch.where(one, (p * u + vv) * 0.5, u), torch.where(one, (dis * u + p * vv) * 0.5, vv), torch.where(one, qn * b1, qn))
    return u, vv


def _g_path(
    v: Tensor, d: Tensor, ws: Tensor, ss: Tensor, x: Tensor, t0: Tensor, c: float, b1: float, b2: float, eps: float, keras: bool
) -> Tensor:
    """Adam's factor G at step j = x of a block whose w moves on the predicted linear path
    w + (j-1) s: v_x = b2^x v + c^2 EMA_x((w + (j-1) s)^2) (closed forms of ``_ema_lin``).
    ``d = c^2 w^2 - v``, ``ws = w s``, ``ss = s^2``; x, t0: [P, 1] float64."""
    one, y1, y2 = _ema_lin(b2, x)
    vx = torch.addcmul(v, d, one.float()).addcmul_(ws, (2 * c * c * y1).float()).addcmul_(ss, (c * c * y2).float())
    vx.clamp_(min=0)
    t = t0 + x
    bc1 = -torch.expm1(t * math.log(b1))
    bc2 = -torch.expm1(t * math.log(b2))
    if keras:  # sqrt(bc2) / (bc1 (sqrt(vx) + eps))
        return vx.sqrt_().add_(eps).reciprocal_().mul_((bc2.sqrt() / bc1).float())
    return vx.sqrt_().mul_((bc1 / bc2.sqrt()).float()).add_((bc1 * eps).float()).reciprocal_()


def _block_g(
    w: Tensor, ww: Tensor, m: Tensor, v: Tensor, t0: Tensor, k: Tensor, c: float, lr: float, b1: float, b2: float, eps: float, keras: bool
) -> Tensor:
    """g = lr * mean of Adam's factor G over a block of k [P, 1] steps from t0 [P, 1] (2-node
    Gauss-Legendre, v along the w path the block's first exact step predicts), capped at the
    period-2 limit; float64 [P, D]. ``ww``: w * w. h = c g: one frozen step is (w, m) -> A (w, m),
    A = [[1 - h(1-b1), -g b1], [(1-b1) c, b1]], trace P, determinant b1."""
    d = torch.addcmul(-v, ww, torch.tensor(c * c, dtype=w.dtype))  # c^2 w^2 - v
    # the predicted w path: the block's first (exact) step, continued, stopped at 0
    w1, _, _ = _exact_step(w, m, v, t0 + 1, c, lr, b1, b2, eps, keras)
    sp = w1.sub_(w)
    lim = w.abs().mul_((1 / k).float())
    sp = torch.where(sp * w < 0, torch.minimum(torch.maximum(sp, -lim), lim), sp)
    ws, ss = w * sp, sp * sp
    half = k / 2
    mid = (k + 1) / 2
    g = _g_path(v, d, ws, ss, mid - half * _GL, t0, c, b1, b2, eps, keras)
    g.add_(_g_path(v, d, ws, ss, mid + half * _GL, t0, c, b1, b2, eps, keras))
    g = g.double().mul_(0.5 * lr)
    if c > 0:  # h <= 2(1+b1)/(1-b1): A's spectral radius <= 1 (module doc: the period-2 limit)
        g.clamp_(max=2.0 * (1.0 + b1) / ((1.0 - b1) * c))
    return g


def _frozen_power(wd: Tensor, md: Tensor, g: Tensor, k: Tensor, c: float, b1: float) -> tuple[Tensor, Tensor]:
    """(w, m) float64 [P, D] after k [P, 1] frozen steps with factor g: A^k (w, m) through the
    Lucas sequences of A's eigenvalues (module doc)."""
    a11 = 1.0 - (c * (1.0 - b1)) * g
    u_k, v_k = _lucas(a11 + b1, k, b1)
    # A^k = U_k A - b1 U_{k-1} I (Cayley-Hamilton) = (V_k / 2) I + U_k N with N = A - (P/2) I
    # (V_k = P U_k - 2 b1 U_{k-1}): this form has no cancellation between large terms
    n11 = (a11 - b1) * 0.5
    v_h = v_k * 0.5
    w_e = v_h * wd + u_k * (n11 * wd - (g * b1) * md)
    m_e = v_h * md + u_k * (((1.0 - b1) * c) * wd - n11 * md)
    return w_e, m_e


def _block(
    w: Tensor, m: Tensor, v: Tensor, t0: Tensor, k: Tensor, c: float, lr: float, b1: float, b2: float, eps: float, keras: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Advance rows [P, D] by k [P, 1] (float64, k >= 2; the last block of a row may be shorter)
    dense L2-only steps from global step t0 [P, 1]: the frozen-step matrix power of the module doc."""
    ww = w * w
    g = _block_g(w, ww, m, v, t0, k, c, lr, b1, b2, eps, keras)
    w_e, m_e = _frozen_power(w.double(), m.double(), g, k, c, b1)
    w_e, m_e = w_e.float(), m_e.float()
    s = (w_e - w).mul_((1 / k).float())  # slope of the linear w path inside the block (for v)
    one2, y2a, y2b = _ema_lin(b2, k)
    v_e = ww.mul_((c * c * one2).float()).addcmul_(w * s, (2 * c * c * y2a).float())
    v_e.addcmul_(s * s, (c * c * y2b).float()).addcmul_(v, (1 - one2).float())
    return w_e, m_e, v_e.clamp_(min=0)


def _advance_sorted(w: Tensor, m: Tensor, v: Tensor, gap: Tensor, t0: Tensor, growth: float, hp: tuple) -> None:
    """Rows [R, D] float32, sorted by ``gap`` [R] descending, none of whose blocks ``bias_cap``
    cuts, advanced in place: the rows with steps left are a prefix, so every piece works on
    slices."""
    gap_f = gap.to(torch.float64).unsqueeze(1)
    done, size = 0, 1.0
    max_gap = int(gap[0])
    while done < max_gap:
        k_nom = int(size)
        p = int((gap > done).sum())  # rows with steps left: a prefix (sorted by gap)
        # rows with one step left (a suffix of the prefix) take the exact step, the others a block
        p1 = 0 if k_nom == 1 else int((gap > done + 1).sum())
        if p1 < p:
            sl = slice(p1, p)
            w[sl], m[sl], v[sl] = _exact_step(w[sl], m[sl], v[sl], t0[sl] + (done + 1), *hp)
        if p1 > 0 and k_nom > 1:
            k = torch.clamp(gap_f[:p1] - done, max=k_nom)
            w[:p1], m[:p1], v[:p1] = _block(w[:p1], m[:p1], v[:p1], t0[:p1] + done, k, *hp)
        done += k_nom
        size *= growth


def _advance_capped(w: Tensor, m: Tensor, v: Tensor, gap: Tensor, t0: Tensor, growth: float, hp: tuple, b1: float, b2: float) -> None:
    """Rows [R, D] float32 in any order, advanced in place; each piece cut to ``bias_cap`` at its
    start, so rows fall behind the nominal schedule by different amounts (a step count per row)."""
    gap_f = gap.to(torch.float64).unsqueeze(1)
    done = torch.zeros_like(gap_f)
    size = 1.0
    while True:
        k = torch.minimum(torch.clamp(gap_f - done, max=float(int(size))), bias_cap(t0 + done, b1, b2))
        k.clamp_(min=0)
        one, blk = (k == 1).squeeze(1), (k >= 2).squeeze(1)
        if not bool(one.any()) and not bool(blk.any()):
            break
        if bool(one.any()):
            i = one.nonzero().squeeze(1)
            w[i], m[i], v[i] = _exact_step(w[i], m[i], v[i], t0[i] + done[i] + 1, *hp)
        if bool(blk.any()):
            i = blk.nonzero().squeeze(1)
            w[i], m[i], v[i] = _block(w[i], m[i], v[i], t0[i] + done[i], k[i], *hp)
        done += k
        size *= growth


def catch_up(
    w: Tensor,
    m: Tensor,
    v: Tensor,
    row_step: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    eps_mode: str,
    l2: float,
    growth: float = DEFAULT_GROWTH,
    presorted: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows ``w, m, v`` [R, D] (gathered copies), current at global steps ``row_step`` [R], advanced
    to global step ``step`` by the block scheme of the module doc; returns new (w, m, v).
    Rows with ``row_step >= step`` come back unchanged. No Python loop over rows: one pass of a
    few dozen elementwise ops per piece. Rows whose blocks ``bias_cap`` never cuts (it grows with
    the step: those with ``bias_cap(row_step) >= gap``, nearly all past the first few thousand
    steps) are sorted by gap, so each piece works on a prefix of them; the others go through a
    loop with a step count per row. ``presorted``: the caller already ordered the rows by
    ``row_step`` ascending (gap descending), which saves the permutation gathers when all rows
    are of the first kind, and passes float32 copies it does not need again (they are advanced in
    place and returned)."""
    if eps_mode not in ("torch", "keras"):
        raise ValueError(f"eps_mode must be torch|keras, got {eps_mode!r}")
    if growth < 1.0:
        raise ValueError(f"growth must be >= 1, got {growth}")
    gap = (step - row_step.long()).clamp_(min=0)
    if w.numel() == 0 or int(gap.max()) == 0:
        return w, m, v
    b1, b2 = betas
    hp = (2.0 * l2, lr, b1, b2, eps, eps_mode == "keras")
    t0 = row_step.long().to(torch.float64).unsqueeze(1)
    is_free = bias_cap(t0, b1, b2).squeeze(1) >= gap.to(torch.float64)
    if presorted and bool(is_free.all()):  # the common case: one pass over the caller's copies
        w_s, m_s, v_s = w.float(), m.float(), v.float()
        _advance_sorted(w_s, m_s, v_s, gap, t0, growth, hp)
        return w_s.to(w.dtype), m_s.to(m.dtype), v_s.to(v.dtype)
    free, capped = is_free.nonzero().squeeze(1), (~is_free).nonzero().squeeze(1)
    out_w, out_m, out_v = (x.to(torch.float32, copy=True) for x in (w, m, v))
    if free.numel():
        order = free[torch.argsort(gap[free], descending=True, stable=True)]
        w_s, m_s, v_s = out_w[order], out_m[order], out_v[order]
        _advance_sorted(w_s, m_s, v_s, gap[order], t0[order], growth, hp)
        out_w[order], out_m[order], out_v[order] = w_s, m_s, v_s
    if capped.numel():
        w_s, m_s, v_s = out_w[capped], out_m[capped], out_v[capped]
        _advance_capped(w_s, m_s, v_s, gap[capped], t0[capped], growth, hp, b1, b2)
        out_w[capped], out_m[capped], out_v[capped] = w_s, m_s, v_s
    return out_w.to(w.dtype), out_m.to(m.dtype), out_v.to(v.dtype)


def dense_l2_steps(
    w: Tensor,
    m: Tensor,
    v: Tensor,
    row_step: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    eps_mode: str,
    l2: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The exact iteration of the dense L2-only steps (O(gap) per row): the oracle of ``catch_up``
    for short gaps and what it approximates for long ones. Returns new (w, m, v)."""
    b1, b2 = betas
    c = 2.0 * l2
    w, m, v = w.clone(), m.clone(), v.clone()
    rs = row_step.long()
    for t in range(int(rs.min()) + 1, step + 1):
        act = (rs < t).unsqueeze(1)
        m_n = b1 * m + (1 - b1) * c * w
        v_n = b2 * v + (1 - b2) * (c * c) * w * w
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        if eps_mode == "keras":
            w_n = w - lr * math.sqrt(bc2) / bc1 * (m_n / (v_n.sqrt() + eps))
        else:
            w_n = w - lr * (m_n / bc1) / (v_n.sqrt() / math.sqrt(bc2) + eps)
        w, m, v = torch.where(act, w_n, w), torch.where(act, m_n, m), torch.where(act, v_n, v)
    return w, m, v
