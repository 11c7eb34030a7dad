"""The table-batched CowClip-Adam module (recsys/optim/cowclip/tbe.py) on FBGEMM's CPU TBE, with
tables of a few rows: the pooled, mean and unpooled lookups, the in-backward update of every
scope against CowClip-Adam written out per row in plain floats, the rows a deferred backward
stages, the full-row clip of a column shard, and the errors of what it does not support."""

from __future__ import annotations

import math

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from recsys.optim.cowclip.hyper import CowClipHyper
from recsys.optim.cowclip.tbe import CowClipAdamTBE

B1, B2 = 0.9, 0.999
# table 0: 5 rows x 4 (norms 5, 0.5, 1, ~0, 2), table 1: 3 rows x 2
T0 = [[3.0, 4.0, 0.0, 0.0], [0.3, 0.0, -0.4, 0.0], [0.5, 0.5, 0.5, 0.5], [1e-9, 0.0, 0.0, 0.0], [-1.0, 1.0, -1.0, 1.0]]
T1 = [[0.6, -0.8], [0.0, 2.0], [-0.1, 0.1]]


def hand_step(w, m, v, t, g, cnt, *, lr, eps, r, zeta, l2, full_dim, clip=True, add_l2=True, norms=None):
    """One CowClip-Adam row update on plain floats: g + 2*l2*w, the clip
    r * cnt * max(||w||, r * sqrt(full_dim) * zeta) (``norms``: the full row's ||w||, ||g||), then
    Adam with bias-correction step t (torch eps). Returns (w, m, v, clipped)."""
    if add_l2:
        g = [gi + 2 * l2 * wi for gi, wi in zip(g, w)]
    clipped = False
    if clip:
        wn, gn = norms or (math.sqrt(sum(x * x for x in w)), math.sqrt(sum(x * x for x in g)))
        c = r * cnt * max(wn, r * math.sqrt(full_dim) * zeta)
        if gn > c:
            clipped = True
            g = [x * c / gn for x in g]
    m = [B1 * a + (1 - B1) * b for a, b in zip(m, g)]
    v = [B2 * a + (1 - B2) * b * b for a, b in zip(v, g)]
    w = [wi - lr * (mi / (1 - B1**t)) / (math.sqrt(vi) / math.sqrt(1 - B2**t) + eps) for wi, mi, vi in zip(w, m, v)]
    return w, m, v, clipped


HP = dict(lr=0.1, eps=1e-8, r=0.5, zeta=1e-5, l2=0.05)


def _hyper(**kw) -> CowClipHyper:
    base = dict(learning_rate=HP["lr"], eps=HP["eps"], cowclip_r=HP["r"], cowclip_zeta=HP["zeta"], l2=HP["l2"], update_scope="batch")
    return CowClipHyper(**{**base, **kw})


def _two_tables(mode: str = "inline", **kw) -> CowClipAdamTBE:
    hyper = kw.pop("hyper", None) or _hyper()
    tbe = CowClipAdamTBE([(5, 4), (3, 2)], [0, 1], hyper, full_dims=[4, 2], mode=mode, **kw)
    with torch.no_grad():
        tbe.weights.copy_(torch.tensor([x for row in T0 + T1 for x in row]))
    return tbe


