"""The fused C++ CowClip-Adam op (recsys/optim/csrc/cowclip_adam.cpp) through its loader and Python
entry points (recsys/optim/cowclip/kernels/cpp_op.py): the one-table op ``fused_cowclip_adam_step``
and the multi-table op ``fused_cowclip_adam_tables`` against the torch-ops reference
``cowclip_adam_step(update_scope="batch", l2_scope="batch", bias_correction="row")``, which
tests/unit/recsys/optim/cowclip/test_reference.py checks against a per-row loop; the reference
fallback and its reason; where the just-in-time build goes, and two ranks building it at once.

If the extension cannot be built these tests FAIL, unless ``RECSYS_NO_CPP=1`` is set: then the
op tests are skipped with that reason (shown by ``-ra``) and the fallback path is still checked.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import recsys.optim.cowclip.kernels.cpp_op as ck
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from tests.support.cowclip_tables import assert_update_matches

NO_CPP = os.environ.get("RECSYS_NO_CPP", "") not in ("", "0")
REPO = Path(__file__).resolve().parents[4]


# ----------------------------------------------------------------------------- random cases


def make_batch(gen, num_rows, dim, num_bags, max_len=4, id_range=None, weighted=True, zero_bags=0.0, grad_scale=0.05, hot=None):
    """Multi-hot bags: repeats within a bag and across bags, empty bags, optional zero gradients.
    ``hot``: a set of ids drawn half of the time (so they repeat across samples)."""
    id_range = id_range or num_rows
    lengths = torch.randint(0, max_len + 1, (num_bags,), generator=gen)
    lengths[0] = max(int(lengths[0]), 2)
    if num_bags > 2:
        lengths[1] = 0  # an empty bag
    if num_bags > 4:
        lengths[-1] = 0  # trailing empty bag
    L = int(lengths.sum())
    indices = torch.randint(0, id_range, (L,), generator=gen)
    if hot is not None:
        pick = torch.rand(L, generator=gen) < 0.5
        indices[pick] = hot[torch.randint(0, hot.numel(), (int(pick.sum()),), generator=gen)]
    offsets = torch.zeros(num_bags + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    for b in range(num_bags):  # a repeat inside each bag of >= 2 ids
        s, e = int(offsets[b]), int(offsets[b + 1])
        if e - s >= 2:
            indices[e - 1] = indices[s]
    grad_output = torch.randn(num_bags, dim, generator=gen) * grad_scale
    if zero_bags:
        grad_output[torch.rand(num_bags, generator=gen) < zero_bags] = 0
    psw = torch.rand(L, generator=gen) * 1.8 + 0.2 if weighted else None
    return indices, offsets, grad_output, psw


def make_weight(gen, n, d, tiny_every=5):
    w = torch.randn(n, d, generator=gen) * 0.02
    if tiny_every:
        w[::tiny_every] *= 1e-7  # zeta' floor is the active bound
    return w


def clone_state(st: CowClipAdamState) -> CowClipAdamState:
    return CowClipAdamState(st.exp_avg.clone(), st.exp_avg_sq.clone(), st.row_step.clone(), st.step.clone())


def run_both(weight, batches, **hp):
    """Runs the fused op and the reference on copies for all batches; checks after every step."""
    w_f, w_r = weight.clone(), weight.clone()
    s_f, s_r = CowClipAdamState.zeros_like(weight), CowClipAdamState.zeros_like(weight)
    # non-zero starting state so that untouched rows are distinguishable from a zeroing bug
    for s in (s_f, s_r):
        s.exp_avg.copy_(torch.linspace(-1e-3, 1e-3, weight.numel()).view_as(weight))
        s.exp_avg_sq.copy_(torch.linspace(0, 1e-4, weight.numel()).view_as(weight))
    for idx, off, go, psw in batches:
        before = (w_f.clone(), s_f.exp_avg.clone(), s_f.exp_avg_sq.clone(), s_f.row_step.clone())
        st_f = ck.fused_cowclip_adam_step(w_f, s_f, idx, off, go, psw, **hp)
        st_r = cowclip_adam_step(w_r, s_r, idx, off, go, psw, update_scope="batch", l2_scope="batch", bias_correction="row", **hp)
        torch.testing.assert_close(w_f, w_r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s_f.exp_avg, s_r.exp_avg, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s_f.exp_avg_sq, s_r.exp_avg_sq, rtol=1e-5, atol=1e-9)
        assert torch.equal(s_f.row_step, s_r.row_step)
        assert torch.equal(s_f.step, s_r.step)
        assert st_f.unique_rows == st_r.unique_rows
        assert abs(int(st_f.clipped_rows) - int(st_r.clipped_rows)) <= max(1, st_r.unique_rows // 100)
        # rows not in the batch: bit-identical
        absent = torch.ones(weight.shape[0], dtype=torch.bool)
        absent[idx.long()] = False
        for new, old in zip((w_f, s_f.exp_avg, s_f.exp_avg_sq, s_f.row_step), before):
            assert torch.equal(new[absent], old[absent])
    return w_f, s_f


HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, r=1.0, zeta=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("l2", [0.0, 1e-2])
def test_matches_reference_random(ext, seed, weighted, clip, l2):
    gen = torch.Generator().manual_seed(seed)
    n, d = 200, 16
    w = make_weight(gen, n, d)
    hot = torch.tensor([0, 5, 7, 10])  # repeated across samples; 0, 5, 10 are tiny rows
    batches = [
        make_batch(
            gen,
            n,
            d,
            num_bags=int(torch.randint(3, 40, (1,), generator=gen)),
            id_range=int(torch.randint(20, n + 1, (1,), generator=gen)),
            weighted=weighted,
            zero_bags=0.2,
            hot=hot,
        )
        for _ in range(5)
    ]  # 5 steps; ids drawn from shrinking/growing ranges -> rows skip steps
    _, s = run_both(w, batches, clip=clip, l2=l2, **HP)
    rs = s.row_step
    assert int(rs.max()) > int(rs[rs > 0].min()), "some rows should have skipped steps"


@pytest.mark.parametrize("dim", [1, 4, 7, 16, 33])
def test_matches_reference_dims_and_keras_eps(ext, dim):
    gen = torch.Generator().manual_seed(dim)
    w = make_weight(gen, 64, dim)
    batches = [make_batch(gen, 64, dim, 25, max_len=6, id_range=30) for _ in range(3)]
    run_both(w, batches, clip=True, l2=1e-3, eps_mode="keras", lr=1e-3, betas=(0.8, 0.99), eps=1e-7, r=0.5, zeta=1e-4)
    run_both(w, batches, clip=True, l2=0.0, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, r=2.0, zeta=1e-5)


def test_tiny_weights_zeta_bound_and_zero_gradients(ext):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, 16, generator=gen) * 1e-9  # every row on the zeta' floor
    idx, off, go, psw = make_batch(gen, 50, 16, 30, id_range=20, zero_bags=0.3, grad_scale=1.0)
    go[::2] = 0
    run_both(w, [(idx, off, go, psw)] * 3, clip=True, l2=0.0, **HP)
    # all gradients zero: moments decay, nothing NaN
    w2, s2 = run_both(w, [(idx, off, torch.zeros_like(go), psw)], clip=True, l2=0.0, **HP)
    assert torch.isfinite(w2).all() and torch.isfinite(s2.exp_avg_sq).all()


def test_large_table_one_hot(ext):
    gen = torch.Generator().manual_seed(3)
    n, d, b = 100_000, 16, 4096
    w = torch.randn(n, d, generator=gen) * 0.01
    u = torch.rand(b, generator=gen)
    idx = (torch.pow(float(n + 1), u).floor().long() - 1).clamp_(0, n - 1)  # power-law ids
    off = torch.arange(b + 1)
    go = torch.randn(b, d, generator=gen) * 1e-3
    run_both(w, [(idx, off, go, None), (idx.flip(0), off, go, None)], clip=True, l2=1e-5, **HP)


def _randn(*shape):
    """Seeded: these tests leave the global RNG alone (other test files draw from it unseeded)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def test_empty_batch_and_int32_ids(ext):
    w = _randn(10, 4)
    s = CowClipAdamState.zeros_like(w)
    w0 = w.clone()
    st = ck.fused_cowclip_adam_step(w, s, torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long), _randn(3, 4), lr=1e-2)
    assert st.unique_rows == 0 and torch.equal(w, w0) and int(s.step) == 1 and int(s.row_step.sum()) == 0
    gen = torch.Generator().manual_seed(1)
    idx, off, go, psw = make_batch(gen, 10, 4, 6)
    run_both(w, [(idx.int(), off.int(), go, psw)], clip=True, l2=0.0, **HP)


