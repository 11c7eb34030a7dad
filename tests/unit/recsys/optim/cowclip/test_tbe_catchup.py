"""The catch-up half of the CowClip-Adam TBE (recsys/optim/cowclip/tbe_catchup.py) on FBGEMM's CPU
TBE: the global step and where it comes from, rows brought up to date when a lookup reads them or
before a checkpoint, against the dense semantics (every row, every step) written out per row in
plain floats."""

from __future__ import annotations

import math

import torch

from recsys.optim.cowclip.hyper import CowClipHyper
from recsys.optim.cowclip.tbe import CowClipAdamTBE

B1, B2 = 0.9, 0.999
LR, EPS, R, ZETA, L2 = 0.05, 1e-8, 0.5, 1e-5, 0.05
W0 = [[3.0, 4.0, 0.0, 0.0], [0.3, 0.0, -0.4, 0.0], [0.5, 0.5, 0.5, 0.5], [1e-9, 0.0, 0.0, 0.0], [-1.0, 1.0, -1.0, 1.0]]
# three steps of one feature, batch 2: rows {0, 1}, then {0}, then {1, 2}; rows 3 and 4 never read
BATCHES = [
    (torch.tensor([0, 1, 0]), torch.tensor([0, 2, 3]), [[1.0, -2.0, 0.5, 0.0], [0.2, 0.4, -0.6, 0.8]]),
    (torch.tensor([0]), torch.tensor([0, 1, 1]), [[-0.3, 0.1, 0.2, 0.0], [9.0, 9.0, 9.0, 9.0]]),
    (torch.tensor([2, 1]), torch.tensor([0, 1, 2]), [[0.0, 0.5, 0.0, -0.5], [0.1, 0.1, 0.1, 0.1]]),
]


def dense_steps(steps: int) -> tuple[list, list, list]:
    """The dense semantics on plain floats: at every step t every row k gets g_k (its batch
    gradient, or 0) + 2*l2*w_k, the clip r * cnt * max(||w||, r * sqrt(4) * zeta) (cnt 1 for an
    absent row), and Adam with bias-correction step t."""
    w = [list(r) for r in W0]
    m = [[0.0] * 4 for _ in w]
    v = [[0.0] * 4 for _ in w]
    for t, (idx, off, go) in enumerate(BATCHES[:steps], start=1):
        grads: dict[int, list[float]] = {}
        samples: dict[int, set[int]] = {}
        for b in range(len(off) - 1):
            for i in range(int(off[b]), int(off[b + 1])):
                k = int(idx[i])
                grads[k] = [a + c for a, c in zip(grads.get(k, [0.0] * 4), go[b])]
                samples.setdefault(k, set()).add(b)
        for k in range(len(w)):
            g = [gi + 2 * L2 * wi for gi, wi in zip(grads.get(k, [0.0] * 4), w[k])]
            c = R * len(samples.get(k, {0})) * max(math.sqrt(sum(x * x for x in w[k])), R * math.sqrt(4) * ZETA)
            gn = math.sqrt(sum(x * x for x in g))
            if gn > c:
                g = [x * c / gn for x in g]
            m[k] = [B1 * a + (1 - B1) * b for a, b in zip(m[k], g)]
            v[k] = [B2 * a + (1 - B2) * b * b for a, b in zip(v[k], g)]
            w[k] = [wi - LR * (mi / (1 - B1**t)) / (math.sqrt(vi) / math.sqrt(1 - B2**t) + EPS) for wi, mi, vi in zip(w[k], m[k], v[k])]
    return w, m, v


def _tbe(update_scope: str = "catchup", **kw) -> CowClipAdamTBE:
    hp = CowClipHyper(learning_rate=LR, eps=EPS, cowclip_r=R, cowclip_zeta=ZETA, l2=L2, update_scope=update_scope)
    tbe = CowClipAdamTBE([(5, 4)], [0], hp, full_dims=[4], mode="inline", **kw)
    with torch.no_grad():
        tbe.weights.copy_(torch.tensor(W0).flatten())
    return tbe