class HandTables:
    """The two tables and their Adam state as lists of floats."""

    def __init__(self) -> None:
        self.w = [[list(r) for r in T0], [list(r) for r in T1]]
        self.m = [[[0.0] * len(r) for r in t] for t in self.w]
        self.v = [[[0.0] * len(r) for r in t] for t in self.w]
        self.t = [[0] * len(t) for t in self.w]
        self.clipped = 0

    def update(self, table: int, row: int, g: list[float], cnt: int, t: int | None = None, **kw) -> None:
        self.t[table][row] += 1
        step = self.t[table][row] if t is None else t
        dim = len(self.w[table][row])
        w, m, v, c = hand_step(self.w[table][row], self.m[table][row], self.v[table][row], step, g, cnt, full_dim=dim, **{**HP, **kw})
        self.w[table][row], self.m[table][row], self.v[table][row] = w, m, v
        self.clipped += c

    def check(self, tbe: CowClipAdamTBE) -> None:
        for t, (w, st) in enumerate(zip(tbe.split_embedding_weights(), tbe.get_optimizer_state())):
            torch.testing.assert_close(w, torch.tensor(self.w[t]), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(st["exp_avg"], torch.tensor(self.m[t]), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(st["exp_avg_sq"], torch.tensor(self.v[t]), rtol=1e-5, atol=1e-9)
            assert st["row_step"].tolist() == self.t[t]


# step 1: feature 0 bags (0, 1, 0) and (1); feature 1 bags (2) and (2)
IDX1, OFF1 = torch.tensor([0, 1, 0, 1, 2, 2]), torch.tensor([0, 3, 4, 5, 6])
GO1 = [[1.0, -2.0, 0.5, 0.0, 0.3, -0.1], [0.2, 0.4, -0.6, 0.8, -0.5, 0.2]]
# step 2: feature 0 bags (0) and (); feature 1 bags () and (0)
IDX2, OFF2 = torch.tensor([0, 0]), torch.tensor([0, 1, 1, 1, 2])
GO2 = [[-0.3, 0.1, 0.2, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 4.0, -3.0]]


def _add(*rows: list[float]) -> list[float]:
    return [sum(x) for x in zip(*rows)]


def _train(tbe: CowClipAdamTBE, idx: torch.Tensor, off: torch.Tensor, go: list[list[float]]) -> None:
    out = tbe(idx, off)
    out.backward(torch.tensor(go))


def test_inline_batch_scope_two_steps_by_hand():
    tbe = _two_tables()
    hand = HandTables()
    _train(tbe, IDX1, OFF1, GO1)
    a, b = GO1
    hand.update(0, 0, _add(a[:4], a[:4]), cnt=1)  # twice in bag 0: one sample
    hand.update(0, 1, _add(a[:4], b[:4]), cnt=2)
    hand.update(1, 2, _add(a[4:], b[4:]), cnt=2)
    hand.check(tbe)
    _train(tbe, IDX2, OFF2, GO2)
    hand.update(0, 0, GO2[0][:4], cnt=1)  # its second update: t = 2
    hand.update(1, 0, GO2[1][4:], cnt=1)
    hand.check(tbe)
    assert hand.clipped > 0
    assert tbe.stats.take() == (5, hand.clipped)


def test_update_scope_all_moves_every_row_with_the_global_step():
    """Absent rows: g = 2*l2*w, cnt = 1, t = the step; batch rows as in the lazy update but with t
    the global step too."""
    tbe = _two_tables(hyper=_hyper(update_scope="all"))
    hand = HandTables()
    for step, (idx, off, go, batch) in enumerate(
        [
            (
                IDX1,
                OFF1,
                GO1,
                {
                    (0, 0): (_add(GO1[0][:4], GO1[0][:4]), 1),
                    (0, 1): (_add(GO1[0][:4], GO1[1][:4]), 2),
                    (1, 2): (_add(GO1[0][4:], GO1[1][4:]), 2),
                },
            ),
            (IDX2, OFF2, GO2, {(0, 0): (GO2[0][:4], 1), (1, 0): (GO2[1][4:], 1)}),
        ],
        start=1,
    ):
        _train(tbe, idx, off, go)
        for t, rows in enumerate((T0, T1)):
            for k in range(len(rows)):
                g, cnt = batch.get((t, k), ([0.0] * len(rows[k]), 1))
                hand.update(t, k, g, cnt, t=step)
        hand.check(tbe)
    assert tbe.row_step.tolist() == [2] * 8


def test_update_scope_all_needs_two_l2_below_r_and_inline_mode():
    tbe = _two_tables(hyper=_hyper(update_scope="all", l2=0.3, cowclip_r=0.5))
    with pytest.raises(ValueError, match=r"^CowClip update_scope='all' assumes 2\*l2 < cowclip_r \(l2=0.3, r=0.5\)$"):
        _train(tbe, IDX1, OFF1, GO1)
    deferred = _two_tables("deferred", hyper=_hyper(update_scope="all"), tables_op=None)
    with pytest.raises(NotImplementedError, match=r"^CowClip update_scope='all' needs table-wise or row-wise sharding$"):
        _train(deferred, IDX1, OFF1, GO1)


def test_deferred_backward_stages_rows_and_leaves_the_tables():
    tbe = _two_tables("deferred", tables_op=None)
    tbe.table_names = ["t_a", "t_b"]
    before = tbe.weights.clone()
    _train(tbe, IDX1, OFF1, GO1)
    assert torch.equal(tbe.weights, before) and tbe.row_step.sum() == 0
    a, b = GO1
    staged = tbe.staged
    assert [(s.table, s.rows.tolist(), s.counts.tolist()) for s in staged] == [(0, [0, 1], [1, 2]), (1, [2], [2])]
    torch.testing.assert_close(staged[0].grads, torch.tensor([_add(a[:4], a[:4]), _add(a[:4], b[:4])]))  # no L2 term yet
    torch.testing.assert_close(staged[1].grads, torch.tensor([_add(a[4:], b[4:])]))
    msg = (
        r"^CowClip-Adam tables \['t_a', 't_b'\]: the previous backward staged rows whose column-wise/data-parallel "
        r"update never ran \(no exchange after backward\); refusing to read stale weights$"
    )
    with pytest.raises(RuntimeError, match=msg):
        tbe(IDX2, OFF2)
    assert tbe.take_staged() is staged and tbe.staged == []
    tbe(IDX2, OFF2)  # nothing pending: the lookup runs


def test_apply_rows_clips_with_the_full_rows_norms():
    """A column shard holds columns 0..1 of a width-4 table: the clip reads the full row's norms
    (``wsq``/``gsq``) and zeta' of the full width; ``add_l2=False`` because g already holds L2."""
    tbe = CowClipAdamTBE([(3, 2)], [0], _hyper(), full_dims=[4], mode="deferred", tables_op=None)
    w0 = [[0.3, 0.4], [0.0, 0.0], [1.0, -1.0]]
    with torch.no_grad():
        tbe.weights.copy_(torch.tensor(w0).flatten())
    rows, g = torch.tensor([0, 1]), [[0.2, -0.1], [0.5, 0.5]]
    wsq, gsq = [0.25 + 1.0, 0.0], [0.05 + 3.0, 0.5]  # the other shard's columns add 1.0 and 3.0, 0 and 0
    tbe.apply_rows(0, rows, torch.tensor(g), torch.tensor([2, 1]), wsq=torch.tensor(wsq), gsq=torch.tensor(gsq), add_l2=False)
    clipped = 0
    for k in (0, 1):
        w, m, v, c = hand_step(
            w0[k], [0.0, 0.0], [0.0, 0.0], 1, g[k], [2, 1][k], full_dim=4, add_l2=False, norms=(math.sqrt(wsq[k]), math.sqrt(gsq[k])), **HP
        )
        clipped += c
        torch.testing.assert_close(tbe.split_embedding_weights()[0][k], torch.tensor(w), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tbe.momentum1.view(3, 2)[k], torch.tensor(m), rtol=1e-5, atol=1e-7)
    # row 0: c = 0.5 * 2 * sqrt(1.25) = 1.118 < ||g|| = 1.747; row 1 (w = 0): c = 0.5 * 0.5 * 2 * 1e-5 = 5e-6 < 0.707
    assert clipped == 2
    assert tbe.row_step.tolist() == [1, 1, 0] and tbe.split_embedding_weights()[0][2].tolist() == w0[2]
    assert tbe.stats.take() == (2, 2)


def test_pooled_sum_with_weights_and_mean_lookups():
    tbe = _two_tables()
    psw = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, -1.0])
    out = tbe(IDX1, OFF1, psw)
    r0 = [T0[0][d] + 2 * T0[1][d] + 0.5 * T0[0][d] for d in range(4)] + [3 * x for x in T1[2]]
    r1 = list(T0[1]) + [-x for x in T1[2]]
    torch.testing.assert_close(out.detach(), torch.tensor([r0, r1]))
    mean = CowClipAdamTBE([(5, 4), (3, 2)], [0, 1], _hyper(), full_dims=[4, 2], mode="inline", pooling_mode=PoolingMode.MEAN)
    with torch.no_grad():
        mean.weights.copy_(tbe.weights)
        out = mean(IDX1, OFF1)
    r0 = [(2 * T0[0][d] + T0[1][d]) / 3 for d in range(4)] + list(T1[2])
    torch.testing.assert_close(out, torch.tensor([r0, list(T0[1]) + list(T1[2])]))


