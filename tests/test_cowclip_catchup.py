"""Catch-up of absent rows (recsys/optim/cowclip_catchup.py, CowClipAdamTBE update_scope="catchup")
against the reference's dense semantics: the project's dense formula
(``cowclip_adam_step(update_scope="all", l2_scope="all")``, itself tested against a per-row loop in
test_cowclip_math.py) and the TBE's dense pass (``update_scope="all"``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from recsys.optim.cowclip import CowClipAdamState, cowclip_adam_step
from recsys.optim.cowclip_catchup import (
    ERR_M_CLR, ERR_M_REL, ERR_V_C2LR2, ERR_V_REL, ERR_W_LR, ERR_W_REL, catch_up, dense_l2_steps,
)
from recsys.optim.cowclip_tbe import CowClipAdamTBE, CowClipHyper

B1, B2 = 0.9, 0.999
D = 8
GAPS = [1, 2, 3, 5, 17, 100, 333, 1000, 3000]
TINY = 1e-30  # float32 underflow: moments decayed below this are 0 here, not in the float64 oracle


def _empty_batch(dim: int, bags: int = 2):
    return (torch.zeros(0, dtype=torch.long), torch.zeros(bags + 1, dtype=torch.long), torch.zeros(bags, dim))


def _start_state(lr: float, l2: float, t0: int, data: float, rows: int, seed: int):
    """Rows of std 1e-2 whose moments hold either the L2 equilibrium (data=0) or data gradients
    ``data`` times the L2 gradient (1e-4 when l2=0), bias-scaled as after t0 steps."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, D, generator=g, dtype=torch.float64) * 1e-2
    c = 2 * l2
    if data:
        scale = data * c * 1e-2 if c else 1e-4
        grad = torch.randn(rows, D, generator=g, dtype=torch.float64) * scale
        m, v = (1 - B1**t0) * grad, (1 - B2**t0) * grad * grad
    else:
        m, v = c * w, (1 - B2**t0) * (c * w) ** 2
    return w, m, v