def test_bad_inputs_raise(ext):
    w = _randn(10, 4)
    s = CowClipAdamState.zeros_like(w)
    with pytest.raises(RuntimeError, match="out of range"):
        ck.fused_cowclip_adam_step(w, s, torch.tensor([3, 10]), torch.tensor([0, 2]), _randn(1, 4), lr=1e-2)
    with pytest.raises(RuntimeError, match="bags"):
        ck.fused_cowclip_adam_step(w, s, torch.tensor([3, 4]), torch.tensor([0, 2]), _randn(2, 4), lr=1e-2)
    with pytest.raises(RuntimeError, match="offsets"):
        ck.fused_cowclip_adam_step(w, s, torch.tensor([3, 4]), torch.tensor([0, 1]), _randn(1, 4), lr=1e-2)


def test_threads_give_same_result(ext):
    gen = torch.Generator().manual_seed(5)
    w = make_weight(gen, 3000, 16)
    batch = make_batch(gen, 3000, 16, 2000, max_len=5)
    out = []
    old = torch.get_num_threads()
    try:
        for t in (1, max(2, old)):
            torch.set_num_threads(t)
            w_t, s_t = w.clone(), CowClipAdamState.zeros_like(w)
            ck.fused_cowclip_adam_step(w_t, s_t, *batch, lr=1e-2, l2=1e-4)
            out.append((w_t, s_t.exp_avg, s_t.exp_avg_sq))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*out):
        assert torch.equal(a, b)  # rows are independent: threading changes nothing