def test_unpooled_lookup_returns_the_rows_and_updates_each_occurrence():
    tbe = CowClipAdamTBE([(5, 2), (3, 2)], [0, 1], _hyper(), full_dims=[2, 2], mode="inline", pooling_mode=PoolingMode.NONE)
    with torch.no_grad():
        tbe.weights.copy_(torch.arange(16, dtype=torch.float32) / 10)
    idx, off = torch.tensor([1, 1, 2]), torch.tensor([0, 2, 3])  # batch 1: feature 0 ids (1, 1), feature 1 id (2)
    out = tbe(idx, off)
    torch.testing.assert_close(out.detach(), torch.tensor([[0.2, 0.3], [0.2, 0.3], [1.4, 1.5]]))
    go = [[0.1, 0.0], [0.3, -0.2], [0.0, 1.0]]
    out.backward(torch.tensor(go))
    # id 1 of table 0 twice: two bags of one, so cnt 2 and g the sum of its two rows
    w, *_ = hand_step([0.2, 0.3], [0.0, 0.0], [0.0, 0.0], 1, [0.4, -0.2], 2, full_dim=2, **HP)
    torch.testing.assert_close(tbe.split_embedding_weights()[0][1], torch.tensor(w), rtol=1e-5, atol=1e-6)
    w, *_ = hand_step([1.4, 1.5], [0.0, 0.0], [0.0, 0.0], 1, [0.0, 1.0], 1, full_dim=2, **HP)
    torch.testing.assert_close(tbe.split_embedding_weights()[1][2], torch.tensor(w), rtol=1e-5, atol=1e-6)
    assert tbe.row_step.tolist() == [0, 1, 0, 0, 0, 0, 0, 1]
    with pytest.raises(NotImplementedError, match=r"^CowClip-Adam kernel: unpooled lookups take no per-sample weights$"):
        tbe.lookup(idx, off, torch.ones(3))


