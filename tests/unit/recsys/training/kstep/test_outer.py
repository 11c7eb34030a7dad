"""The outer step of a k-step merge (recsys/training/kstep/outer.py): DiLoCo's Nesterov step on a
flat buffer against a hand loop in float64, plain averaging as its η=1, μ=0 case, lazy rows, bf16
error feedback without drift, the state's round trip; and through the merger (the other replica's
values written into the collective by hand, as tests/unit/recsys/training/kstep/test_merger.py
does) the bytes a compressed merge sends. Two real replicas run in
tests/integration/training/test_kstep_outer.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import recsys.training.kstep.merger as merger_mod
from recsys.training.kstep.merger import KStepMerger
from recsys.training.kstep.outer import OuterOptimizer, Part


def _with_other(other: torch.Tensor):
    """The collectives of a replica group of two whose other replica holds ``other``."""

    def average(buf: torch.Tensor) -> None:
        buf.copy_((buf + other) / 2)

    def total(buf: torch.Tensor) -> None:
        buf.copy_((buf.float() + other.float()).to(buf.dtype))

    return average, total


def test_nesterov_on_a_flat_buffer_follows_a_hand_loop_over_three_merges():
    g = torch.Generator().manual_seed(0)
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer("nesterov", lr, mu, "none", hosts=2)
    model = torch.randn(5, generator=g)
    anchor, m = None, [0.0] * 5  # the hand loop, in float64
    for merge in range(3):
        mine = model + 0.1 * torch.randn(5, generator=g)
        other = model + 0.1 * torch.randn(5, generator=g)
        want = []
        for i in range(5):
            mean = (float(mine[i]) + float(other[i])) / 2
            if anchor is None:  # the first merge: plain average, which becomes the anchor
                want.append(mean)
                continue
            delta = anchor[i] - mean
            m[i] = mu * m[i] + delta
            want.append(anchor[i] - lr * (delta + mu * m[i]))
        local = mine.clone()
        sent = outer.merge(local, [Part("w", local)], *_with_other(other))
        assert sent == 5 * 4
        assert local.tolist() == pytest.approx(want, abs=1e-6), merge
        anchor, model = want, local.clone()
    assert outer.slots["w"].anchor.tolist() == pytest.approx(anchor, abs=1e-6)
    assert outer.slots["w"].momentum.tolist() == pytest.approx(m, abs=1e-6)
    assert any(abs(x) > 1e-3 for x in m)


def test_lr_one_momentum_zero_is_plain_averaging():
    g = torch.Generator().manual_seed(1)
    outer = OuterOptimizer("nesterov", 1.0, 0.0, "none", hosts=2)
    model = torch.randn(64, generator=g)
    for _ in range(4):
        mine, other = model + torch.randn(64, generator=g), model + torch.randn(64, generator=g)
        local = mine.clone()
        outer.merge(local, [Part("w", local)], *_with_other(other))
        assert torch.allclose(local, (mine + other) / 2, rtol=0, atol=1e-6)
        model = local.clone()


def test_rows_take_the_step_lazily():
    """Only the merged rows move and take momentum; the others keep value and momentum."""
    lr, mu = 0.5, 0.8
    outer = OuterOptimizer("nesterov", lr, mu, "none", hosts=2)
    table = torch.arange(12.0).view(6, 2)
    outer.merge(table.reshape(-1).clone(), [Part("e", table)], *_with_other(table.reshape(-1)))  # the anchor
    anchor = table.clone()
    momentum = torch.zeros(6, 2)
    for rows in ([1, 4], [0, 1]):
        idx = torch.tensor(rows)
        mine, other = table.clone(), table.clone()
        mine[idx] += 1.0  # this replica moved the rows by +1, the other by -3: the mean by -1
        other[idx] -= 3.0
        before = mine.clone()
        local = mine.index_select(0, idx).reshape(-1)
        outer.merge(local, [Part("e", mine, idx)], *_with_other(other.index_select(0, idx).reshape(-1)))
        mine.index_copy_(0, idx, local.view(-1, 2))
        for r in range(6):
            if r in rows:  # Δ = anchor - mean = +1
                momentum[r] = mu * momentum[r] + 1.0
                want = anchor[r] - lr * (1.0 + mu * momentum[r])
                assert torch.allclose(mine[r], want, atol=1e-6), (rows, r)
                anchor[r] = want
            else:
                assert torch.equal(mine[r], before[r]), (rows, r)
        assert torch.allclose(outer.slots["e"].momentum, momentum, atol=1e-6)
        assert torch.allclose(outer.slots["e"].anchor, anchor, atol=1e-6)
        table = mine
    assert outer.slots["e"].momentum[4].tolist() == pytest.approx([1.0, 1.0])  # kept while row 4 was not merged
    assert outer.slots["e"].momentum[2].tolist() == [0.0, 0.0]  # never merged


def _merge_rows(outer: OuterOptimizer, table: torch.Tensor, idx, before, collectives) -> None:
    """A merge of ``table``'s rows ``idx`` (None: whole) written back, as the merger does."""
    local = (table if idx is None else table.index_select(0, idx)).reshape(-1).clone()
    outer.merge(local, [Part("e", table, idx, before)], *collectives)
    if idx is None:
        table.copy_(local.view_as(table))
    else:
        table.index_copy_(0, idx, local.view(idx.numel(), -1))