def test_fallback_path_matches_reference(monkeypatch):
    """The reference path (CUDA tensors / no extension) is the reference itself, with one warning."""
    monkeypatch.setattr(ck, "_loaded", False)
    monkeypatch.setattr(ck, "_reason", "forced by test")
    monkeypatch.setattr(ck, "_warned", False)
    gen = torch.Generator().manual_seed(2)
    w = make_weight(gen, 40, 8)
    batch = make_batch(gen, 40, 8, 12)
    w_f, s_f = w.clone(), CowClipAdamState.zeros_like(w)
    w_r, s_r = w.clone(), CowClipAdamState.zeros_like(w)
    assert not ck.fused_available()
    ck.fused_cowclip_adam_step(w_f, s_f, *batch, lr=1e-2, l2=1e-3)
    cowclip_adam_step(w_r, s_r, *batch, lr=1e-2, l2=1e-3)
    assert torch.equal(w_f, w_r) and torch.equal(s_f.exp_avg_sq, s_r.exp_avg_sq)


def test_clean_build_two_processes(tmp_path):
    """From an empty cache, two processes (ranks) JIT-build concurrently under the lock (RECSYS_CPP_JIT:
    an installed build is not used); the one that builds says so in one line
    (build time is not asserted: timings belong in benchmarks)."""
    if NO_CPP:
        pytest.skip("RECSYS_NO_CPP=1")
    code = textwrap.dedent("""
        import recsys.optim.cowclip.kernels.cpp_op as ck
        ck.load_extension(require=True)
        print("ok")
    """)
    env = dict(os.environ, RECSYS_EXT_DIR=str(tmp_path / "ext"), RECSYS_CPP_JIT="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-2000:]
        assert o.startswith("ok")
    assert sum(e.count("building the CowClip op (first use, ~10 s) into ") for _, e in outs) == 1


def test_no_cpp_flag_falls_back_with_its_reason(monkeypatch):
    """``RECSYS_NO_CPP=1`` skips both builds: the op is reported unavailable, the reason names the
    flag, and ``require=True`` turns that into one error line."""
    monkeypatch.setattr(ck, "_loaded", None)  # not tried yet in this process
    monkeypatch.setattr(ck, "_reason", "not loaded yet")
    monkeypatch.setenv("RECSYS_NO_CPP", "1")
    assert not ck.fused_available()
    assert ck.fallback_reason() == "RECSYS_NO_CPP is set"
    with pytest.raises(RuntimeError, match=r"^CowClip C\+\+ extension not available: RECSYS_NO_CPP is set$"):
        ck.load_extension(require=True)


def test_jit_build_directory_per_user_python_torch_and_source(monkeypatch, tmp_path):
    """The JIT cache root: ``RECSYS_EXT_DIR``, else ``$XDG_CACHE_HOME/recsys/torch_extensions``, else
    under ``~/.cache``; below it one directory per Python, torch and source hash (the hash of the
    shipped C++ file, computed here from the file in the repository)."""
    sha = hashlib.sha256((REPO / "recsys" / "optim" / "csrc" / "cowclip_adam.cpp").read_bytes()).hexdigest()
    assert ck.source_sha256() == sha
    monkeypatch.setenv("RECSYS_EXT_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ck.cache_root() == tmp_path / "ext"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}_src{sha[:16]}"
    assert ck.build_dir() == tmp_path / "ext" / tag / "recsys_cowclip_adam"
    monkeypatch.delenv("RECSYS_EXT_DIR")
    assert ck.cache_root() == tmp_path / "xdg" / "recsys" / "torch_extensions"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ck.cache_root() == tmp_path / "home" / ".cache" / "recsys" / "torch_extensions"


# ----------------------------------------------------------------------------- multi-table op


def _tables_case(gen, specs, num_bags, weighted, max_len=4, int32=False, empty_feature=None):
    """A flat table-batched group (tables of ``specs`` [(rows, dim, clip)], feature f reads table
    T-1-f so feature and table order differ) and a feature-major KJT lookup with multi-hot bags."""
    T = len(specs)
    feature_table = list(reversed(range(T)))
    woffs, rstarts = [0], [0]
    for n, d, _ in specs:
        woffs.append(woffs[-1] + n * d)
        rstarts.append(rstarts[-1] + n)
    weights = torch.randn(woffs[-1], generator=gen) * 0.02
    weights[::7] *= 1e-7
    m1 = torch.linspace(-1e-3, 1e-3, woffs[-1])
    m2 = torch.linspace(0, 1e-4, woffs[-1])
    row_step = torch.randint(0, 3, (rstarts[-1],), generator=gen)
    dims = [specs[t][1] for t in feature_table]
    d_off = [0]
    for d in dims:
        d_off.append(d_off[-1] + d)
    idx_l, len_l, psw_l = [], [], []
    for f, t in enumerate(feature_table):
        n = specs[t][0]
        hot = torch.tensor([0, 1, n - 1]) if n > 2 else None
        i, o, _, p = make_batch(gen, n, specs[t][1], num_bags, max_len=max_len, id_range=min(n, 30 + 7 * f), weighted=True, hot=hot)
        if f == empty_feature:
            i, o, p = i[:0], torch.zeros_like(o), p[:0]
        idx_l.append(i)
        len_l.append(o[1:] - o[:-1])
        psw_l.append(p)
    indices = torch.cat(idx_l)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.cat(len_l), 0)])
    psw = torch.cat(psw_l) if weighted else None
    grad = torch.randn(num_bags, d_off[-1], generator=gen) * 0.05
    grad[torch.rand(num_bags, generator=gen) < 0.2] = 0
    meta = torch.tensor(
        [[woffs[t], specs[t][0], specs[t][1], d_off[f], rstarts[t], int(specs[t][2])] for f, t in enumerate(feature_table)],
        dtype=torch.long,
    )
    zeta = torch.tensor([1e-5 * (1 + f) for f in range(T)], dtype=torch.float64)
    if int32:
        indices, offsets = indices.int(), offsets.int()
    return dict(
        weights=weights,
        m1=m1,
        m2=m2,
        row_step=row_step,
        meta=meta,
        zeta=zeta,
        indices=indices,
        offsets=offsets,
        grad=grad,
        psw=psw,
        feature_table=feature_table,
        woffs=woffs,
        rstarts=rstarts,
        specs=specs,
        d_off=d_off,
    )


