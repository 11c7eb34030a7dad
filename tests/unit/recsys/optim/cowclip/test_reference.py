"""CowClip-Adam math (recsys/optim/cowclip/reference.py) against an independent per-row Python loop in
float64, plus torch.optim.Adam / SparseAdam where the no-clip cases coincide with them."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from recsys.optim.cowclip.reference import (
    CowClipAdamState,
    batch_row_gradients,
    cowclip_adam_step,
    cowclip_clip,
    cowclip_threshold,
)

# ----------------------------------------------------------------------------- loop reference


def _norm(x):
    return math.sqrt(sum(a * a for a in x))


def ref_row_grads(indices, offsets, grad_output, psw):
    """Loops over bags and their ids: {row: (grad list, set of bags)}."""
    out: dict[int, tuple[list[float], set[int]]] = {}
    for b in range(len(offsets) - 1):
        for i in range(offsets[b], offsets[b + 1]):
            k = indices[i]
            wt = 1.0 if psw is None else psw[i]
            g, bags = out.setdefault(k, ([0.0] * len(grad_output[b]), set()))
            for d in range(len(g)):
                g[d] += grad_output[b][d] * wt
            bags.add(b)
    return out


class RefTable:
    """Plain-Python CowClip-Adam on one table (lists of floats, float64 arithmetic)."""

    def __init__(self, weight: torch.Tensor):
        self.W = weight.double().tolist()
        n, d = weight.shape
        self.M = [[0.0] * d for _ in range(n)]
        self.V = [[0.0] * d for _ in range(n)]
        self.RS = [0] * n
        self.GS = 0
        self.last_clip: dict[int, float] = {}

    def step(
        self, indices, offsets, grad_output, psw, lr, betas, eps, r, zeta, l2, clip, update_scope, l2_scope, bias_correction, eps_mode
    ):
        b1, b2 = betas
        n, d = len(self.W), len(self.W[0])
        per_row = ref_row_grads(indices, offsets, grad_output, psw)
        self.GS += 1
        rows = sorted(per_row) if update_scope == "batch" else range(n)
        clipped = 0
        for k in rows:
            present = k in per_row
            g = list(per_row[k][0]) if present else [0.0] * d
            cnt = len(per_row[k][1]) if present else 1
            w = self.W[k]
            if l2 and (present or l2_scope == "all"):
                g = [gi + 2 * l2 * wi for gi, wi in zip(g, w)]
            if clip:
                zeta_p = r * math.sqrt(d) * zeta
                c = r * cnt * max(_norm(w), zeta_p)
                self.last_clip[k] = c
                gn = _norm(g)
                den = max(gn, c)
                if den > 0:
                    g = [gi * c / den for gi in g]
                if present and gn > c:
                    clipped += 1
            self.RS[k] += 1
            t = self.RS[k] if bias_correction == "row" else self.GS
            m, v = self.M[k], self.V[k]
            for i in range(d):
                m[i] = b1 * m[i] + (1 - b1) * g[i]
                v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                if eps_mode == "torch":
                    w[i] -= lr * (m[i] / bc1) / (math.sqrt(v[i]) / math.sqrt(bc2) + eps)
                else:
                    w[i] -= lr * math.sqrt(bc2) / bc1 * m[i] / (math.sqrt(v[i]) + eps)
        return len(per_row), clipped


# ----------------------------------------------------------------------------- random batches


def make_batch(
    rng: random.Random,
    num_rows: int,
    dim: int,
    num_bags: int,
    max_len: int = 4,
    id_range: int | None = None,
    weighted: bool = True,
    grad_scale: float = 0.05,
):
    """Multi-hot bags with repeats inside a bag and across bags, some empty bags."""
    id_range = id_range or num_rows
    lengths = [rng.randint(0, max_len) for _ in range(num_bags)]
    lengths[0] = max(lengths[0], 2)
    if num_bags > 2:
        lengths[1] = 0  # an empty bag
    indices = []
    for n in lengths:
        bag = [rng.randrange(id_range) for _ in range(n)]
        if n >= 2:
            bag[-1] = bag[0]  # a repeat inside the bag
        indices += bag
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    grad_output = [[rng.gauss(0, grad_scale) for _ in range(dim)] for _ in range(num_bags)]
    psw = [rng.uniform(0.2, 2.0) for _ in indices] if weighted else None
    return indices, offsets, grad_output, psw


def as_tensors(batch, dtype):
    indices, offsets, grad_output, psw = batch
    return (
        torch.tensor(indices, dtype=torch.long),
        torch.tensor(offsets, dtype=torch.long),
        torch.tensor(grad_output, dtype=dtype),
        None if psw is None else torch.tensor(psw, dtype=dtype),
    )


def make_weight(gen: torch.Generator, n: int, d: int, dtype) -> torch.Tensor:
    w = torch.randn(n, d, generator=gen, dtype=torch.float64) * 0.02
    w[::5] *= 1e-7  # tiny rows: the zeta' floor is the active bound there
    return w.to(dtype)


# ----------------------------------------------------------------------------- row gradients


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weighted", [False, True])
def test_batch_row_gradients_match_loop(seed, weighted):
    rng = random.Random(seed)
    batch = make_batch(rng, num_rows=30, dim=5, num_bags=9, id_range=8, weighted=weighted)
    idx, off, go, psw = as_tensors(batch, torch.float64)
    rows, grads, counts = batch_row_gradients(idx, off, go, psw, num_rows=30)
    ref = ref_row_grads(*batch)
    assert rows.tolist() == sorted(ref)
    assert counts.tolist() == [len(ref[k][1]) for k in sorted(ref)]
    expect = torch.tensor([ref[k][0] for k in sorted(ref)], dtype=torch.float64)
    torch.testing.assert_close(grads, expect, rtol=1e-12, atol=1e-12)


def test_counts_are_distinct_samples_not_occurrences():
    # bag 0: id 3 three times; bag 1: empty; bag 2: ids 3, 5; bag 3: id 5, 5
    idx = torch.tensor([3, 3, 3, 3, 5, 5, 5])
    off = torch.tensor([0, 3, 3, 5, 7])
    go = torch.arange(8, dtype=torch.float64).reshape(4, 2)
    rows, grads, counts = batch_row_gradients(idx, off, go)
    assert rows.tolist() == [3, 5]
    assert counts.tolist() == [2, 2]
    torch.testing.assert_close(grads, torch.tensor([[3 * 0 + 4, 3 * 1 + 5], [4 + 2 * 6, 5 + 2 * 7]], dtype=torch.float64))


def test_batch_row_gradients_empty_and_bounds():
    rows, grads, counts = batch_row_gradients(torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.randn(3, 6))
    assert rows.shape == (0,) and grads.shape == (0, 6) and counts.shape == (0,)
    with pytest.raises(ValueError, match="out of range"):
        batch_row_gradients(torch.tensor([0, 7]), torch.tensor([0, 1, 2]), torch.randn(2, 3), num_rows=7)
    with pytest.raises(ValueError, match="bags"):
        batch_row_gradients(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.randn(2, 3))


# ----------------------------------------------------------------------------- clipping


def test_clip_matches_formula_and_loop():
    gen = torch.Generator().manual_seed(0)
    w = make_weight(gen, 40, 6, torch.float64)
    g = torch.randn(40, 6, generator=gen, dtype=torch.float64) * 0.05
    cnt = torch.randint(1, 4, (40,), generator=gen)
    r, zeta = 1.5, 1e-5
    out = cowclip_clip(g, w, cnt, r=r, zeta=zeta)
    n_clipped = 0
    for k in range(40):
        c = r * int(cnt[k]) * max(_norm(w[k].tolist()), r * math.sqrt(6) * zeta)
        gn = _norm(g[k].tolist())
        expect = [x * c / max(gn, c) for x in g[k].tolist()]
        torch.testing.assert_close(out[k], torch.tensor(expect, dtype=torch.float64), rtol=1e-12, atol=1e-15)
        n_clipped += gn > c
    assert 0 < n_clipped < 40  # both branches exercised


def test_zeta_floor_is_the_clip_value_for_tiny_weights():
    d, r, zeta = 9, 2.0, 1e-5
    w = torch.full((3, d), 1e-12, dtype=torch.float64)
    cnt = torch.tensor([1, 2, 5])
    zeta_p = r * math.sqrt(d) * zeta
    clip_t = cowclip_threshold(w, cnt, r=r, zeta=zeta)
    torch.testing.assert_close(clip_t, r * cnt.double() * zeta_p, rtol=1e-12, atol=0)
    g = torch.ones(3, d, dtype=torch.float64)  # far above the bound: clipped onto it
    out = cowclip_clip(g, w, cnt, r=r, zeta=zeta)
    torch.testing.assert_close(out.norm(dim=1), r * cnt.double() * zeta_p, rtol=1e-12, atol=0)


def test_zero_gradients_stay_zero_without_nan():
    w = torch.zeros(4, 3, dtype=torch.float64)
    g = torch.zeros(4, 3, dtype=torch.float64)
    for zeta in (1e-5, 0.0):  # zeta=0 and w=0: clip = 0 and ||g|| = 0
        out = cowclip_clip(g, w, torch.ones(4, dtype=torch.long), zeta=zeta)
        assert torch.equal(out, g)
    # clip = 0 but ||g|| > 0: the formula clips to zero, still no NaN
    out = cowclip_clip(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, dtype=torch.long), zeta=0.0)
    assert torch.equal(out, torch.zeros(2, 3))


# ----------------------------------------------------------------------------- CowClip-Adam vs loop

CONFIGS = [
    # update_scope, l2_scope, clip, bias_correction, eps_mode
    ("batch", "batch", True, "row", "torch"),
    ("batch", "batch", True, "global", "torch"),
    ("batch", "batch", True, "row", "keras"),
    ("batch", "batch", False, "row", "torch"),
    ("all", "all", True, "global", "keras"),  # the reference's semantics
    ("all", "batch", True, "global", "torch"),
    ("all", "all", False, "row", "torch"),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_adam_steps_match_loop(cfg, dtype, tol):
    update_scope, l2_scope, clip, bias_correction, eps_mode = cfg
    n, d = 24, 4
    rng = random.Random(hash(cfg) % 1000)
    gen = torch.Generator().manual_seed(1)
    weight = make_weight(gen, n, d, dtype)
    ref = RefTable(weight)
    state = CowClipAdamState.zeros_like(weight)
    hp = dict(
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        r=1.5,
        zeta=1e-5,
        l2=1e-2,
        clip=clip,
        update_scope=update_scope,
        l2_scope=l2_scope,
        bias_correction=bias_correction,
        eps_mode=eps_mode,
    )
    total_clipped = 0
    for step in range(5):
        # rows 0..id_range-1 only, varying per step: some rows skip steps (row != global step)
        batch = make_batch(rng, n, d, num_bags=8, id_range=[24, 10, 16, 6, 20][step], grad_scale=0.05)
        stats = cowclip_adam_step(weight, state, *as_tensors(batch, dtype), **hp)
        u, c = ref.step(*batch, **hp)
        assert stats.unique_rows == u
        assert int(stats.clipped_rows) == c
        assert float(stats.clipped_fraction) == pytest.approx(c / u)
        total_clipped += c
        assert not torch.isnan(weight).any()
    torch.testing.assert_close(weight.double(), torch.tensor(ref.W, dtype=torch.float64), rtol=tol, atol=tol)
    torch.testing.assert_close(state.exp_avg.double(), torch.tensor(ref.M, dtype=torch.float64), rtol=tol, atol=tol)
    torch.testing.assert_close(state.exp_avg_sq.double(), torch.tensor(ref.V, dtype=torch.float64), rtol=tol, atol=tol)
    assert state.row_step.tolist() == ref.RS
    assert int(state.step) == ref.GS == 5
    if clip:
        assert total_clipped > 0


def test_row_and_global_bias_correction_differ_for_late_rows():
    """A row first seen at step 3: per-row correction makes its first step exactly lr*sign(g)
    (torch eps aside); the global step makes it (1-b1)/sqrt(1-b2) ~ 3.16x larger."""
    d, lr = 4, 1e-3
    results = {}
    for bc in ("row", "global"):
        w = torch.full((2, d), 0.5, dtype=torch.float64)
        st = CowClipAdamState.zeros_like(w)
        go = torch.full((1, d), 0.1, dtype=torch.float64)
        off = torch.tensor([0, 1])
        for _ in range(2):
            cowclip_adam_step(w, st, torch.tensor([0]), off, go, lr=lr, eps=0.0, clip=False, bias_correction=bc)
        before = w[1].clone()
        cowclip_adam_step(w, st, torch.tensor([1]), off, go, lr=lr, eps=0.0, clip=False, bias_correction=bc)
        results[bc] = before - w[1]
        assert st.row_step.tolist() == [2, 1] and int(st.step) == 3
    torch.testing.assert_close(results["row"], torch.full((d,), lr, dtype=torch.float64))
    b1, b2 = 0.9, 0.999
    expect = lr * math.sqrt(1 - b2**3) / (1 - b1**3) * (1 - b1) / math.sqrt(1 - b2)
    torch.testing.assert_close(results["global"], torch.full((d,), expect, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batch_scope_leaves_absent_rows_bit_identical(dtype):
    n, d = 50, 8
    gen = torch.Generator().manual_seed(3)
    weight = make_weight(gen, n, d, dtype)
    state = CowClipAdamState.zeros_like(weight)
    rng = random.Random(3)
    hp = dict(lr=1e-2, l2=1e-3, clip=True)
    # first touch every row, so the state is non-zero everywhere
    all_rows = torch.arange(n)
    cowclip_adam_step(weight, state, all_rows, torch.arange(n + 1), torch.randn(n, d, generator=gen, dtype=dtype), **hp)
    before = (weight.clone(), state.exp_avg.clone(), state.exp_avg_sq.clone(), state.row_step.clone())
    batch = make_batch(rng, n, d, num_bags=6, id_range=20)
    cowclip_adam_step(weight, state, *as_tensors(batch, dtype), **hp)
    present = torch.zeros(n, dtype=torch.bool)
    present[torch.tensor(batch[0])] = True
    absent = ~present
    assert absent.sum() >= 30
    for a, b in zip((weight, state.exp_avg, state.exp_avg_sq, state.row_step), before):
        assert torch.equal(a[absent], b[absent])
        assert not torch.equal(a[present], b[present])


def test_empty_batch_changes_nothing_but_step():
    w = torch.randn(5, 4, dtype=torch.float64)
    st = CowClipAdamState.zeros_like(w)
    w0 = w.clone()
    stats = cowclip_adam_step(
        w, st, torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.randn(3, 4, dtype=torch.float64)
    )
    assert torch.equal(w, w0) and stats.unique_rows == 0 and float(stats.clipped_fraction) == 0.0
    assert int(st.step) == 1 and st.row_step.sum() == 0


def test_zero_gradient_rows_no_nan_and_l2_scopes():
    """Rows in the batch with zero gradient: no NaN; with l2 they still move (toward 0).

    "Toward 0" is the sign of the step, not a smaller |w|: Adam's first step is ~lr per
    coordinate, which overshoots zero for coordinates smaller than lr/2."""
    w = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    idx, off = torch.tensor([0, 2, 2]), torch.tensor([0, 1, 3])
    go = torch.zeros(2, 4, dtype=torch.float64)
    # batch/batch, no l2: zero grads -> m stays 0 -> weights unchanged
    w1, st1 = w.clone(), CowClipAdamState.zeros_like(w)
    cowclip_adam_step(w1, st1, idx, off, go, lr=1e-2)
    assert torch.equal(w1, w)
    assert st1.row_step.tolist() == [1, 0, 1, 0, 0, 0]
    # l2 on batch rows only: rows 0, 2 shrink, others untouched
    w2, st2 = w.clone(), CowClipAdamState.zeros_like(w)
    cowclip_adam_step(w2, st2, idx, off, go, lr=1e-2, l2=1e-3)
    assert ((w2[[0, 2]] - w[[0, 2]]) * w[[0, 2]] < 0).all() and torch.equal(w2[[1, 3, 4, 5]], w[[1, 3, 4, 5]])
    # all/all: every row shrinks (dense L2 like the Keras regulariser)
    w3, st3 = w.clone(), CowClipAdamState.zeros_like(w)
    cowclip_adam_step(w3, st3, idx, off, go, lr=1e-2, l2=1e-3, update_scope="all", l2_scope="all")
    assert ((w3 - w) * w < 0).all()
    assert st3.row_step.tolist() == [1] * 6
    # all/batch: absent rows get g = 0 (no move at step 1)
    w4, st4 = w.clone(), CowClipAdamState.zeros_like(w)
    cowclip_adam_step(w4, st4, idx, off, go, lr=1e-2, l2=1e-3, update_scope="all", l2_scope="batch")
    assert torch.equal(w4[[1, 3, 4, 5]], w[[1, 3, 4, 5]]) and torch.equal(w4[[0, 2]], w2[[0, 2]])
    for t in (w1, w2, w3, w4):
        assert torch.isfinite(t).all()


def test_bad_options_raise():
    w = torch.zeros(3, 2)
    st = CowClipAdamState.zeros_like(w)
    args = (w, st, torch.tensor([0]), torch.tensor([0, 1]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="l2_scope='all' needs update_scope='all'"):
        cowclip_adam_step(*args, update_scope="batch", l2_scope="all")
    for kw in ({"update_scope": "rows"}, {"l2_scope": "x"}, {"bias_correction": "x"}, {"eps_mode": "tf"}):
        with pytest.raises(ValueError, match="must be one of"):
            cowclip_adam_step(*args, **kw)
    with pytest.raises(ValueError, match="disagree"):
        cowclip_adam_step(w, st, torch.tensor([0]), torch.tensor([0, 1]), torch.ones(1, 3))


# ----------------------------------------------------------------------------- vs torch optimizers


def _autograd_batches(seed, n, d, steps):
    rng = random.Random(seed)
    return [make_batch(rng, n, d, num_bags=7, id_range=[n, n // 2, n // 3][s % 3]) for s in range(steps)]


def test_clip_false_all_scope_equals_torch_adam():
    """No clipping, dense scope, L2 on all rows = torch.optim.Adam(weight_decay=2*l2) on the
    gradient of a pooled-sum F.embedding_bag."""
    n, d, lr, l2 = 20, 4, 1e-2, 1e-3
    gen = torch.Generator().manual_seed(5)
    w0 = make_weight(gen, n, d, torch.float64)
    param = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([param], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=2 * l2)
    ours, st = w0.clone(), CowClipAdamState.zeros_like(w0)
    for batch in _autograd_batches(5, n, d, 6):
        idx, off, go, psw = as_tensors(batch, torch.float64)
        opt.zero_grad()
        out = F.embedding_bag(idx, param, off, mode="sum", per_sample_weights=psw, include_last_offset=True)
        out.backward(go)
        opt.step()
        cowclip_adam_step(ours, st, idx, off, go, psw, lr=lr, l2=l2, clip=False, update_scope="all", l2_scope="all")
    torch.testing.assert_close(ours, param.detach(), rtol=1e-10, atol=1e-12)


def test_clip_false_lazy_global_keras_equals_sparse_adam():
    """Lazy scope with the global step and eps outside the bias correction is torch SparseAdam."""
    n, d, lr = 20, 4, 1e-2
    gen = torch.Generator().manual_seed(6)
    w0 = make_weight(gen, n, d, torch.float64)
    param = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SparseAdam([param], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    ours, st = w0.clone(), CowClipAdamState.zeros_like(w0)
    for batch in _autograd_batches(6, n, d, 6):
        idx, off, go, psw = as_tensors(batch, torch.float64)
        opt.zero_grad()
        out = F.embedding_bag(idx, param, off, mode="sum", per_sample_weights=psw, include_last_offset=True, sparse=True)
        out.backward(go)
        opt.step()
        cowclip_adam_step(ours, st, idx, off, go, psw, lr=lr, clip=False, bias_correction="global", eps_mode="keras")
    torch.testing.assert_close(ours, param.detach(), rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- by hand


def test_one_step_by_hand_three_rows_width_two():
    """Two bags over a 3-row table of width 2, every term written out: the row gradients and
    counts, the L2 term, the threshold r * cnt * max(||w||, r * sqrt(2) * zeta), the clip, Adam's
    first moments and the t = 1 bias correction. Row 2 is not in the batch."""
    r, zeta, l2, lr, eps = 0.5, 1e-5, 0.05, 0.1, 1e-8
    b1, b2 = 0.9, 0.999
    w0 = [[3.0, 4.0], [0.6, 0.8], [1.0, -1.0]]
    weight = torch.tensor(w0, dtype=torch.float64)
    state = CowClipAdamState.zeros_like(weight)
    # bag 0 = {0, 1}, bag 1 = {0}; grad_output rows (1, 0) and (0, 2)
    idx, off = torch.tensor([0, 1, 0]), torch.tensor([0, 2, 3])
    go = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    stats = cowclip_adam_step(weight, state, idx, off, go, lr=lr, betas=(b1, b2), eps=eps, r=r, zeta=zeta, l2=l2)

    g = {0: [1.0 + 2 * l2 * 3.0, 2.0 + 2 * l2 * 4.0], 1: [1.0 + 2 * l2 * 0.6, 0.0 + 2 * l2 * 0.8]}  # (1.3, 2.4), (1.06, 0.08)
    clip = {0: r * 2 * 5.0, 1: r * 1 * 1.0}  # cnt 2 and 1; ||w|| 5 and 1 are above zeta'
    clipped = []
    for k in (0, 1):
        gn = math.hypot(*g[k])
        if gn > clip[k]:
            clipped.append(k)
            g[k] = [x * clip[k] / gn for x in g[k]]
    assert clipped == [1]  # ||g_0|| = 2.73 < 5, ||g_1|| = 1.063 > 0.5
    for k in (0, 1):
        for d in range(2):
            m = (1 - b1) * g[k][d]
            v = (1 - b2) * g[k][d] ** 2
            w = w0[k][d] - lr * (m / (1 - b1)) / (math.sqrt(v) / math.sqrt(1 - b2) + eps)
            assert state.exp_avg[k, d].item() == pytest.approx(m, rel=1e-12)
            assert state.exp_avg_sq[k, d].item() == pytest.approx(v, rel=1e-12)
            assert weight[k, d].item() == pytest.approx(w, rel=1e-12)
    assert weight[2].tolist() == w0[2] and state.exp_avg[2].tolist() == [0.0, 0.0]
    assert state.row_step.tolist() == [1, 1, 0] and int(state.step) == 1
    assert (stats.unique_rows, int(stats.clipped_rows), float(stats.clipped_fraction)) == (2, 1, 0.5)


def test_second_step_by_hand_keras_eps_and_row_bias_correction():
    """Row 0 updated twice, row 1 once (at the second call): each uses its own t in the keras
    form lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps). No clip, width 3."""
    lr, eps, b1, b2 = 0.01, 1e-3, 0.9, 0.99
    w = [[0.5, -0.25, 1.0], [2.0, 0.0, -1.0]]
    weight = torch.tensor(w, dtype=torch.float64)
    state = CowClipAdamState.zeros_like(weight)
    grads = [[(0, [0.2, -0.4, 0.1])], [(0, [0.3, 0.1, -0.2]), (1, [-1.0, 0.5, 0.25])]]
    m = [[0.0] * 3 for _ in range(2)]
    v = [[0.0] * 3 for _ in range(2)]
    t = [0, 0]
    for batch in grads:
        idx = torch.tensor([k for k, _ in batch])
        off = torch.arange(len(batch) + 1)
        go = torch.tensor([gk for _, gk in batch], dtype=torch.float64)
        cowclip_adam_step(weight, state, idx, off, go, lr=lr, betas=(b1, b2), eps=eps, clip=False, eps_mode="keras")
        for k, gk in batch:
            t[k] += 1
            for d in range(3):
                m[k][d] = b1 * m[k][d] + (1 - b1) * gk[d]
                v[k][d] = b2 * v[k][d] + (1 - b2) * gk[d] ** 2
                w[k][d] -= lr * math.sqrt(1 - b2 ** t[k]) / (1 - b1 ** t[k]) * m[k][d] / (math.sqrt(v[k][d]) + eps)
    torch.testing.assert_close(weight, torch.tensor(w, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(state.exp_avg, torch.tensor(m, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(state.exp_avg_sq, torch.tensor(v, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert state.row_step.tolist() == [2, 1] and int(state.step) == 2


def test_threshold_by_hand_norm_above_and_below_the_floor():
    """zeta' = r * sqrt(4) * zeta = 0.03 with r = 1.5, zeta = 0.01: row 0 (||w|| = 0.5) uses its
    norm, row 1 (||w|| = 0.02) the floor."""
    w = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.01, 0.01, 0.01, 0.01]], dtype=torch.float64)
    got = cowclip_threshold(w, torch.tensor([3, 2]), r=1.5, zeta=0.01)
    torch.testing.assert_close(got, torch.tensor([1.5 * 3 * 0.5, 1.5 * 2 * 0.03], dtype=torch.float64), rtol=1e-12, atol=0)


def test_state_dict_holds_the_live_tensors():
    w = torch.zeros(3, 2)
    st = CowClipAdamState.zeros_like(w)
    sd = st.state_dict()
    assert list(sd) == ["exp_avg", "exp_avg_sq", "row_step", "step"]
    assert sd["exp_avg"] is st.exp_avg and sd["row_step"] is st.row_step and sd["step"] is st.step
    assert (sd["row_step"].dtype, tuple(sd["row_step"].shape), sd["step"].dtype, sd["step"].dim()) == (torch.long, (3,), torch.long, 0)


def test_input_shape_errors_name_the_problem():
    off, go = torch.tensor([0, 1]), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"^indices and offsets must be 1-D$"):
        batch_row_gradients(torch.tensor([[0]]), off, go)
    with pytest.raises(ValueError, match=r"^grad_output must be \[num_bags, D\], got shape \(2,\)$"):
        batch_row_gradients(torch.tensor([0]), off, torch.ones(2))
    with pytest.raises(ValueError, match=r"^offsets has 1 bags \(\+1 entries\) but grad_output has 2 rows$"):
        batch_row_gradients(torch.tensor([0]), off, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"^per_sample_weights must have one weight per index$"):
        batch_row_gradients(torch.tensor([0]), off, go, torch.ones(2))
    with pytest.raises(ValueError, match=r"^embedding ids out of range \[0, 4\)$"):
        batch_row_gradients(torch.tensor([-1]), off, go, num_rows=4)
    with pytest.raises(ValueError, match=r"^row_grads \(2, 3\) and weights_rows \(2, 2\) differ$"):
        cowclip_clip(torch.ones(2, 3), torch.ones(2, 2), torch.ones(2, dtype=torch.long))
    w = torch.zeros(3, 2)
    bad = CowClipAdamState.zeros_like(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"^optimizer state shape does not match weight$"):
        cowclip_adam_step(w, bad, torch.tensor([0]), off, go)
    with pytest.raises(ValueError, match=r"^eps_mode must be one of torch\|keras, got 'tf'$"):
        cowclip_adam_step(w, CowClipAdamState.zeros_like(w), torch.tensor([0]), off, go, eps_mode="tf")
