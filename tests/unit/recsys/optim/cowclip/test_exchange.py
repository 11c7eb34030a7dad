"""The cross-rank CowClip step (recsys/optim/cowclip/exchange.py) over a gloo world of one: a table
cut into column shards and put back together updates exactly as the whole table does (the clip
reads the full rows' norms), a data-parallel replica applies the batch's update, and what the
exchange refuses. The whole-table update is the torch-ops reference (reference.py), which
test_reference.py checks by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from recsys.optim.cowclip.exchange import ExchangeTable, column_wise_step, data_parallel_step
from recsys.optim.cowclip.hyper import CowClipHyper
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from recsys.optim.cowclip.tbe import CowClipAdamTBE

LR, R, ZETA, L2 = 0.1, 0.5, 1e-5, 0.05
HYPER = CowClipHyper(learning_rate=LR, cowclip_r=R, cowclip_zeta=ZETA, l2=L2, update_scope="batch")
FULL = torch.tensor(
    [[3.0, 4.0, 0.0, 0.0], [0.3, 0.0, -0.4, 0.0], [0.5, 0.5, 0.5, 0.5], [1e-9, 0.0, 0.0, 0.0], [-1.0, 1.0, -1.0, 1.0]],
)
# batch 2, one feature: bags (0, 1, 0), (1, 4); then (2), (0)
STEPS = [
    (torch.tensor([0, 1, 0, 1, 4]), torch.tensor([0, 3, 5]), torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.2, 0.4, -0.6, 0.8]])),
    (torch.tensor([2, 0]), torch.tensor([0, 1, 2]), torch.tensor([[0.0, 0.3, -0.3, 0.1], [-0.5, 0.0, 0.25, 1.0]])),
]


def _column_shards() -> tuple[CowClipAdamTBE, CowClipAdamTBE]:
    """Columns 0..1 and 2..3 of the width-4 table ``t``, as two deferred kernels."""
    shards = []
    for lo in (0, 2):
        tbe = CowClipAdamTBE([(5, 2)], [0], HYPER, full_dims=[4], mode="deferred", tables_op=None)
        with torch.no_grad():
            tbe.weights.copy_(FULL[:, lo : lo + 2].flatten())
        shards.append(tbe)
    return shards[0], shards[1]


def _whole_table_reference(steps: int) -> tuple[torch.Tensor, CowClipAdamState, int]:
    w = FULL.double().clone()
    st = CowClipAdamState.zeros_like(w)
    clipped = 0
    for idx, off, go in STEPS[:steps]:
        stats = cowclip_adam_step(w, st, idx, off, go.double(), lr=LR, r=R, zeta=ZETA, l2=L2)
        clipped += int(stats.clipped_rows)
    return w, st, clipped


@pytest.mark.parametrize("with_group", [True, False], ids=["gloo-world-of-one", "no-group"])
def test_column_shards_put_together_update_as_the_whole_table(with_group, request):
    if with_group:
        request.getfixturevalue("gloo_world_of_one")
    pg = dist.group.WORLD if with_group else None
    a, b = _column_shards()
    plan = [ExchangeTable("other", 7, 3), ExchangeTable("t", 5, 4)]  # a table this rank holds no shard of
    for idx, off, go in STEPS:
        before = a.weights.clone()
        for tbe, lo in ((a, 0), (b, 2)):
            tbe(idx, off).backward(go[:, lo : lo + 2])
        assert torch.equal(a.weights, before) and len(a.staged) == 1  # staged, not applied
        column_wise_step(plan, [(a, ["t"]), (b, ["t"])], pg)
        assert a.staged == [] and b.staged == []
    w, st, clipped = _whole_table_reference(len(STEPS))
    joined = torch.cat([a.weights.view(5, 2), b.weights.view(5, 2)], 1)
    torch.testing.assert_close(joined.double(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([a.momentum1.view(5, 2), b.momentum1.view(5, 2)], 1).double(), st.exp_avg, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([a.momentum2.view(5, 2), b.momentum2.view(5, 2)], 1).double(), st.exp_avg_sq, rtol=1e-5, atol=1e-9)
    assert a.row_step.tolist() == b.row_step.tolist() == st.row_step.tolist() == [2, 1, 1, 0, 1]
    assert clipped > 0
    assert a.stats.take() == b.stats.take() == (3 + 2, clipped)  # each shard clips the same rows


def test_column_wise_step_without_staged_rows_changes_nothing():
    a, b = _column_shards()
    before = a.weights.clone()
    column_wise_step([ExchangeTable("t", 5, 4)], [(a, ["t"]), (b, ["t"])], None)
    assert torch.equal(a.weights, before) and a.row_step.sum() == 0


def test_column_wise_step_refuses_tables_outside_the_plan_and_differing_ids():
    a, b = _column_shards()
    idx, off, go = STEPS[0]
    a(idx, off).backward(go[:, :2])
    with pytest.raises(RuntimeError, match=r"^CowClip column-wise exchange: tables \['t'\] are not in the plan's list$"):
        column_wise_step([ExchangeTable("u", 5, 4)], [(a, ["t"])], None)
    a, b = _column_shards()
    a(idx, off).backward(go[:, :2])
    idx2, off2, go2 = STEPS[1]
    b(idx2, off2).backward(go2[:, 2:])
    with pytest.raises(RuntimeError, match=r"^CowClip column-wise exchange: shards of table t saw different ids$"):
        column_wise_step([ExchangeTable("t", 5, 4)], [(a, ["t"]), (b, ["t"])], None)


def test_data_parallel_replica_applies_the_batch_update_with_l2(gloo_world_of_one):
    """Two DP tables in one kernel (features 0 and 1, batch 2) and a third, held elsewhere, that
    no sample reads: each table's rows update as the reference updates that table alone."""
    tbe = CowClipAdamTBE([(5, 4), (3, 2)], [0, 1], HYPER, full_dims=[4, 2], mode="deferred", tables_op=None)
    small = torch.tensor([[0.6, -0.8], [0.0, 2.0], [-0.1, 0.1]])
    with torch.no_grad():
        tbe.weights.copy_(torch.cat([FULL.flatten(), small.flatten()]))
    plan = [ExchangeTable("a", 5, 4), ExchangeTable("b", 3, 2), ExchangeTable("c", 4, 3)]
    ref = [(FULL.double().clone(), None), (small.double().clone(), None)]
    ref = [(w, CowClipAdamState.zeros_like(w)) for w, _ in ref]
    b_steps = [
        (torch.tensor([2, 2, 0]), torch.tensor([0, 2, 3]), torch.tensor([[0.3, -0.1], [-2.0, 1.0]])),
        (torch.tensor([1]), torch.tensor([0, 0, 1]), torch.tensor([[0.0, 0.0], [0.4, 0.4]])),
    ]
    for (idx_a, off_a, go_a), (idx_b, off_b, go_b) in zip(STEPS, b_steps):
        idx = torch.cat([idx_a, idx_b])
        off = torch.cat([off_a, off_b[1:] + off_a[-1]])
        tbe(idx, off).backward(torch.cat([go_a, go_b], 1))
        data_parallel_step(plan, [(tbe, ["a", "b"])], dist.group.WORLD)
        for (w, st), (i, o, g) in zip(ref, ((idx_a, off_a, go_a), (idx_b, off_b, go_b))):
            cowclip_adam_step(w, st, i, o, g.double(), lr=LR, r=R, zeta=ZETA, l2=L2)
    for t, (w, st) in enumerate(ref):
        torch.testing.assert_close(tbe.split_embedding_weights()[t].double(), w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tbe.get_optimizer_state()[t]["exp_avg"].double(), st.exp_avg, rtol=1e-5, atol=1e-7)
        assert tbe.get_optimizer_state()[t]["row_step"].tolist() == st.row_step.tolist()
    assert tbe.row_step.tolist() == [2, 1, 1, 0, 1, 1, 1, 1]


def test_data_parallel_table_twice_on_one_rank_is_refused():
    a, b = _column_shards()
    idx, off, go = STEPS[0]
    a(idx, off).backward(go[:, :2])
    b(idx, off).backward(go[:, 2:])
    with pytest.raises(RuntimeError, match=r"^CowClip data-parallel table t appears twice in one rank's kernels$"):
        data_parallel_step([ExchangeTable("t", 5, 2)], [(a, ["t"]), (b, ["t"])], None)