def _tables_reference(c, **hp):
    """Per-table reference on views of copies of the flat buffers; returns (buffers, stats [F, 2])."""
    w, m1, m2, rs = c["weights"].clone(), c["m1"].clone(), c["m2"].clone(), c["row_step"].clone()
    F = len(c["feature_table"])
    B = (c["offsets"].numel() - 1) // F
    offs = c["offsets"].long()
    stats = torch.zeros(F, 2, dtype=torch.long)
    for f, t in enumerate(c["feature_table"]):
        n, d, clip = c["specs"][t]
        lo, hi = int(offs[f * B]), int(offs[(f + 1) * B])
        sl = slice(c["woffs"][t], c["woffs"][t + 1])
        st = CowClipAdamState(
            m1[sl].view(n, d), m2[sl].view(n, d), rs[c["rstarts"][t] : c["rstarts"][t + 1]], torch.zeros((), dtype=torch.long)
        )
        out = cowclip_adam_step(
            w[sl].view(n, d),
            st,
            c["indices"][lo:hi].long(),
            offs[f * B : (f + 1) * B + 1] - lo,
            c["grad"][:, c["d_off"][f] : c["d_off"][f + 1]].contiguous(),
            c["psw"][lo:hi] if c["psw"] is not None else None,
            zeta=float(c["zeta"][f]),
            clip=clip,
            update_scope="batch",
            l2_scope="batch",
            bias_correction="row",
            **hp,
        )
        stats[f, 0], stats[f, 1] = out.unique_rows, int(out.clipped_rows)
    return (w, m1, m2, rs), stats