def test_host_memory_location_gives_the_same_numbers_on_cpu():
    dev, managed = _two_tables(), _two_tables(location="managed")
    for tbe in (dev, managed):
        _train(tbe, IDX1, OFF1, GO1)
    assert torch.equal(dev.weights, managed.weights) and torch.equal(dev.momentum2, managed.momentum2)
    assert managed.location == "managed"


def test_the_anchor_gets_an_empty_gradient_so_its_node_waits_for_the_kernel():
    tbe = _two_tables("deferred", tables_op=None)
    anchor = torch.ones(3, requires_grad=True)
    tbe.autograd_anchor = anchor
    _train(tbe, IDX1, OFF1, GO1)
    assert torch.equal(anchor.grad, torch.zeros(3))


def test_global_rows_follow_each_features_table():
    tbe = CowClipAdamTBE([(5, 4), (3, 2)], [1, 0], _hyper(), full_dims=[4, 2], mode="inline")
    # feature 0 reads table 1 (rows 5..7), feature 1 table 0 (rows 0..4); batch 2
    rows = tbe.global_rows(torch.tensor([0, 2, 1, 4, 3]), torch.tensor([0, 1, 2, 4, 5]))
    assert rows.tolist() == [5, 7, 1, 4, 3]


def test_learning_rate_and_hyperparameters_can_change():
    tbe = _two_tables()
    assert tbe.get_learning_rate() == 0.1
    tbe.set_learning_rate(0.25)
    assert tbe.get_learning_rate() == 0.25
    tbe.update_hyper_parameters({"lr": 0.5, "l2": 0.01, "momentum": 0.9})  # not ours: ignored
    assert (tbe.lr, tbe.hyper.learning_rate, tbe.hyper.l2, tbe.hyper.cowclip_r) == (0.5, 0.5, 0.01, 0.5)


