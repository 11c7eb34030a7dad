"""The Triton catch-up of rows behind the global step (recsys/optim/cowclip/kernels/triton_catchup.py)
against the torch catch-up ``catch_up`` (recsys/optim/cowclip/catchup.py): its two entry points,
``triton_catch_up_rows`` (distinct rows) and ``triton_catch_up_lookup`` (a lookup's ids, repeats
included), and ``CowClipAdamTBE(catchup_op="triton")`` against ``catchup_op="torch"``.

Without a CUDA device the kernels run on CPU tensors under Triton's interpreter (this folder's
conftest imports triton with ``TRITON_INTERPRET=1``); with one (``make test-gpu``) the same tests
compile them for real and run on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.usefixtures("needs_triton")  # conftest.py: skips where the kernels cannot run

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