def _tables_fused(c, **hp):
    w, m1, m2, rs = c["weights"].clone(), c["m1"].clone(), c["m2"].clone(), c["row_step"].clone()
    stats = ck.fused_cowclip_adam_tables(w, m1, m2, rs, c["meta"], c["zeta"], c["indices"], c["offsets"], c["grad"], c["psw"], **hp)
    return (w, m1, m2, rs), stats


def _assert_tables_close(c, got, want, stats_got, stats_want):
    row_dims = torch.tensor([dim for rows, dim, *_ in c["specs"] for _ in range(rows)])
    before = (c["weights"], c["m1"], c["m2"], c["row_step"])
    assert_update_matches(got, want, before, row_dims, stats_got, stats_want)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("l2", [0.0, 1e-2])
def test_tables_op_matches_reference(ext, seed, weighted, l2):
    gen = torch.Generator().manual_seed(100 + seed)
    specs = [(50, 16, True), (3, 4, True), (80, 7, False), (40, 33, True), (60, 8, True), (20, 1, False)]
    c = _tables_case(gen, specs, num_bags=int(torch.randint(5, 40, (1,), generator=gen)), weighted=weighted)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, r=1.0, l2=l2)
    got, sg = _tables_fused(c, **hp)
    want, sw = _tables_reference(c, **hp)
    _assert_tables_close(c, got, want, sg, sw)


def test_tables_op_keras_int32_empty_feature_and_threads(ext):
    gen = torch.Generator().manual_seed(7)
    specs = [(500, 16, True), (300, 32, True), (200, 4, True), (100, 5, False)]
    c = _tables_case(gen, specs, num_bags=300, weighted=True, max_len=6, int32=True, empty_feature=2)
    hp = dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-7, r=0.5, l2=1e-3, eps_mode="keras")
    want, sw = _tables_reference(c, **hp)
    old = torch.get_num_threads()
    outs = []
    try:
        for nt in (1, 2, 8):  # 8 > tables: the row-parallel path
            torch.set_num_threads(nt)
            got, sg = _tables_fused(c, **hp)
            _assert_tables_close(c, got, want, sg, sw)
            outs.append(got)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    for a, b in zip(outs[0], outs[2]):
        assert torch.equal(a, b)
    assert int(sg[2, 0]) == 0


def test_tables_op_bad_inputs(ext):
    gen = torch.Generator().manual_seed(3)
    c = _tables_case(gen, [(30, 4, True), (20, 8, True)], num_bags=6, weighted=False)
    hp = dict(lr=1e-2)
    bad = dict(c, indices=c["indices"].clone())
    f1_rows = c["specs"][c["feature_table"][1]][0]
    bad["indices"][-1] = f1_rows  # the last index is the last feature's: one past its table
    with pytest.raises(RuntimeError, match="out of range"):
        _tables_fused(bad, **hp)
    with pytest.raises(RuntimeError, match="bags"):
        _tables_fused(dict(c, grad=c["grad"][:-1]), **hp)
    with pytest.raises(RuntimeError, match="offsets"):
        _tables_fused(dict(c, offsets=c["offsets"][:-2]), **hp)
    meta = c["meta"].clone()
    meta[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="outside"):
        _tables_fused(dict(c, meta=meta), **hp)
    # after failures the op still works (scratch state restored)
    got, sg = _tables_fused(c, **hp)
    want, sw = _tables_reference(c, **hp)
    _assert_tables_close(c, got, want, sg, sw)


def test_tables_op_rejects_shared_tables(ext):
    gen = torch.Generator().manual_seed(4)
    c = _tables_case(gen, [(30, 4, True), (20, 4, True)], num_bags=5, weighted=False)
    meta = c["meta"].clone()
    meta[1, 0], meta[1, 4] = meta[0, 0], meta[0, 4]  # both features on one table: would race
    meta[1, 1] = meta[0, 1]
    with pytest.raises(RuntimeError, match="distinct"):
        _tables_fused(dict(c, meta=meta), lr=1e-2)