def _train(tbe: CowClipAdamTBE, steps: int) -> None:
    for idx, off, go in BATCHES[:steps]:
        tbe(idx, off).backward(torch.tensor(go))


def _assert_rows(tbe: CowClipAdamTBE, rows: list[int], expect: tuple[list, list, list]) -> None:
    w, m, v = expect
    for buf, ref in ((tbe.weights, w), (tbe.momentum1, m), (tbe.momentum2, v)):
        got = buf.view(5, 4)[rows]
        torch.testing.assert_close(got, torch.tensor([ref[k] for k in rows]), rtol=1e-5, atol=1e-7)


def test_catch_up_all_gives_the_dense_semantics():
    """Blocks of one step (growth 1): the exact iteration. Rows read at step 3 were caught up by
    its lookup; rows 0, 3 and 4 are behind until ``catch_up_all``."""
    tbe = _tbe(catchup_growth=1.0, catchup_op="torch")
    _train(tbe, 3)
    assert tbe.dense_step() == 3
    assert tbe.row_step.tolist() == [2, 3, 3, 0, 0]
    _assert_rows(tbe, [1, 2], dense_steps(3))
    assert tbe.catch_up_all() == 3
    assert tbe.row_step.tolist() == [3] * 5
    _assert_rows(tbe, [0, 1, 2, 3, 4], dense_steps(3))
    assert tbe.catch_up_all() == 0  # nothing behind any more


def test_default_blocks_are_exact_for_gaps_of_one_and_two_steps():
    """Growth 2 takes blocks of 1, then 2 cut to what is left: gaps of 1 and 2 are exact steps."""
    tbe = _tbe(catchup_op="torch")
    _train(tbe, 2)
    assert tbe.row_step.tolist() == [2, 1, 0, 0, 0]
    assert tbe.catch_up_all() == 4  # row 1 one step behind, rows 2, 3, 4 two
    _assert_rows(tbe, [0, 1, 2, 3, 4], dense_steps(2))


def test_an_eval_lookup_reads_caught_up_rows():
    tbe = _tbe(catchup_growth=1.0, catchup_op="torch")
    _train(tbe, 2)
    with torch.no_grad():
        out = tbe(torch.tensor([4, 1, 3]), torch.tensor([0, 2, 3]))
    w, _, _ = dense_steps(2)
    expect = torch.tensor([[a + b for a, b in zip(w[4], w[1])], w[3]])
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-7)
    assert tbe.row_step.tolist() == [2, 2, 0, 2, 2] and tbe.dense_step() == 2  # a lookup does not step


def test_dense_step_is_derived_from_row_step_and_cached():
    tbe = _tbe()
    tbe.row_step.copy_(torch.tensor([4, 7, 0, 2, 7]))
    assert tbe.dense_step(cache=False) == 7
    tbe.row_step.fill_(1)
    assert tbe.dense_step() == 1  # not cached by the call above
    tbe.row_step.fill_(5)
    assert tbe.dense_step() == 1  # cached now
    tbe.forget_dense_step()  # a checkpoint was loaded in place
    assert tbe.dense_step() == 5


def test_a_training_step_advances_the_global_step_by_one():
    tbe = _tbe(catchup_op="torch")
    for step, (idx, off, go) in enumerate(BATCHES, start=1):
        tbe(idx, off).backward(torch.tensor(go))
        assert tbe.dense_step() == step


def test_catch_up_all_is_a_no_op_for_the_lazy_scope():
    tbe = _tbe(update_scope="batch")
    _train(tbe, 2)
    before = (tbe.weights.clone(), tbe.row_step.clone())
    assert tbe.catch_up_all() == 0
    assert torch.equal(tbe.weights, before[0]) and torch.equal(tbe.row_step, before[1])
    assert tbe.row_step.tolist() == [2, 1, 0, 0, 0]
