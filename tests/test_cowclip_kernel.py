"""The fused C++ CowClip-Adam op (recsys/optim/csrc/cowclip_adam.cpp via recsys/optim/cowclip_kernel.py)
against the torch-ops reference ``cowclip_adam_step(update_scope="batch", l2_scope="batch",
bias_correction="row")``, which tests/test_cowclip_math.py checks against a per-row loop.

If the extension cannot be built these tests FAIL, unless ``RECSYS_NO_CPP=1`` is set: then the
op tests are skipped with that reason (shown by ``-ra``) and the fallback path is still checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from recsys.optim import cowclip_kernel as ck
from recsys.optim.cowclip import CowClipAdamState, cowclip_adam_step

NO_CPP = os.environ.get("RECSYS_NO_CPP", "") not in ("", "0")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ext():
    if NO_CPP:
        pytest.skip("RECSYS_NO_CPP=1: C++ CowClip op not built; only the fallback is tested")
    ck.load_extension(require=True)  # raises (test fails) when the build fails
    return torch.ops.recsys.cowclip_adam_step_


# ----------------------------------------------------------------------------- random cases


def make_batch(gen, num_rows, dim, num_bags, max_len=4, id_range=None, weighted=True,
               zero_bags=0.0, grad_scale=0.05, hot=None):
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
        st_r = cowclip_adam_step(w_r, s_r, idx, off, go, psw, update_scope="batch", l2_scope="batch",
                                 bias_correction="row", **hp)
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
    batches = [make_batch(gen, n, d, num_bags=int(torch.randint(3, 40, (1,), generator=gen)),
                          id_range=int(torch.randint(20, n + 1, (1,), generator=gen)),
                          weighted=weighted, zero_bags=0.2, hot=hot)
               for _ in range(5)]  # 5 steps; ids drawn from shrinking/growing ranges -> rows skip steps
    _, s = run_both(w, batches, clip=clip, l2=l2, **HP)
    rs = s.row_step
    assert int(rs.max()) > int(rs[rs > 0].min()), "some rows should have skipped steps"


@pytest.mark.parametrize("dim", [1, 4, 7, 16, 33])
def test_matches_reference_dims_and_keras_eps(ext, dim):
    gen = torch.Generator().manual_seed(dim)
    w = make_weight(gen, 64, dim)
    batches = [make_batch(gen, 64, dim, 25, max_len=6, id_range=30) for _ in range(3)]
    run_both(w, batches, clip=True, l2=1e-3, eps_mode="keras", lr=1e-3, betas=(0.8, 0.99), eps=1e-7,
             r=0.5, zeta=1e-4)
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
    st = ck.fused_cowclip_adam_step(w, s, torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                                    _randn(3, 4), lr=1e-2)
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


@pytest.mark.slow
def test_clean_build_two_processes(tmp_path):
    """From an empty cache, two processes (ranks) build concurrently under the lock; < 90 s."""
    if NO_CPP:
        pytest.skip("RECSYS_NO_CPP=1")
    code = textwrap.dedent("""
        import time; t = time.perf_counter()
        from recsys.optim import cowclip_kernel as ck
        ck.load_extension(require=True)
        print("ok", time.perf_counter() - t)
    """)
    env = dict(os.environ, RECSYS_EXT_DIR=str(tmp_path / "ext"))
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-2000:]
        assert o.startswith("ok")
    assert max(float(o.split()[1]) for o, _ in outs) < 90