def test_a_lazy_anchor_merges_as_a_dense_one_and_keeps_state_only_for_merged_rows():
    """A shard merged by rows with no copy of itself (the rows this replica changed handed in
    with their values from before, as TouchedRows keeps them) merges bit for bit as with a dense
    anchor: Nesterov steps on bf16 deltas over 8 merges, rows the other replica alone changed
    among them; momentum and residual are kept only for the rows merged so far, and its saved
    state loads into a lazy and into a dense slot alike, and a whole merge after it (a union too
    large for rows) is the same from either."""
    g = torch.Generator().manual_seed(3)
    n, d = 40, 4
    dense, lazy = (OuterOptimizer("nesterov", 0.7, 0.9, "bf16", hosts=2) for _ in range(2))
    start = torch.randn(n, d, generator=g)
    tables = {"dense": start.clone(), "lazy": start.clone()}
    merged: set[int] = set()
    for merge in range(8):
        mine = torch.randperm(n, generator=g)[:6].sort().values
        union = torch.unique(torch.cat([mine, torch.randperm(n, generator=g)[:6]]))
        step = 0.01 * torch.randn(mine.numel(), d, generator=g)
        if merge == 0:  # the first merge: whole, a plain average with the other replica's values
            collectives, idx = _with_other((start + 0.01).reshape(-1)), None
        else:  # then the other replica's bf16 deltas of the union's rows
            collectives, idx = _with_other((0.01 * torch.randn(union.numel() * d, generator=g)).to(torch.bfloat16)), union
            merged.update(union.tolist())
        for name, outer in (("dense", dense), ("lazy", lazy)):
            t = tables[name]
            before = (mine, t[mine].clone()) if name == "lazy" else None
            t[mine] += step
            _merge_rows(outer, t, idx, before, collectives)
        assert torch.equal(tables["dense"], tables["lazy"]), merge
    slot = lazy.slots["e"]
    assert slot.anchor is None and slot.momentum is None and slot.residual is None
    assert slot.rows.count == len(merged) < n
    every = torch.arange(n)
    for name in ("momentum", "residual"):
        assert torch.equal(slot.rows.get(name, every), getattr(dense.slots["e"], name)), name
        assert getattr(dense.slots["e"], name).abs().sum() > 0
    state = lazy.state_dict()
    assert set(state["residual"]["e"]) == {"rows", "values"} and state["residual"]["e"]["rows"].numel() == len(merged)
    resumed = {}
    for name, lazy_slot in (("lazy", True), ("dense", False)):
        outer = OuterOptimizer("nesterov", 0.7, 0.9, "bf16", hosts=2)
        outer.set_anchor("e", tables["lazy"], lazy=lazy_slot)
        outer.load_state_dict(state)
        t = tables["lazy"].clone()
        rows = torch.tensor([1, 5, 9])
        before = (rows, t[rows].clone()) if lazy_slot else None
        t[rows] += 0.5
        _merge_rows(outer, t, torch.arange(12), before, _with_other(torch.ones(12 * d).to(torch.bfloat16)))
        before = (rows, t[rows].clone()) if lazy_slot else None
        t[rows] -= 0.25
        # then a whole merge (a union too large for rows), bf16 deltas of every row
        _merge_rows(outer, t, None, before, _with_other(torch.full((n * d,), 0.5).to(torch.bfloat16)))
        resumed[name] = t
    assert torch.equal(resumed["lazy"], resumed["dense"])
    with pytest.raises(RuntimeError, match=r"rows of e this replica changed since the last merge are not among the rows merged"):
        _merge_rows(lazy, tables["lazy"], torch.tensor([0, 1]), (torch.tensor([1, 2]), torch.zeros(2, d)), collectives)


