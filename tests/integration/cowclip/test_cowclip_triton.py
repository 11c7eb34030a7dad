"""The Triton CowClip-Adam kernel (recsys/optim/cowclip/kernels/triton_update.py) against the torch-ops reference
``cowclip_adam_step(update_scope="batch", l2_scope="batch", bias_correction="row")`` (itself checked
against a per-row loop in tests/unit/test_cowclip_math.py), and against counts and norms computed here.

Without a CUDA device the kernel runs on CPU tensors under Triton's interpreter (this file imports
triton with ``TRITON_INTERPRET=1``; setting it yourself works too); with one (``make test-gpu``) the same tests
compile it for real and run on CUDA tensors. Without triton installed the kernel tests are SKIPPED
with the reason "triton not installed" (shown by ``-ra``); the test that a CPU install without
triton keeps working runs everywhere.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON and DEV.type == "cpu" and "triton" not in sys.modules:
    # triton picks its interpreter when it is imported: import it in interpreter mode, then put the
    # environment back so nothing else in this pytest process (or its subprocesses) sees the variable
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if _old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _old

import recsys.optim.cowclip.kernels.triton_update as ctr  # noqa: E402
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
if not HAVE_TRITON:
    needs_triton = pytest.mark.skipif(True, reason="triton not installed")
else:
    needs_triton = pytest.mark.skipif(
        not ctr.triton_available(DEV),
        reason="triton was imported without TRITON_INTERPRET=1 before this file and there is no CUDA device: run with TRITON_INTERPRET=1",
    )


# ----------------------------------------------------------------------------- cases


def _bags(gen, n, num_bags, max_len, id_range, hot=None):
    """Feature lengths and ids of multi-hot bags: an empty bag, repeats inside bags (the first id
    of each bag of >= 2 ids is repeated at its end) and across bags (``hot`` ids drawn half the time)."""
    lengths = torch.randint(0, max_len + 1, (num_bags,), generator=gen)
    lengths[0] = max(int(lengths[0]), 2)
    if num_bags > 2:
        lengths[1] = 0
    ids = torch.randint(0, id_range, (int(lengths.sum()),), generator=gen)
    if hot is not None:
        pick = torch.rand(ids.numel(), generator=gen) < 0.5
        ids[pick] = hot[torch.randint(0, hot.numel(), (int(pick.sum()),), generator=gen)]
    start = 0
    for ln in lengths.tolist():
        if ln >= 2:
            ids[start + ln - 1] = ids[start]
        start += ln
    return lengths, ids


class Group:
    """A flat table-batched group, laid out as the TBE does (tables back to back in ``weights``,
    ``row_step`` per table row), feature f reading table ``feature_table[f]`` (a permutation, so the
    feature and table orders differ), and its per-feature ``feature_meta``/``zeta``."""

    def __init__(self, gen, specs, *, w_scale=0.02, tiny_every=7, zeta_base=1e-5):
        self.specs = specs  # [(rows, dim, clip)]
        T = len(specs)
        self.feature_table = [T - 1 - f for f in range(T)]
        self.woffs, self.rstarts = [0], [0]
        for n, d, _ in specs:
            self.woffs.append(self.woffs[-1] + n * d)
            self.rstarts.append(self.rstarts[-1] + n)
        self.weights = torch.randn(self.woffs[-1], generator=gen) * w_scale
        if tiny_every:
            self.weights[::tiny_every] *= 1e-7  # rows whose norm sits under the zeta' floor
        # non-zero moments and steps: a zeroing bug or a wrong bias-correction step shows
        self.m1 = torch.linspace(-1e-3, 1e-3, self.woffs[-1])
        self.m2 = torch.linspace(0, 1e-4, self.woffs[-1])
        self.row_step = torch.randint(0, 3, (self.rstarts[-1],), generator=gen)
        self.dims = [specs[t][1] for t in self.feature_table]
        self.d_off = [0]
        for d in self.dims:
            self.d_off.append(self.d_off[-1] + d)
        self.meta = torch.tensor(
            [
                [self.woffs[t], specs[t][0], specs[t][1], self.d_off[f], self.rstarts[t], int(specs[t][2])]
                for f, t in enumerate(self.feature_table)
            ],
            dtype=torch.long,
        )
        self.zeta = torch.tensor([zeta_base * (1 + f) for f in range(T)], dtype=torch.float64)

    def state(self):
        return [x.clone().to(DEV) for x in (self.weights, self.m1, self.m2, self.row_step)]

    def batch(self, gen, num_bags, *, max_len=4, weighted=True, grad_scale=0.05, empty_feature=None, hot_every_bag=False):
        """Feature-major KJT lookup (indices, offsets [F*B+1]) and grad_output [B, total_D]."""
        ids_l, len_l = [], []
        for f, t in enumerate(self.feature_table):
            n = self.specs[t][0]
            lengths, ids = _bags(gen, n, num_bags, max_len, min(n, 25 + 5 * f), hot=torch.tensor([0, 1, n - 1]) if n > 2 else None)
            if hot_every_bag:  # row 0 in every bag, twice in some: cnt = num_bags > CHUNK
                lengths, ids = (
                    lengths + 1,
                    torch.cat(
                        [
                            torch.cat([torch.zeros(1, dtype=torch.long), ids[s : s + ln]])
                            for s, ln in zip((torch.cumsum(lengths, 0) - lengths).tolist(), lengths.tolist())
                        ]
                    ),
                )
            if f == empty_feature:
                lengths, ids = torch.zeros_like(lengths), ids[:0]
            ids_l.append(ids)
            len_l.append(lengths)
        indices = torch.cat(ids_l)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.cat(len_l), 0)])
        grad = torch.randn(num_bags, self.d_off[-1], generator=gen) * grad_scale
        grad[torch.rand(num_bags, generator=gen) < 0.2] = 0  # samples with zero gradient
        psw = torch.rand(indices.numel(), generator=gen) * 1.8 + 0.2 if weighted else None
        return indices, offsets, grad, psw

    def reference(self, bufs, indices, offsets, grad, psw, **hp):
        """The torch reference per table, in place on views of ``bufs``; returns stats [F, 2]."""
        w, m1, m2, rs = bufs
        F = len(self.feature_table)
        B = (offsets.numel() - 1) // F
        offs = offsets.long()
        stats = torch.zeros(F, 2, dtype=torch.long)
        for f, t in enumerate(self.feature_table):
            n, d, clip = self.specs[t]
            lo, hi = int(offs[f * B]), int(offs[(f + 1) * B])
            sl = slice(self.woffs[t], self.woffs[t + 1])
            st = CowClipAdamState(
                m1[sl].view(n, d),
                m2[sl].view(n, d),
                rs[self.rstarts[t] : self.rstarts[t + 1]],
                torch.zeros((), dtype=torch.long, device=w.device),
            )
            out = cowclip_adam_step(
                w[sl].view(n, d),
                st,
                indices[lo:hi].long(),
                offs[f * B : (f + 1) * B + 1] - lo,
                grad[:, self.d_off[f] : self.d_off[f + 1]].contiguous(),
                psw[lo:hi] if psw is not None else None,
                zeta=float(self.zeta[f]),
                clip=clip,
                update_scope="batch",
                l2_scope="batch",
                bias_correction="row",
                **hp,
            )
            stats[f, 0], stats[f, 1] = out.unique_rows, int(out.clipped_rows)
        return stats

    def row_dims(self):
        """dim of the table of every row of row_step, to expand a per-row mask to the flat buffers."""
        return torch.tensor([self.specs[t][1] for t in range(len(self.specs)) for _ in range(self.specs[t][0])])


def _run_triton(g: Group, bufs, indices, offsets, grad, psw, **hp):
    on = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    return ctr.triton_cowclip_adam_tables(*bufs, g.meta, g.zeta, on(indices), on(offsets), on(grad), on(psw), **hp).cpu()


def _assert_close(g: Group, got, want, before, stats_got, stats_want, exact_clipped=False):
    got = [x.cpu() for x in got]
    (w, m1, m2, rs), (w_r, m1_r, m2_r, rs_r) = got, want
    torch.testing.assert_close(w, w_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m1, m1_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m2, m2_r, rtol=1e-5, atol=1e-9)
    assert torch.equal(rs, rs_r)
    assert torch.equal(stats_got[:, 0], stats_want[:, 0])
    if exact_clipped:
        assert torch.equal(stats_got[:, 1], stats_want[:, 1])
    else:  # a row exactly at the threshold may round either way
        assert (stats_got[:, 1] - stats_want[:, 1]).abs().max() <= 1
    # rows absent from the batch: bit-identical
    absent = torch.repeat_interleave(rs == before[3], g.row_dims())
    for new, old in zip((w, m1, m2), before[:3]):
        assert torch.equal(new[absent], old[absent])


SPECS = [(50, 16, True), (3, 4, True), (60, 7, False), (40, 33, True), (20, 1, False)]


# ----------------------------------------------------------------------------- against the reference


@needs_triton
@pytest.mark.parametrize(
    "eps_mode,l2,weighted", [("torch", 0.0, True), ("torch", 1e-2, False), ("keras", 0.0, False), ("keras", 1e-2, True)]
)
def test_tables_match_reference_over_steps(eps_mode, l2, weighted):
    """Several tables (dims 1..33, two unclipped, zeta' floor rows) in one launch, 3 steps with the
    moments and row steps carried over; repeated ids inside and across bags; both eps modes."""
    gen = torch.Generator().manual_seed(int(eps_mode == "keras") * 2 + int(l2 > 0))
    g = Group(gen, SPECS)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8 if eps_mode == "torch" else 1e-7, r=1.0, l2=l2, eps_mode=eps_mode)
    bufs = g.state()
    ref = [x.clone() for x in (g.weights, g.m1, g.m2, g.row_step)]
    clipped_seen = 0
    for _ in range(3):
        idx, off, grad, psw = g.batch(gen, num_bags=12, weighted=weighted)
        before = [x.cpu().clone() for x in bufs]
        s_got = _run_triton(g, bufs, idx, off, grad, psw, **hp)
        s_want = g.reference(ref, idx, off, grad, psw, **hp)
        _assert_close(g, bufs, ref, before, s_got, s_want)
        clipped_seen += int(s_want[:, 1].sum())
    assert clipped_seen > 0, "the random case should clip some rows (zeta' floor rows)"
    rs = ref[3]
    assert int((rs - g.row_step).max()) == 3 and int((rs - g.row_step).min()) == 0


@needs_triton
def test_clip_active_and_inactive():
    """Large gradients: every row of the clipped tables is scaled down (and none of the unclipped
    ones); tiny gradients: no row is. The reference's own counts confirm each regime."""
    gen = torch.Generator().manual_seed(1)
    g = Group(gen, SPECS, tiny_every=0)
    hp = dict(lr=1e-2, l2=1e-3)
    for scale, expect_all in ((10.0, True), (1e-7, False)):
        bufs = g.state()
        ref = [x.clone() for x in (g.weights, g.m1, g.m2, g.row_step)]
        idx, off, grad, psw = g.batch(gen, num_bags=10, grad_scale=scale)
        grad[grad.abs().sum(1) == 0] = scale  # no zero-gradient sample in these cases
        s_got = _run_triton(g, bufs, idx, off, grad, psw, **hp)
        s_want = g.reference(ref, idx, off, grad, psw, **hp)
        clip_f = torch.tensor([g.specs[t][2] for t in g.feature_table])
        if expect_all:
            assert torch.equal(s_want[clip_f, 1], s_want[clip_f, 0]) and int(s_want[~clip_f, 1].sum()) == 0
        else:
            assert int(s_want[:, 1].sum()) == 0
        _assert_close(g, bufs, ref, [g.weights, g.m1, g.m2, g.row_step], s_got, s_want, exact_clipped=True)


@needs_triton
def test_zeta_floor_and_distinct_counts_over_chunks():
    """From w = 0 and zero moments every row sits on the floor and is clipped to norm
    r * cnt * zeta' exactly, so m = (1-b1) * g_clipped gives cnt back: checked against the number of
    distinct samples per row counted here in Python. Row 0 of each table is in every one of 70 bags
    (some twice): its occurrences span several CHUNKs of the kernel's loop."""
    gen = torch.Generator().manual_seed(2)
    specs = [(40, 16, True), (30, 5, True)]
    g = Group(gen, specs, w_scale=0.0, tiny_every=0, zeta_base=1e-3)
    g.m1.zero_()
    g.m2.zero_()
    g.row_step.zero_()
    B = 70
    idx, off, grad, _ = g.batch(gen, num_bags=B, hot_every_bag=True, grad_scale=1.0, max_len=3)
    grad[grad.abs().sum(1) == 0] = 1.0
    r, b1 = 0.5, 0.9
    bufs = g.state()
    ref = [x.clone() for x in (g.weights, g.m1, g.m2, g.row_step)]
    hp = dict(lr=1e-3, betas=(b1, 0.999), r=r)
    s_got = _run_triton(g, bufs, idx, off, grad, None, **hp)
    s_want = g.reference(ref, idx, off, grad, None, **hp)
    assert torch.equal(s_got[:, 1], s_got[:, 0])  # every row clipped
    _assert_close(g, bufs, ref, [g.weights, g.m1, g.m2, g.row_step], s_got, s_want, exact_clipped=True)
    m1 = bufs[1].cpu()
    for f, t in enumerate(g.feature_table):
        n, d, _ = specs[t]
        ids = idx[off[f * B] : off[(f + 1) * B]]
        offs = off[f * B : (f + 1) * B + 1] - off[f * B]
        cnt: dict[int, int] = {}
        for b in range(B):
            for k in set(ids[offs[b] : offs[b + 1]].tolist()):
                cnt[k] = cnt.get(k, 0) + 1
        assert cnt[0] == B
        assert int((ids == 0).sum()) > ctr.CHUNK * 2
        zeta_p = r * math.sqrt(d) * float(g.zeta[f])
        m = m1[g.woffs[t] : g.woffs[t + 1]].view(n, d)
        for k, c in cnt.items():
            assert torch.linalg.vector_norm(m[k]).item() / (1 - b1) == pytest.approx(r * c * zeta_p, rel=1e-5)


@needs_triton
def test_one_table_wrapper_matches_reference():
    """``triton_cowclip_adam_step`` (the contract of ``fused_cowclip_adam_step``), two steps."""
    gen = torch.Generator().manual_seed(3)
    n, d = 30, 8
    w = torch.randn(n, d, generator=gen) * 0.02
    w_r = w.clone()
    st, st_r = CowClipAdamState.zeros_like(w.to(DEV)), CowClipAdamState.zeros_like(w)
    w = w.to(DEV)
    hp = dict(lr=1e-2, l2=1e-3, zeta=1e-4, r=2.0, eps_mode="keras", eps=1e-7)
    for _ in range(2):
        lengths, ids = _bags(gen, n, 9, 4, n)
        off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        go = torch.randn(9, d, generator=gen)
        got = ctr.triton_cowclip_adam_step(
            w, st, ids.to(DEV), off.to(DEV), go.to(DEV), lr=hp["lr"], l2=hp["l2"], zeta=hp["zeta"], r=hp["r"], eps_mode="keras", eps=1e-7
        )
        want = cowclip_adam_step(w_r, st_r, ids, off, go, update_scope="batch", **hp)
        torch.testing.assert_close(w.cpu(), w_r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.exp_avg.cpu(), st_r.exp_avg, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.exp_avg_sq.cpu(), st_r.exp_avg_sq, rtol=1e-5, atol=1e-9)
        assert torch.equal(st.row_step.cpu(), st_r.row_step) and int(st.step) == int(st_r.step)
        assert got.unique_rows == want.unique_rows and int(got.clipped_rows) == int(want.clipped_rows)


@needs_triton
def test_int32_ids_empty_feature_strided_grad_and_rerun_bit_identical():
    """int32 indices/offsets, a feature with no ids, grad_output a column slice of a wider buffer
    (row stride > total_D): same as the reference; no atomics, so a rerun is bit-identical."""
    gen = torch.Generator().manual_seed(4)
    g = Group(gen, SPECS[:3])
    idx, off, grad, psw = g.batch(gen, num_bags=8, empty_feature=1)
    wide = torch.randn(grad.shape[0], grad.shape[1] + 5, generator=gen)
    wide[:, 2 : 2 + grad.shape[1]] = grad
    strided = wide[:, 2 : 2 + grad.shape[1]]
    assert strided.stride(0) != grad.shape[1]
    hp = dict(lr=1e-2, l2=1e-2)
    ref = [x.clone() for x in (g.weights, g.m1, g.m2, g.row_step)]
    s_want = g.reference(ref, idx, off, grad, psw, **hp)
    outs = []
    for _ in range(2):
        bufs = g.state()
        s_got = _run_triton(g, bufs, idx.int(), off.int(), strided, psw, **hp)
        _assert_close(g, bufs, ref, [g.weights, g.m1, g.m2, g.row_step], s_got, s_want)
        outs.append(bufs)
    assert int(s_got[1, 0]) == 0
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- errors, dispatch


@needs_triton
def test_bad_inputs_raise_one_line_and_write_nothing():
    gen = torch.Generator().manual_seed(5)
    g = Group(gen, [(30, 4, True), (20, 8, True)])
    idx, off, grad, psw = g.batch(gen, num_bags=6, weighted=False)
    hp = dict(lr=1e-2)
    n_last = g.specs[g.feature_table[1]][0]
    bad = idx.clone()
    bad[-1] = n_last  # the last id belongs to the last feature: one past its table
    cases = [
        (dict(indices=bad), f"embedding ids out of range [0, {n_last}): {n_last} (feature 1)"),
        (dict(grad=grad[:-1]), "offsets has 6 bags per feature but grad_output has 5 rows"),
        (dict(offsets=off[:-1]), "offsets must have F*B+1 entries"),
        (dict(offsets=torch.cat([off[:-1], off[-1:] + 1])), "offsets must start at 0 and end at len(indices)"),
    ]
    meta = g.meta.clone()
    meta[0, 1] = 10_000
    overlap = g.meta.clone()
    overlap[1, 0] = overlap[0, 0]
    for case, msg in cases + [
        (dict(meta=meta), "feature 0: table outside the weights buffer"),
        (dict(meta=overlap), "features must read distinct, non-overlapping tables"),
    ]:
        bufs = g.state()
        args = dict(indices=idx, offsets=off, grad=grad, meta=g.meta) | case
        with pytest.raises(RuntimeError) as e:
            ctr.triton_cowclip_adam_tables(
                *bufs, args["meta"], g.zeta, args["indices"].to(DEV), args["offsets"].to(DEV), args["grad"].to(DEV), None, **hp
            )
        assert str(e.value) == msg
        for new, old in zip(bufs, (g.weights, g.m1, g.m2, g.row_step)):
            assert torch.equal(new.cpu(), old)


@needs_triton
def test_dispatch_by_device():
    from recsys.optim.cowclip.kernels import cpp_op, dispatch

    assert dispatch.tables_update_op("cuda") is ctr.triton_cowclip_adam_tables
    assert dispatch.table_update_op("cuda") is ctr.triton_cowclip_adam_step
    assert dispatch.catchup_backend("cuda") == "triton"
    assert dispatch.tables_update_op("meta") is None and dispatch.catchup_backend("meta") == "torch"
    assert dispatch.table_update_op("meta") is cpp_op.fused_cowclip_adam_step  # which falls back to the reference
    fused = cpp_op.fused_available()
    assert dispatch.tables_update_op("cpu") is (cpp_op.fused_cowclip_adam_tables if fused else None)
    assert dispatch.catchup_backend("cpu") == ("fused" if fused else "torch")
    assert ctr.triton_available("cpu") == (DEV.type == "cpu")  # the interpreter: only where this file asked


# ----------------------------------------------------------------------------- the catch-up kernel

CATCHUP_GAPS = [1, 2, 3, 5, 17, 100, 333, 1000, 3000]


@needs_triton
@pytest.mark.parametrize(
    "lr,l2,eps_mode,growth",
    [(1e-3, 1e-4, "torch", 2.0), (1e-4, 1.28e-3, "keras", 2.0), (1e-2, 0.0, "torch", 2.0), (1e-3, 1e-4, "keras", 3.0)],
)
def test_catch_up_kernel_matches_the_torch_catch_up(lr, l2, eps_mode, growth):
    """``triton_catch_up_rows`` against ``catch_up`` (recsys/optim/cowclip/catchup.py) on gaps 1 ..
    3000 with data momenta, rows of dims 16 and 8 in one launch at scattered offsets and permuted
    ``row_step`` slots, a row already current (left bit-identical), then again from a later step."""
    from recsys.optim.cowclip.catchup import catch_up
    from recsys.optim.cowclip.kernels.triton_catchup import triton_catch_up_rows

    gen = torch.Generator().manual_seed(5)
    kw = dict(lr=lr, betas=(0.9, 0.999), eps=1e-7 if eps_mode == "keras" else 1e-8, eps_mode=eps_mode, l2=l2)
    rows = [(gap, dim) for dim in (16, 8) for gap in CATCHUP_GAPS] + [(0, 16)]  # the last one is current
    n = len(rows)
    offs, pos = [], 3  # element offsets with holes between rows: nothing outside a row may be written
    for _, dim in rows:
        offs.append(pos)
        pos += dim + 5
    slots = torch.randperm(n, generator=gen) + 2  # row_step slots, permuted, after 2 untouched ones
    flat = [torch.randn(pos, generator=gen) * s for s in (1e-2, 1e-4)] + [torch.rand(pos, generator=gen) * 1e-8]
    for step in (3100, 3357):
        rs_all = torch.full((n + 2,), -7, dtype=torch.long)
        rs_all[slots] = torch.tensor([step - gap for gap, _ in rows])
        bufs = [x.clone().to(DEV) for x in flat] + [rs_all.clone().to(DEV)]
        triton_catch_up_rows(
            *bufs, torch.tensor(offs).to(DEV), slots.to(DEV), torch.tensor([d for _, d in rows]).to(DEV), step, growth=growth, **kw
        )
        got = [b.cpu() for b in bufs]
        assert got[3][slots].eq(step).all() and got[3][:2].eq(-7).all()
        for i, ((gap, dim), o) in enumerate(zip(rows, offs)):
            start = [x[o : o + dim].view(1, dim) for x in flat]
            want = catch_up(*start, torch.tensor([step - gap]), step, growth=growth, **kw)
            for name, a, b, st in zip("wmv", got[:3], want, start):
                a = a[o : o + dim].view(1, dim)
                if gap == 0:
                    assert torch.equal(a, st), f"row {i}: a current row was written"
                    continue
                # float32 rounding of results that may be near-cancellations of terms of the start's
                # size: 1e-5 of the result plus 1e-6 (about 8 ulp) of the row's start
                allowed = 1e-5 * b.abs() + 1e-6 * st.abs().max() + 1e-30
                worst = float(((a - b).abs() / allowed).max())
                assert worst <= 1.0, f"step {step} gap {gap} dim {dim} {name}: error {worst:.2f}x the allowed"
        outside = torch.ones(pos, dtype=torch.bool)
        for (_, dim), o in zip(rows, offs):
            outside[o : o + dim] = False
        for a, b in zip(got[:3], flat):
            assert torch.equal(a[outside], b[outside])


@needs_triton
@pytest.mark.parametrize("index_dtype,eps_mode", [(torch.int64, "torch"), (torch.int32, "keras")])
def test_catch_up_lookup_kernel_matches_the_torch_catch_up(index_dtype, eps_mode):
    """``triton_catch_up_lookup`` (an atomic max of ``row_step`` claims each row for one id) against
    ``catch_up`` row by row: three tables of dims 16, 8, 16 at offsets with holes, table 0 read by
    two features (the same row from two features and repeated inside bags), gaps up to 3000, an id
    outside its table and a row already current. Every row behind that the lookup reads is advanced
    exactly once and gets ``row_step = step``; nothing else is written (bit-identical)."""
    from recsys.optim.cowclip.catchup import catch_up
    from recsys.optim.cowclip.kernels.triton_catchup import triton_catch_up_lookup

    gen = torch.Generator().manual_seed(11)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-7 if eps_mode == "keras" else 1e-8, eps_mode=eps_mode, l2=1e-4)
    specs, fmap, B, step = [(40, 16), (300, 8), (5, 16)], [1, 0, 2, 0], 100, 3100  # ~600 ids: ~19 programs
    elem, rs_start, pos, rpos = [], [], 5, 2
    for n, d in specs:
        elem.append(pos)
        rs_start.append(rpos)
        pos += n * d + 7
        rpos += n + 1
    meta = torch.tensor([[elem[t], specs[t][0], specs[t][1], 0, rs_start[t], 1] for t in fmap], dtype=torch.long)
    flat = [torch.randn(pos, generator=gen) * s for s in (1e-2, 1e-4)] + [torch.rand(pos, generator=gen) * 1e-8]
    rs = torch.full((rpos,), -7, dtype=torch.long)
    for t, (n, _) in enumerate(specs):
        rs[rs_start[t] : rs_start[t] + n] = step - torch.randint(0, 3000, (n,), generator=gen)
    lengths = torch.randint(0, 4, (len(fmap) * B,), generator=gen)
    ids = torch.cat([torch.randint(0, specs[fmap[i // B]][0], (int(lengths[i]),), generator=gen) for i in range(len(fmap) * B)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids[int(offsets[B])] = specs[0][0] + 3  # feature 1 reads table 0: an id outside it
    feature = (torch.searchsorted(offsets[::B], torch.arange(ids.numel()), right=True) - 1).tolist()
    read = {(fmap[f], k) for f, k in zip(feature, ids.tolist()) if 0 <= k < specs[fmap[f]][0]}  # (table, row)
    cur_t, cur_k = next(iter(sorted(read)))
    rs[rs_start[cur_t] + cur_k] = step  # a row the lookup reads that is already current
    bufs = [x.clone().to(DEV) for x in flat] + [rs.clone().to(DEV)]
    n_advanced = triton_catch_up_lookup(
        *bufs, meta.to(DEV), ids.to(index_dtype).to(DEV), offsets.to(index_dtype).to(DEV), step, max_dim=16, **kw
    )
    got = [b.cpu() for b in bufs]
    want_rs, written = rs.clone(), torch.zeros(pos, dtype=torch.bool)
    advanced = 0
    for t, k in sorted(read):
        n, d = specs[t]
        o, slot = elem[t] + k * d, rs_start[t] + k
        if int(rs[slot]) >= step:
            continue
        advanced += 1
        want_rs[slot] = step
        written[o : o + d] = True
        start = [x[o : o + d].view(1, d) for x in flat]
        want = catch_up(*start, rs[slot : slot + 1], step, **kw)
        for name, a, b, st in zip("wmv", got[:3], want, start):
            a = a[o : o + d].view(1, d)
            allowed = 1e-5 * b.abs() + 1e-6 * st.abs().max() + 1e-30  # as the per-row kernel's test
            worst = float(((a - b).abs() / allowed).max())
            assert worst <= 1.0, f"table {t} row {k} (gap {step - int(rs[slot])}) {name}: error {worst:.2f}x the allowed"
    assert advanced > 50 and int(n_advanced.sum()) == advanced  # each row once: repeats of a row lose the claim
    assert torch.equal(got[3], want_rs)
    for a, b in zip(got[:3], flat):
        assert torch.equal(a[~written], b[~written])


@needs_triton
def test_catch_up_kernel_in_the_tbe_equals_the_torch_catch_up():
    """``CowClipAdamTBE(catchup_op="triton")`` against ``catchup_op="torch"``: 40 steps of training
    with long gaps (two tables of dims 8 and 4), every lookup, then ``catch_up_all`` and every
    weight and moment."""
    pytest.importorskip("fbgemm_gpu")
    from recsys.optim.cowclip.tbe import CowClipAdamTBE
    from recsys.optim.cowclip.hyper import CowClipHyper

    def tbe(op):
        hp = CowClipHyper(learning_rate=0.01, l2=0.05, cowclip_r=1.0, cowclip_zeta=0.05, update_scope="catchup")
        t = CowClipAdamTBE([(30, 8), (200, 4)], [0, 1], hp, full_dims=[8, 4], mode="inline", catchup_op=op, device=DEV)
        with torch.no_grad():
            t.weights.copy_(torch.randn(t.weights.numel(), generator=torch.Generator().manual_seed(3)) * 0.05)
        return t

    tri, ref = tbe("triton"), tbe("torch")
    gen = torch.Generator().manual_seed(4)
    for step in range(40):
        bags = 4
        ids = torch.cat([torch.randint(0, 30 if step % 7 else 3, (bags,), generator=gen), torch.randint(0, 200, (bags,), generator=gen)])
        off = torch.arange(2 * bags + 1)
        grad = torch.randn(bags, 12, generator=gen)
        outs = []
        for t in (tri, ref):
            out = t(ids.to(DEV), off.to(DEV))
            out.backward(grad.to(DEV))
            outs.append(out.detach().cpu())
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-7)
    assert tri.catchup_op == "triton" and ref.catchup_op == "torch"
    assert tri.catch_up_all() == ref.catch_up_all() > 50
    assert torch.equal(tri.row_step.cpu(), ref.row_step.cpu())
    # float32 rounding: the two compute the same float64 factors but order a few float operations
    # differently; a weight that L2 pulls near 0 is a cancellation of terms of the buffer's size,
    # so the absolute part is about one ulp of the buffer's largest value
    for a, b in ((tri.weights, ref.weights), (tri.momentum1, ref.momentum1), (tri.momentum2, ref.momentum2)):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=5e-5, atol=1e-7 * float(b.abs().max()))


AOT = """
import re
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import recsys.optim.cowclip.kernels.triton_update as ctr
fn = ctr._kernel()
assert type(fn).__name__ == "JITFunction", type(fn)
sig = {"W": "*fp32", "M1": "*fp32", "M2": "*fp32", "RS": "*i64", "G": "*fp32", "stride_g": "i64",
       "SEG": "*i64", "SEG_FEAT": "*i64", "SEG_ROW": "*i64", "NSEG": "*i64", "SORT_SAMPLE": "*i32", "SORT_PSW": "*fp32",
       "META": "*i64", "ZETA_P": "*fp32", "CLIPPED": "*i32",
       **{k: "fp32" for k in "lr b1 b2 omb1 omb2 eps l2x2 r log2_b1 log2_b2".split()},
       **{k: "constexpr" for k in ("HAS_PSW", "HAS_L2", "KERAS", "BLOCK_D", "CHUNK")}}
for cap in (80, 90):
    for psw, l2, keras, bd in ((True, True, False, 16), (False, False, True, 64)):
        src = ASTSource(fn=fn, signature=sig, constexprs={"HAS_PSW": psw, "HAS_L2": l2, "KERAS": keras,
                                                          "BLOCK_D": bd, "CHUNK": ctr.CHUNK})
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 1})
        assert len(k.asm["cubin"]) > 1000
        # deterministic: no atomic instruction (optionally predicated: "@%p1 atom.global...")
        assert not re.search(r"^\\s*(@!?%p\\d+\\s+)?(atom|red)\\.", k.asm["ptx"], re.M)
        print(cap, psw, l2, keras, bd, "ok")
import recsys.optim.cowclip.kernels.triton_catchup as cct
fn = cct._kernel()
sig = {"W": "*fp32", "M": "*fp32", "V": "*fp32", "RS": "*i64", "WOFF": "*i64", "RSI": "*i64", "DIMS": "*i32",
       "HP": "*fp64", "CONST": "*fp64", "n_const": "i32", "step": "i64", **{k: "fp32" for k in "b1f b2f c_m c_v c2 epsf".split()},
       "KERAS": "constexpr", "BLOCK_D": "constexpr"}
for cap in (80, 90):
    for keras in (False, True):
        src = ASTSource(fn=fn, signature=sig, constexprs={"KERAS": keras, "BLOCK_D": 16})
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 1})
        assert len(k.asm["cubin"]) > 1000
        print(cap, "catch-up", keras, "ok")
fn = cct._lookup_kernel()
sig = {"W": "*fp32", "M": "*fp32", "V": "*fp32", "RS": "*i64", "IDX": "*i32", "OFFSETS": "*i32", "META": "*i64",
       "L": "i32", "F": "i32", "B": "i32", "OUT_WOFF": "*i64", "OUT_RS": "*i64", "OUT_D": "*i32", "COUNTS": "*i32",
       "HP": "*fp64", "CONST": "*fp64", "n_const": "i32", "step": "i32",  # a small int argument is int32
       **{k: "fp32" for k in "b1f b2f c_m c_v c2 epsf".split()},
       **{k: "constexpr" for k in ("BLOCK", "SEARCH_STEPS", "KERAS", "BLOCK_D")}}
for cap in (80, 90):
    for keras, idx in ((False, "*i64"), (True, "*i32")):
        src = ASTSource(fn=fn, signature={**sig, "IDX": idx, "OFFSETS": idx},
                        constexprs={"BLOCK": cct.LOOKUP_BLOCK, "SEARCH_STEPS": 5, "KERAS": keras, "BLOCK_D": 16})
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 1})
        assert re.search(r"atom\\.global\\.[a-z_.]*max\\.[su]64", k.asm["ptx"]), "no 64-bit atomic max"
        print(cap, "catch-up per id", keras, "ok")
"""


@needs_triton
def test_kernel_compiles_for_gpus_without_one(tmp_path):
    """The interpreter accepts things the compiler may not: compile the kernel ahead of time to
    cubin for sm_80 and sm_90 (ptxas ships with triton; no GPU or driver needed), in a process that
    imports triton in compiled mode. Its PTX has no atomics (reruns are bit-identical)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]), TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", AOT], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 12


def test_cpu_install_without_triton_keeps_working():
    """With triton unimportable the module imports, reports no Triton kernel and dispatches CUDA
    tensors to the per-table path (None) and one-table calls to ``fused_cowclip_adam_step``."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import recsys.optim.cowclip.kernels.triton_update as c, recsys.optim.cowclip.kernels.cpp_op as k\n"
        "import recsys.optim.cowclip.kernels.dispatch as d\n"
        "assert not c.triton_available() and not c.triton_available('cuda')\n"
        "assert d.tables_update_op('cuda') is None and d.catchup_backend('cuda') == 'torch'\n"
        "assert d.table_update_op('cuda') is k.fused_cowclip_adam_step\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_importing_the_module_does_not_import_triton():
    """Triton fixes interpreter vs compiled mode at its first import, so importing our module (as
    the TBE does) must leave that to whoever runs a kernel first; the CPU dispatch never imports it."""
    code = (
        "import sys\n"
        "import recsys.optim.cowclip.kernels.triton_update, recsys.optim.cowclip.kernels.dispatch as d\n"
        "assert d.table_update_op('cpu') is not None\n"
        "assert 'triton' not in sys.modules, 'imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