def test_exact_iteration_is_the_dense_reference():
    """``dense_l2_steps`` (the oracle of the sweep below) equals the project's dense formula with
    batches that contain no row, over 300 steps, both eps modes, from a late global step."""
    for eps_mode, eps, l2 in (("torch", 1e-8, 1e-3), ("keras", 1e-7, 1e-5), ("torch", 1e-8, 0.0)):
        w, m, v = _start_state(1e-3, l2, 40, 100.0, 6, seed=1)
        ref_w, st = w.clone(), CowClipAdamState(m.clone(), v.clone(), torch.full((6,), 40), torch.tensor(40))
        for _ in range(300):
            cowclip_adam_step(ref_w, st, *_empty_batch(D), lr=1e-3, eps=eps, l2=l2, r=1.0, zeta=1e-5,
                              update_scope="all", l2_scope="all", eps_mode=eps_mode)
        ours = dense_l2_steps(w, m, v, torch.full((6,), 40), 340, lr=1e-3, betas=(B1, B2), eps=eps,
                              eps_mode=eps_mode, l2=l2)
        for a, b in zip(ours, (ref_w, st.exp_avg, st.exp_avg_sq)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("lr,l2,eps_mode", list(itertools.product(
    [1e-4, 1e-3, 1e-2], [0.0, 1e-5, 1.28e-3], ["torch", "keras"])))
def test_catch_up_within_the_stated_bound_over_long_gaps(lr, l2, eps_mode):
    """Gaps of 1 to 3000 steps, gap starts at global steps 1, 50 and 2000, moments at the L2
    equilibrium or holding data gradients 100x the L2 gradient: every coordinate of w, m and v
    within the bound the module docstring states; a 1-step gap is the exact step."""
    eps = 1e-8 if eps_mode == "torch" else 1e-7
    c = 2 * l2
    kw = dict(lr=lr, betas=(B1, B2), eps=eps, eps_mode=eps_mode, l2=l2)
    for t0, data in itertools.product([1, 50, 2000], [0.0, 100.0]):
        w0, m0, v0 = _start_state(lr, l2, t0, data, 16, seed=t0 + int(data))
        start = torch.full((16,), t0)
        wd, md, vd, prev = w0, m0, v0, 0
        for n in GAPS:
            wc, mc, vc = catch_up(w0.float(), m0.float(), v0.float(), start, t0 + n, **kw)
            # the oracle, continued from the previous gap's end (float64)
            wd, md, vd = dense_l2_steps(wd, md, vd, torch.full((16,), t0 + prev), t0 + n, **kw)
            prev = n
            move = (wd - w0).abs()
            err_w = (wc.double() - wd).abs()
            assert bool((err_w <= ERR_W_LR * lr + ERR_W_REL * move).all()), (t0, data, n, float(err_w.max()))
            m_scale = m0.abs() * B1**n + c * wd.abs()
            err_m = (mc.double() - md).abs()
            assert bool((err_m <= ERR_M_CLR * c * lr + ERR_M_REL * m_scale + 1e-6 * md.abs() + TINY).all()), (t0, data, n)
            err_v = (vc.double() - vd).abs()
            assert bool((err_v <= ERR_V_C2LR2 * (c * lr) ** 2 + ERR_V_REL * vd + 1e-6 * vd + TINY).all()), (t0, data, n)
            if n == 1:  # one block of one step: the exact step
                torch.testing.assert_close(wc.double(), wd, rtol=1e-5, atol=1e-5 * lr)


def test_rows_with_different_gaps_in_one_call_equal_separate_calls():
    """Rows are sorted by gap and processed as prefixes: a row's result does not depend on the
    other rows of the call (bit-identical to calling it alone)."""
    kw = dict(lr=1e-3, betas=(B1, B2), eps=1e-8, eps_mode="keras", l2=1e-4)
    w0, m0, v0 = (x.float() for x in _start_state(1e-3, 1e-4, 10, 100.0, len(GAPS), seed=5))
    row_step = torch.tensor([4000 - n for n in GAPS])[torch.randperm(len(GAPS))]
    together = catch_up(w0, m0, v0, row_step, 4000, **kw)
    for i in range(len(GAPS)):
        alone = catch_up(w0[i : i + 1], m0[i : i + 1], v0[i : i + 1], row_step[i : i + 1], 4000, **kw)
        for a, b in zip(together, alone):
            assert torch.equal(a[i : i + 1], b)


def test_catch_up_growth_one_is_the_exact_iteration_and_current_rows_are_untouched():
    w0, m0, v0 = (x.float() for x in _start_state(1e-3, 1e-4, 10, 100.0, 5, seed=3))
    rs = torch.tensor([10, 7, 12, 0, 12])
    kw = dict(lr=1e-3, betas=(B1, B2), eps=1e-8, eps_mode="torch", l2=1e-4)
    got = catch_up(w0, m0, v0, rs, 12, growth=1.0, **kw)
    want = dense_l2_steps(w0.double(), m0.double(), v0.double(), rs, 12, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-10)
    for a, b in zip(got, (w0, m0, v0)):  # rows 2 and 4 are current: bit-identical
        assert torch.equal(a[[2, 4]], b[[2, 4]])


# ---- the TBE ----------------------------------------------------------------------------------

def _tbe(scope: str, growth: float = 2.0, lr: float = 0.01, l2: float = 0.05, eps_mode: str = "torch"):
    hp = CowClipHyper(learning_rate=lr, l2=l2, cowclip_r=1.0, cowclip_zeta=0.05, update_scope=scope,
                      eps_mode=eps_mode)
    tbe = CowClipAdamTBE([(30, 8), (200, 4)], [0, 1], hp, full_dims=[8, 4], mode="inline", catchup_growth=growth)
    tbe.weights.copy_(torch.randn(tbe.weights.numel(), generator=torch.Generator().manual_seed(3)) * 0.05)
    return tbe


def _sparse_batches(steps: int, seed: int = 4):
    """6 samples, 2 features; table 1 has 200 rows and ids from a long tail, so most rows are
    absent for tens to hundreds of steps between their occurrences."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 3, (2 * 6,), generator=g)
        ids = []
        for i, n in enumerate(lengths):
            hi = 30 if i < 6 else 200
            ids.append((torch.rand(int(n), generator=g) ** 3 * hi).long())
        idx = torch.cat(ids)
        off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        out.append((idx, off, torch.randn(6, 12, generator=g)))
    return out


def _train(tbes, batches):
    outs = []
    for idx, off, go in batches:
        step_outs = [t(idx, off) for t in tbes]
        outs.append([o.detach().clone() for o in step_outs])
        for o in step_outs:
            o.backward(go)
    return outs


@pytest.mark.parametrize("eps_mode", ["torch", "keras"])
def test_tbe_catchup_exact_growth_equals_the_dense_pass(eps_mode):
    """With growth 1 (exact iteration) the catch-up TBE's lookups, weights and moments equal the
    dense pass (update_scope="all") over 80 steps; after catch_up_all every row is at step 80."""
    dense, lazy = _tbe("all", eps_mode=eps_mode), _tbe("catchup", growth=1.0, eps_mode=eps_mode)
    outs = _train([dense, lazy], _sparse_batches(80))
    for od, oc in outs:
        torch.testing.assert_close(oc, od, rtol=1e-5, atol=1e-6)
    assert int((lazy.row_step < 80).sum()) > 100  # most rows were behind before catch_up_all
    assert lazy.catch_up_all() > 100
    assert lazy.row_step.eq(80).all() and dense.row_step.eq(80).all()
    for a, b in ((lazy.weights, dense.weights), (lazy.momentum1, dense.momentum1), (lazy.momentum2, dense.momentum2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert lazy.catch_up_all() == 0


@pytest.mark.parametrize("lr,l2", [(1e-4, 1e-5), (1e-3, 1.28e-3)])
def test_tbe_catchup_default_blocks_stay_close_to_the_dense_pass(lr, l2):
    """Default blocks (growth 2), 300 steps of training with rows coming back after long gaps
    (errors of a gap carry into the row's later data steps): every weight within 8 lr of the
    dense pass (measured: 5.7 lr at lr 1e-4, mean 0.6 lr), every lookup within 16 lr (a bag sums
    up to 2 rows), while lazy Adam (update_scope="batch") ends more than 20x further away."""
    dense, cu, lazy = _tbe("all", lr=lr, l2=l2), _tbe("catchup", lr=lr, l2=l2), _tbe("batch", lr=lr, l2=l2)
    outs = _train([dense, cu, lazy], _sparse_batches(300))
    cu.catch_up_all()
    err = float((cu.weights - dense.weights).abs().max())
    lazy_err = float((lazy.weights - dense.weights).abs().max())
    assert err <= 8 * lr, err / lr
    assert lazy_err > 20 * err, (lazy_err / lr, err / lr)
    worst_lookup = max(float((oc - od).abs().max()) for od, oc, _ in outs)
    assert worst_lookup <= 16 * lr, worst_lookup / lr


def test_tbe_catchup_resume_from_state_is_bit_identical():
    """A checkpoint taken without catch_up_all (rows behind) and restored into a fresh TBE with the
    step set (what the training loop's set_optimizer_step does) continues bit-identically; one
    taken after catch_up_all restores without being told the step (row_step carries it)."""
    batches = _sparse_batches(60, seed=9)
    a = _tbe("catchup")
    _train([a], batches[:30])
    for caught_up in (False, True):
        if caught_up:
            a.catch_up_all()
        b = _tbe("catchup")
        for name in ("weights", "momentum1", "momentum2", "row_step"):
            getattr(b, name).copy_(getattr(a, name))
        if not caught_up:
            b.set_optimizer_step(30)
        a2 = _tbe("catchup")
        for name in ("weights", "momentum1", "momentum2", "row_step"):
            getattr(a2, name).copy_(getattr(a, name))
        a2.set_optimizer_step(30)
        _train([a2, b], batches[30:])
        assert b.dense_step() == a2.dense_step() == 60
        for name in ("weights", "momentum1", "momentum2", "row_step"):
            assert torch.equal(getattr(a2, name), getattr(b, name)), name
    assert [set(s) for s in a.get_optimizer_state()] == [{"exp_avg", "exp_avg_sq", "row_step"}] * 2


def test_catchup_rejections():
    with pytest.raises(ValueError, match=r"CowClip catch-up assumes 2\*l2 < cowclip_r \(l2=0.6, r=1.0\)"):
        _tbe("catchup", l2=0.6)
    hp = CowClipHyper(l2=1e-5, update_scope="catchup")
    with pytest.raises(NotImplementedError, match="update_scope='catchup' needs table-wise, row-wise or table-row-wise"):
        CowClipAdamTBE([(10, 4)], [0], hp, full_dims=[8], mode="deferred")
    with pytest.raises(ValueError, match="update_scope must be batch\\|all\\|catchup, got 'dense'"):
        CowClipHyper.from_fused_params({"optimizer": "recsys.cowclip_adam", "update_scope": "dense"})
    with pytest.raises(ValueError, match="growth must be >= 1"):
        catch_up(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), 3, lr=1.0,
                 betas=(B1, B2), eps=1e-8, eps_mode="torch", l2=0.0, growth=0.5)