def test_bf16_error_feedback_sends_the_true_deltas_without_drift():
    """One replica (hosts=1: the mean is what it sent) over 300 merges of small deltas on values
    near 1: the sum of what it sent stays within one bf16 rounding of the sum of its true deltas,
    while rounding every delta alone drifts."""
    g = torch.Generator().manual_seed(2)
    outer = OuterOptimizer("average", 0.7, 0.9, "bf16", hosts=1)
    model = 1.0 + torch.rand(256, generator=g)
    local = model.clone()
    outer.merge(local, [Part("w", local)], lambda b: None, lambda b: None)  # the anchor
    sent_sum = torch.zeros(256, dtype=torch.float64)
    true_sum = torch.zeros(256, dtype=torch.float64)
    plain_sum = torch.zeros(256, dtype=torch.float64)
    sent: list[torch.Tensor] = []
    for _ in range(300):
        delta = 1e-3 * torch.randn(256, generator=g)
        local = outer.slots["w"].anchor + delta
        true_sum += (local - outer.slots["w"].anchor).double()
        plain_sum += (local - outer.slots["w"].anchor).to(torch.bfloat16).double()
        nbytes = outer.merge(local, [Part("w", local)], lambda b: None, lambda b: sent.append(b.clone()))
        assert nbytes == 256 * 2 and sent[-1].dtype == torch.bfloat16
        sent_sum += sent[-1].double()
    last = (true_sum - sent_sum + sent[-1].double()).abs()  # |d| of the last merge
    one_rounding = last * 2.0**-8 + 1e-12
    assert torch.all((sent_sum - true_sum).abs() <= one_rounding)
    assert torch.allclose(outer.slots["w"].residual.double(), true_sum - sent_sum, atol=1e-9)
    assert (plain_sum - true_sum).abs().max() > 10 * (sent_sum - true_sum).abs().max()


def test_bf16_mean_is_the_anchor_plus_the_mean_of_both_bf16_deltas():
    outer = OuterOptimizer("average", 0.7, 0.9, "bf16", hosts=2)
    anchor = torch.tensor([1.0, 2.0, -3.0])
    local = anchor.clone()
    outer.merge(local, [Part("w", local)], lambda b: None, lambda b: None)
    mine, other_delta = anchor + torch.tensor([1e-3, 3e-3, -7e-3]), torch.tensor([2e-3, -5e-3, 1e-2])
    local = mine.clone()
    outer.merge(local, [Part("w", local)], *_with_other(other_delta.to(torch.bfloat16)))
    q = (mine - anchor).to(torch.bfloat16).float()
    want = anchor + (q + other_delta.to(torch.bfloat16).float()).to(torch.bfloat16).float() / 2
    assert torch.equal(local, want)
    assert torch.equal(outer.slots["w"].residual, (mine - anchor) - q)


def test_the_state_round_trips_and_a_misfit_restarts_from_zero_with_one_warning(caplog):
    a = OuterOptimizer("nesterov", 0.7, 0.9, "bf16", hosts=2)
    w = torch.ones(4)
    for step in range(3):
        local = w + step
        a.merge(local, [Part("w", local)], *_with_other(torch.zeros(4)))
    state = a.state_dict()
    assert set(state) == {"momentum", "residual"} and set(state["momentum"]) == {"w"}
    b = OuterOptimizer("nesterov", 0.7, 0.9, "bf16", hosts=2)
    b.set_anchor("w", a.slots["w"].anchor)
    b.load_state_dict(state)
    assert torch.equal(b.slots["w"].momentum, a.slots["w"].momentum) and torch.equal(b.slots["w"].residual, a.slots["w"].residual)
    c = OuterOptimizer("nesterov", 0.7, 0.9, "bf16", hosts=2)
    c.set_anchor("w", torch.ones(5))  # another plan: the shapes differ
    with caplog.at_level(logging.WARNING, logger="recsys.training.kstep.outer"):
        c.load_state_dict(state)
    assert [r.getMessage() for r in caplog.records] == [
        "k-step merge: the checkpoint's outer state does not fit this plan (2 of 2 tensors, e.g. momentum w): "
        "outer momentum and bf16 residuals restart from zero"
    ]
    assert c.slots["w"].momentum is None and c.slots["w"].residual is None