def test_optimizer_state_and_weights_are_views_of_the_flat_buffers():
    tbe = _two_tables()
    st = tbe.get_optimizer_state()
    assert [list(s) for s in st] == [["exp_avg", "exp_avg_sq", "row_step"]] * 2
    st[1]["exp_avg"][2, 1] = 7.0
    st[1]["row_step"][1] = 3
    tbe.split_embedding_weights()[0][4, 0] = -5.0
    assert tbe.momentum1[20 + 2 * 2 + 1] == 7.0 and tbe.row_step[5 + 1] == 3 and tbe.weights[4 * 4] == -5.0


def test_optimizer_step_sets_the_global_step_only_for_catchup():
    lazy = _two_tables()
    lazy.set_optimizer_step(9)
    assert lazy._dense_step is None
    catchup = _two_tables(hyper=_hyper(update_scope="catchup"))
    catchup.set_optimizer_step(9)
    assert catchup.dense_step() == 9


def test_zeta_of_a_column_shard_is_scaled_to_the_full_width():
    tbe = CowClipAdamTBE([(3, 2), (3, 4)], [0, 1], _hyper(cowclip_zeta=1e-3), full_dims=[8, 4], mode="deferred")
    # r * sqrt(2) * zeta_t = r * sqrt(8) * zeta: zeta_t = 2 * zeta for the 2-of-8 shard
    assert tbe._zeta_for_full_dim(0) == pytest.approx(2e-3, rel=1e-12)
    assert tbe._zeta_for_full_dim(1) == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(location="uvm"), ValueError, r"^CowClip-Adam kernel: location must be device\|managed\|host_mapped, got 'uvm'$"),
        (dict(mode="lazy"), ValueError, r"^mode must be inline\|deferred, got 'lazy'$"),
        (dict(catchup_op="cuda"), ValueError, r"^catchup_op must be auto\|fused\|triton\|torch, got 'cuda'$"),
        (dict(feature_table_map=[0, 0]), NotImplementedError, r"^CowClip-Adam kernel: a table read by several features is not supported$"),
        (
            dict(pooling_mode=PoolingMode.NONE),
            NotImplementedError,
            r"^CowClip-Adam kernel: unpooled tables of one kernel share one dim \(FBGEMM's unpooled output is \[ids, D\]\), got \[4, 2\]$",
        ),
        (
            dict(hyper=_hyper(update_scope="catchup", l2=0.5, cowclip_r=1.0)),
            ValueError,
            r"^CowClip catch-up assumes 2\*l2 < cowclip_r \(l2=0.5, r=1.0\): absent rows would be clipped$",
        ),
    ],
)
def test_constructor_rejects(kwargs, error, match):
    args = dict(embedding_specs=[(5, 4), (3, 2)], feature_table_map=[0, 1], hyper=_hyper(), full_dims=[4, 2], mode="inline")
    with pytest.raises(error, match=match):
        CowClipAdamTBE(**{**args, **kwargs})


def test_variable_batch_per_feature_is_refused():
    with pytest.raises(NotImplementedError, match=r"^CowClip-Adam kernel: variable batch size per feature \(VBE\) is not supported$"):
        _two_tables()(IDX1, OFF1, batch_size_per_feature_per_rank=[[1], [1]])
