"""The drop-in k-step hook for a user's loop: its checks, a one-host job where every call is a
no-op over the whole world (a gloo group of one), and the merge schedule (every k steps, at
`total_steps`, and what `finish` adds) over a stand-in engine."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch import nn

import recsys.training.kstep.host_groups as host_groups
import recsys.training.kstep.merge_hook as merge_hook
from recsys.training.kstep.merge_hook import KStepMergeHook


def test_it_needs_a_process_group_and_a_positive_k(gloo_world_of_one):
    with pytest.raises(ValueError, match=r"^every_k must be positive, got 0$"):
        KStepMergeHook(0)
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match=r"^KStepMergeHook: call torch.distributed.init_process_group\(\) first$"):
        KStepMergeHook(4)


def test_one_host_is_the_whole_world_and_never_merges(gloo_world_of_one, monkeypatch):
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    hook = KStepMergeHook(2, total_steps=3)
    assert hook.hosts == 1 and hook.groups is None and hook.pg is dist.GroupMember.WORLD
    assert (hook.env.world_size, hook.env.rank) == (1, 0)
    model = nn.Linear(1, 1)
    assert [hook.step(model, None) for _ in range(3)] == [False, False, False]
    assert hook.steps == 3 and hook.merges == 0 and not hook.finish()


def test_more_hosts_than_ranks_is_refused(gloo_world_of_one):
    with pytest.raises(ValueError, match=r"^world size 1 is not divisible into 2 hosts$"):
        KStepMergeHook(2, hosts=2)


class _Engine:
    """KStepMerger's interface as the hook uses it."""

    def __init__(self, dmp, optimizer, replica_pg, every_k, merge_moments, **kwargs) -> None:
        self.dmp, self.optimizer, self.every_k, self.kwargs = dmp, optimizer, every_k, kwargs
        self.merges = 0

    def should_merge(self, step: int) -> bool:
        return step > 0 and step % self.every_k == 0

    def merge(self) -> None:
        self.merges += 1


def _two_hosts(monkeypatch, every_k: int, total_steps: int | None) -> KStepMergeHook:
    """A hook as on one rank of two hosts: the host groups stand in (the world of one for both)."""
    groups = SimpleNamespace(hosts=2, host_pg=dist.group.WORLD, replica_pg=dist.group.WORLD)
    made = []

    def build(hosts, timeout):
        made.append((hosts, timeout))
        return groups

    monkeypatch.setattr(host_groups, "build_host_groups", build)
    monkeypatch.setattr(merge_hook, "KStepMerger", _Engine)
    hook = KStepMergeHook(every_k, total_steps=total_steps, hosts=2, timeout=timedelta(seconds=30))
    assert made == [(2, timedelta(seconds=30))] and hook.groups is groups
    return hook


def test_merges_every_k_steps_and_at_the_total(gloo_world_of_one, monkeypatch):
    hook = _two_hosts(monkeypatch, every_k=4, total_steps=10)
    model = nn.Linear(1, 1)
    merged = [step for step in range(1, 11) if hook.step(model, "opt")]
    assert merged == [4, 8, 10] and hook.merges == 3
    assert hook.merger.kwargs == {
        "host_pg": dist.group.WORLD,
        "route": "auto",
        "rows": "touched",
        "tracking_from_start": False,
        "outer": "average",
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "compress": "none",
    }
    # (bound after the first step: the rows that step moved were not seen)
    assert not hook.finish()  # the total was a merge


def test_finish_merges_the_steps_left(gloo_world_of_one, monkeypatch):
    model = nn.Linear(1, 1)
    with _two_hosts(monkeypatch, every_k=4, total_steps=None) as hook:
        for _ in range(6):
            hook.step(model, "opt")
        assert hook.merges == 1
    assert hook.merges == 2  # steps 5 and 6, merged on leaving the block
    with pytest.raises(ZeroDivisionError, match="^a failed step$"):
        with _two_hosts(monkeypatch, every_k=4, total_steps=None) as failed:
            failed.step(model, "opt")
            raise ZeroDivisionError("a failed step")  # no merge after an error: the other hosts may not reach it
    assert failed.merges == 0


def test_another_model_or_optimizer_is_refused(gloo_world_of_one, monkeypatch):
    hook = _two_hosts(monkeypatch, every_k=4, total_steps=None)
    model = nn.Linear(1, 1)
    hook.step(model, "opt")
    with pytest.raises(ValueError, match=r"^KStepMergeHook.step: called with another model or optimizer than at the first step$"):
        hook.step(nn.Linear(1, 1), "opt")
    with pytest.raises(ValueError, match=r"another model or optimizer"):
        hook.step(model, "other opt")