def test_the_arguments_are_checked():
    with pytest.raises(ValueError, match=r"^outer must be average or nesterov, got 'adam'$"):
        OuterOptimizer("adam", 0.7, 0.9, "none", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^compress must be none or bf16, got 'fp8'$"):
        OuterOptimizer("average", 0.7, 0.9, "fp8", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^outer_lr must be positive, got 0.0$"):
        KStepMerger(nn.Linear(1, 1), None, None, every_k=1, outer="nesterov", outer_lr=0.0)
    with pytest.raises(ValueError, match=r"^outer_momentum must be in \[0, 1\), got 1.0$"):
        KStepMerger(nn.Linear(1, 1), None, None, every_k=1, outer_momentum=1.0)


class _OtherReplica:
    """The collective of a replica group of two, the other replica a second merger of its own
    (its buffers recorded by running it first against this one's)."""

    def __init__(self) -> None:
        self.received: list[torch.Tensor] = []
        self.answers: list[torch.Tensor] = []

    def all_reduce(self, buf: torch.Tensor, op=None, group=None) -> None:
        self.received.append(buf.clone())
        other = self.answers[len(self.received) - 1] if self.answers else torch.zeros_like(buf)
        if op == dist.ReduceOp.AVG:
            buf.copy_((buf + other) / 2)
        else:
            buf.copy_((buf.float() + other.float()).to(buf.dtype))


def test_a_compressed_merge_sends_bf16_parameters_and_fp32_moments(gloo_world_of_one, monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)  # 8 parameters
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    merger = KStepMerger(model, opt, dist.group.WORLD, every_k=1, merge_moments=True, outer="nesterov", compress="bf16")
    merger.hosts = merger.outer.hosts = 2
    fake = _OtherReplica()
    monkeypatch.setattr(merger_mod, "dist", SimpleNamespace(all_reduce=fake.all_reduce, ReduceOp=dist.ReduceOp))
    sizes = []
    for step in (1, 2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        fake.received.clear()
        merger.step(step)
        sizes.append([(b.dtype, b.numel()) for b in fake.received])
    # the moments first, then the parameters: at the first merge (no anchor yet) in fp32, then as bf16 deltas
    assert sizes[0] == [(torch.float32, 16), (torch.float32, 8)]
    assert sizes[1] == [(torch.float32, 16), (torch.bfloat16, 8)]
    assert merger.payload_bytes_per_merge == 8 * 2 + 16 * 4
    assert merger.cross_host_bytes_total == (8 * 4 + 16 * 4) + (8 * 2 + 16 * 4)


def test_with_an_outer_step_a_tracked_shard_goes_by_rows_however_many_moved():
    """Plain averaging sends a shard whose union holds most rows whole (cheaper to pack); the
    outer step is lazy, so it keeps the rows: a whole-shard merge would move the untouched rows
    by their momentum. Tables whose absent rows move go whole unless the moments are merged."""
    from recsys.training.kstep.touched_rows import WHOLE_SHARD_FRACTION, rows_to_merge

    most, few, moving = torch.zeros(10), torch.zeros(8), torch.zeros(4)
    bitmaps = {most.data_ptr(): torch.arange(10) < 9, few.data_ptr(): torch.arange(8) < 2, moving.data_ptr(): torch.arange(4) < 1}
    touched = SimpleNamespace(bitmap_of=lambda w: bitmaps[w.data_ptr()], moves_when_absent={moving.data_ptr()})
    owners = [most, few, moving, few]  # a shard listed twice counts once
    plain = rows_to_merge(touched, owners, None, merge_moments=False, whole_fraction=WHOLE_SHARD_FRACTION)
    assert {k: v.tolist() for k, v in plain.rows.items()} == {few.data_ptr(): [0, 1]}
    assert (plain.merged, plain.tracked, plain.exchange_bytes) == (10 + 2, 18, 0)
    lazy = rows_to_merge(touched, owners, None, merge_moments=True, whole_fraction=None)
    assert {k: v.tolist() for k, v in lazy.rows.items()} == {
        most.data_ptr(): list(range(9)),
        few.data_ptr(): [0, 1],
        moving.data_ptr(): [0],
    }
    assert (lazy.merged, lazy.tracked) == (9 + 2 + 1, 22)


def test_the_drop_in_hook_passes_the_outer_options_to_its_merger(gloo_world_of_one, monkeypatch):
    import recsys.training.kstep.host_groups as host_groups
    from recsys.training.kstep.merge_hook import KStepMergeHook

    groups = SimpleNamespace(hosts=2, host_pg=dist.group.WORLD, replica_pg=dist.group.WORLD)
    monkeypatch.setattr(host_groups, "build_host_groups", lambda hosts, timeout: groups)
    hook = KStepMergeHook(4, hosts=2, outer="nesterov", outer_lr=0.5, outer_momentum=0.8, compress="bf16")
    model = nn.Linear(2, 1)
    hook.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    o = hook.merger.outer
    assert (o.kind, o.lr, o.momentum, o.compress) == ("nesterov", 0.5, 0.8, "bf16")
    with pytest.raises(ValueError, match=r"^outer_momentum must be in \[0, 1\), got -0.1$"):
        KStepMergeHook(4, hosts=2, outer="nesterov", outer_momentum=-0.1)
