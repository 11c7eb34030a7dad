"""The Triton CowClip-Adam update kernel (recsys/optim/cowclip/kernels/triton_update.py) against the
torch-ops reference ``cowclip_adam_step(update_scope="batch", l2_scope="batch", bias_correction="row")``
(itself checked against a per-row loop in tests/unit/recsys/optim/cowclip/test_reference.py), and
against counts and norms computed here; its ahead-of-time compilation for GPUs; and that importing
it leaves triton unimported.

Without a CUDA device the kernel runs on CPU tensors under Triton's interpreter (this folder's
conftest imports triton with ``TRITON_INTERPRET=1``); with one (``make test-gpu``) the same tests
compile it for real and run on CUDA tensors.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import recsys.optim.cowclip.kernels.triton_update as ctr
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from tests.support.cowclip_tables import assert_update_matches
from tests.support.processes import fresh_python

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REPO = Path(__file__).resolve().parents[4]
needs_triton = pytest.mark.usefixtures("needs_triton")  # conftest.py: skips where the kernel cannot run


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
        assert_update_matches(bufs, ref, before, g.row_dims(), s_got, s_want)
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
        assert_update_matches(bufs, ref, [g.weights, g.m1, g.m2, g.row_step], g.row_dims(), s_got, s_want, exact_clipped=True)


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
    assert_update_matches(bufs, ref, [g.weights, g.m1, g.m2, g.row_step], g.row_dims(), s_got, s_want, exact_clipped=True)
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
        assert_update_matches(bufs, ref, [g.weights, g.m1, g.m2, g.row_step], g.row_dims(), s_got, s_want)
        outs.append(bufs)
    assert int(s_got[1, 0]) == 0
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- errors


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
        with pytest.raises(RuntimeError, match=re.escape(msg)) as e:
            ctr.triton_cowclip_adam_tables(
                *bufs, args["meta"], g.zeta, args["indices"].to(DEV), args["offsets"].to(DEV), args["grad"].to(DEV), None, **hp
            )
        assert str(e.value) == msg
        for new, old in zip(bufs, (g.weights, g.m1, g.m2, g.row_step)):
            assert torch.equal(new.cpu(), old)


# ----------------------------------------------------------------------------- compiled for a GPU

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
    assert out.stdout.count("ok") == 4


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
    out = fresh_python(code, path=sys.path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
