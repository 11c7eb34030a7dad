"""The fused C++ CowClip-Adam op (recsys/optim/cowclip/kernels/cpp_op.py) inside ``CowClipAdamTBE``:
the inline backward's one multi-table call against the per-table loop, and MEAN pooling as SUM
pooling with per-sample weights ``1 / len(bag)``. The op itself: kernels/test_cpp_op.py.

If the extension cannot be built these tests FAIL, unless ``RECSYS_NO_CPP=1`` is set: then they
are skipped with that reason (shown by ``-ra``).
"""

from __future__ import annotations


import pytest
import torch

import recsys.optim.cowclip.kernels.cpp_op as ck


def test_tbe_inline_backward_uses_tables_op(ext):
    """CowClipAdamTBE inline backward (one multi-table call) == its per-table fallback loop
    (``tables_op=None``); the op is injected through the constructor."""
    import recsys.optim.cowclip.tbe as ct
    from recsys.optim.cowclip.hyper import CowClipHyper

    gen = torch.Generator().manual_seed(11)
    specs = [(40, 8), (25, 16), (30, 4)]
    hyper = CowClipHyper(learning_rate=1e-2, l2=1e-3, cowclip_zeta=1e-3)
    calls = []
    real = ck.fused_cowclip_adam_tables
    ops = [lambda *a, **k: calls.append(1) or real(*a, **k), None]
    tbes = []
    for op in ops:
        tbe = ct.CowClipAdamTBE(specs, [2, 0, 1], hyper, [8, 16, 4], mode="inline", tables_op=op)
        tbe.clip[1] = False
        with torch.no_grad():
            tbe.weights.copy_(torch.randn(tbe.weights.numel(), generator=torch.Generator().manual_seed(1)) * 0.05)
        tbes.append(tbe)
    B = 9
    for _ in range(3):
        lengths = torch.randint(0, 4, (3 * B,), generator=gen)
        rows_f = [specs[t][0] for t in [2, 0, 1]]
        vals = torch.cat([torch.randint(0, min(6, rows_f[i // B]), (int(n),), generator=gen) for i, n in enumerate(lengths)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        psw = torch.rand(vals.numel(), generator=gen) + 0.5
        target = torch.randn(B, 28, generator=gen)
        for tbe in tbes:
            out = tbe(vals, offsets, psw)
            ((out - target) ** 2).mean().backward()
        torch.testing.assert_close(tbes[0].weights, tbes[1].weights, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tbes[0].momentum2, tbes[1].momentum2, rtol=1e-5, atol=1e-9)
        assert torch.equal(tbes[0].row_step, tbes[1].row_step)
    assert len(calls) == 3
    assert tbes[0].stats.unique_rows == tbes[1].stats.unique_rows


@pytest.mark.parametrize("scope", ["batch", "catchup", "all"])
@pytest.mark.parametrize("weighted", [False, True])
def test_tbe_mean_pooling_is_sum_pooling_with_weights_one_over_the_bag(ext, scope, weighted):
    """A MEAN table: its forward is ``F.embedding_bag(mode="mean")`` (per-sample weights: the
    weighted sum over the bag's length), and its update is exactly that of the same SUM table fed
    per-sample weights ``1 / len(bag)`` (times the user's), under every update scope; empty bags
    are fine."""
    import torch.nn.functional as F
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    from recsys.optim.cowclip.tbe import CowClipAdamTBE
    from recsys.optim.cowclip.hyper import CowClipHyper

    hp = CowClipHyper(learning_rate=0.05, l2=1e-3, cowclip_zeta=0.05, update_scope=scope)
    specs = [(60, 8), (25, 4)]  # features read tables 1, 0
    mean = CowClipAdamTBE(specs, [1, 0], hp, [8, 4], mode="inline", pooling_mode=PoolingMode.MEAN)
    summ = CowClipAdamTBE(specs, [1, 0], hp, [8, 4], mode="inline")
    with torch.no_grad():
        summ.weights.copy_(mean.weights)
    g = torch.Generator().manual_seed(7)
    B, F_ = 32, 2
    for _ in range(4):
        lengths = torch.randint(0, 5, (F_ * B,), generator=g)  # some empty bags
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        ids = torch.randint(0, 25, (int(lengths.sum()),), generator=g)  # table 0's rows: repeats
        psw = torch.rand(ids.numel(), generator=g) + 0.5 if weighted else None
        grad = torch.randn(B, 4 + 8, generator=g)  # feature 0 reads table 1 (dim 4), feature 1 table 0 (dim 8)
        out = mean(ids, offsets, psw)
        # forward: per feature, the bag mean of its table's rows (FBGEMM's pooled output order)
        w_all = mean.split_embedding_weights()
        cols = 0
        for f, t in enumerate([1, 0]):
            lo, hi = int(offsets[f * B]), int(offsets[(f + 1) * B])
            offs = offsets[f * B : (f + 1) * B] - lo
            want = F.embedding_bag(ids[lo:hi], w_all[t].detach(), offs, mode="sum", per_sample_weights=None if psw is None else psw[lo:hi])
            n = lengths[f * B : (f + 1) * B].clamp(min=1).unsqueeze(1).float()
            d = specs[t][1]
            torch.testing.assert_close(out[:, cols : cols + d], want / n, rtol=1e-6, atol=1e-7)
            cols += d
        out.backward(grad[:, : out.shape[1]])
        inv = (1.0 / lengths.clamp(min=1).float()).repeat_interleave(lengths)
        summ(ids, offsets, inv if psw is None else inv * psw).backward(grad[:, : out.shape[1]])
    for name in ("weights", "momentum1", "momentum2", "row_step"):
        assert torch.equal(getattr(mean, name), getattr(summ, name)), name
    assert int(mean.row_step.sum()) > 0
