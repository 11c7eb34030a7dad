"""The k-step merger's engine: when it merges, what it averages, and how. A replica group of one
leaves the model as it is; the average of two replicas is checked through the packed buffers (the
other replica's values written into the collective by hand, in the order the test spells out)
against a hand-computed mean of every parameter and moment. The touched-row and hierarchical
routes over real ranks run in tests/integration/training/test_kstep_merge.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

import recsys.training.kstep.merger as merger_mod
from recsys.training.kstep.merger import KStepMerger, _buckets, _host_replicated


def _trained(seed: int) -> tuple[nn.Module, KeyedOptimizerWrapper]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    opt = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def _in_order(model: nn.Module, opt: KeyedOptimizerWrapper, moments: bool) -> list[torch.Tensor]:
    """What a merge averages, in its order: the parameters as the optimizer lists them, then each
    one's floating state (Adam's moments; the step counter is not averaged)."""
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    params = dict(model.named_parameters())
    out = [params[n] for n in names]
    if moments:
        out += [opt.state[params[n]][k] for n in names for k in ("exp_avg", "exp_avg_sq")]
    return out


class _OtherReplica:
    """The collective of a replica group of two: the other replica's buffer is the next slice of
    its tensors concatenated in the given order."""

    ReduceOp = dist.ReduceOp

    def __init__(self, other: list[torch.Tensor], avg: bool) -> None:
        self.flat = torch.cat([t.detach().reshape(-1) for t in other])
        self.offset = 0
        self.avg = avg
        self.received: list[torch.Tensor] = []

    def all_reduce(self, buf: torch.Tensor, op=None, group=None) -> None:
        if op == dist.ReduceOp.AVG and not self.avg:
            raise ValueError("Cannot use ReduceOp.AVG with Gloo")
        self.received.append(buf.clone())
        other = self.flat[self.offset : self.offset + buf.numel()]
        self.offset += buf.numel()
        if op == dist.ReduceOp.AVG:
            buf.copy_((buf + other) / 2)
        else:
            assert op == dist.ReduceOp.SUM
            buf.add_(other)


@pytest.mark.parametrize("moments", [False, True])
@pytest.mark.parametrize("avg", [True, False])  # gloo has no AVG: SUM, then divided by the hosts
def test_two_replicas_are_averaged_through_the_packed_buffers(gloo_world_of_one, monkeypatch, moments, avg):
    model, opt = _trained(seed=1)
    other_model, other_opt = _trained(seed=2)
    mine = [t.detach().clone() for t in _in_order(model, opt, moments)]
    other = _in_order(other_model, other_opt, moments)
    merger = KStepMerger(model, opt, dist.group.WORLD, every_k=4, merge_moments=moments, bucket_bytes=4 * 7)
    assert merger.route == "flat" and merger.touched is None
    merger.hosts = 2  # as if the replica group held a second host
    fake = _OtherReplica(other, avg)
    monkeypatch.setattr(merger_mod, "dist", SimpleNamespace(all_reduce=fake.all_reduce, ReduceOp=dist.ReduceOp))
    assert merger.step(4)
    # buckets of at most 7 floats, a tensor never split: [6], [2, 2, 1]; the moments [6], [6], [2, 2, 2], [2, 1, 1]
    assert [b.numel() for b in fake.received] == [6, 5] + ([6, 6, 6, 4] if moments else [])
    assert torch.equal(torch.cat(fake.received), torch.cat([t.reshape(-1) for t in mine]))
    for got, a, b in zip(_in_order(model, opt, moments), mine, other):
        assert torch.allclose(got, (a + b) / 2, rtol=0, atol=1e-7)
    payload = sum(t.numel() for t in mine) * 4
    assert (merger.merges, merger.payload_bytes_per_merge, merger.cross_host_bytes_total) == (1, payload, payload)
    assert merger._avg_ok == avg
    assert opt.state[model[0].weight]["step"] == other_opt.state[other_model[0].weight]["step"] == 1  # not averaged


def test_a_replica_group_of_one_merges_nothing(gloo_world_of_one):
    model, opt = _trained(seed=1)
    before = [t.detach().clone() for t in _in_order(model, opt, True)]
    merger = KStepMerger(model, opt, dist.group.WORLD, every_k=4, merge_moments=True)
    assert [merger.step(s) for s in range(0, 9)] == [False, False, False, False, True, False, False, False, True]
    for got, want in zip(_in_order(model, opt, True), before):
        assert torch.equal(got, want)
    assert merger.merges == 0 and merger.max_divergence() == 0.0


def test_what_a_merge_averages(gloo_world_of_one):
    model, opt = _trained(seed=1)
    plain = KStepMerger(model, opt, dist.group.WORLD, every_k=2)
    assert [t is p for t, p in zip(plain.tensors(), _in_order(model, opt, False))] == [True] * 4
    assert [rep for _, rep in plain.classified()] == [True] * 4  # dense parameters: the same on every rank of a host
    with_moments = KStepMerger(model, opt, dist.group.WORLD, every_k=2, merge_moments=True)
    assert [t is p for t, p in zip(with_moments.tensors(), _in_order(model, opt, True))] == [True] * 12


def test_the_options_are_checked():
    with pytest.raises(ValueError, match=r"^every_k must be positive, got 0$"):
        KStepMerger(nn.Linear(1, 1), None, None, every_k=0)
    with pytest.raises(ValueError, match=r"^route must be auto, flat or hierarchical, got 'ring'$"):
        KStepMerger(nn.Linear(1, 1), None, None, every_k=1, route="ring")
    with pytest.raises(ValueError, match=r"^rows must be touched or all, got 'some'$"):
        KStepMerger(nn.Linear(1, 1), None, None, every_k=1, rows="some")


def test_one_rank_per_host_takes_the_flat_route():
    assert KStepMerger(nn.Linear(1, 1), None, None, every_k=1, route="hierarchical").route == "flat"
    assert KStepMerger(nn.Linear(1, 1), None, None, every_k=1).route == "flat"


def test_the_counters_survive_a_resume():
    a = KStepMerger(nn.Linear(1, 1), None, None, every_k=1)
    a.merges, a.cross_host_bytes_total, a.intra_host_bytes_total = 7, 4096, 512
    b = KStepMerger(nn.Linear(1, 1), None, None, every_k=1)
    b.load_state_dict(a.state_dict())
    assert (b.merges, b.cross_host_bytes_total, b.intra_host_bytes_total) == (7, 4096, 512)
    b.load_state_dict({})
    assert (b.merges, b.cross_host_bytes_total, b.intra_host_bytes_total) == (0, 0, 0)


def test_buckets_never_split_a_tensor():
    ts = [torch.zeros(n) for n in (3, 3, 5, 1, 1)]  # 12, 12, 20, 4, 4 bytes
    assert [[t.numel() for t in b] for b in _buckets(ts, cap=24)] == [[3, 3], [5, 1], [1]]
    assert [[t.numel() for t in b] for b in _buckets(ts, cap=8)] == [[3], [3], [5], [1, 1]]  # one tensor over the cap goes alone
    assert list(_buckets([], cap=8)) == []


def test_plain_tensors_are_host_replicated_sharded_ones_are_not():
    assert _host_replicated(torch.zeros(2))
    assert not _host_replicated(SimpleNamespace(local_shards=lambda: []))
    assert not _host_replicated(5)
