"""Host groups of a hierarchical run: the host-major ranks of each host and replica group, worked
out by hand for 2 hosts x 2 ranks (the group creation recorded, not run), the host count from
the config or torchrun's environment, the collective timeout, and a real world of one."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

import recsys.training.kstep.host_groups as host_groups
from recsys.training.kstep.host_groups import HostGroups, build_host_groups, pg_timeout_from_env, resolve_hosts


@pytest.mark.parametrize(
    "rank, host, local, host_ranks, replica_ranks",
    [(0, 0, 0, [0, 1], [0, 2]), (1, 0, 1, [0, 1], [1, 3]), (2, 1, 0, [2, 3], [0, 2]), (3, 1, 1, [2, 3], [1, 3])],
)
def test_two_hosts_of_two_ranks(monkeypatch, rank, host, local, host_ranks, replica_ranks):
    made = []

    def enumerate_groups(lists, timeout=None):
        made.append((lists, timeout))
        return f"group of {lists}", []

    monkeypatch.setattr(host_groups.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(host_groups.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(host_groups.dist, "new_subgroups_by_enumeration", enumerate_groups)
    g = build_host_groups(2)
    # every rank creates every group, in the same order: the hosts', then the replicas'
    assert made == [([[0, 1], [2, 3]], None), ([[0, 2], [1, 3]], None)]
    assert (g.hosts, g.ranks_per_host, g.host, g.local_rank) == (2, 2, host, local)
    assert (g.host_ranks, g.replica_ranks) == (host_ranks, replica_ranks)


def test_ranks_of_three_hosts_of_four():
    g = HostGroups(hosts=3, ranks_per_host=4, host=2, local_rank=1, host_pg=None, replica_pg=None)
    assert g.host_ranks == [8, 9, 10, 11] and g.replica_ranks == [1, 5, 9]


def test_a_world_of_one_is_one_host_and_takes_the_timeout(gloo_world_of_one):
    g = build_host_groups(1, timeout=timedelta(seconds=42))
    assert (g.hosts, g.ranks_per_host, g.host, g.local_rank) == (1, 1, 0, 0)
    assert dist.get_world_size(g.host_pg) == 1 and dist.get_world_size(g.replica_pg) == 1
    with pytest.raises(ValueError, match=r"^world size 1 is not divisible into 2 hosts$"):
        build_host_groups(2)
    with pytest.raises(ValueError, match=r"^world size 1 is not divisible into 0 hosts$"):
        build_host_groups(0)


def test_the_host_count_from_the_config_or_torchrun(monkeypatch):
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    assert resolve_hosts(1) == 1
    monkeypatch.setenv("NNODES", "3")
    assert resolve_hosts(1) == 3
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert resolve_hosts(0) == 2  # torchrun's agents first
    assert resolve_hosts(4) == 4  # the config wins
    monkeypatch.setenv("GROUP_WORLD_SIZE", "0")
    monkeypatch.setenv("NNODES", "x")
    assert resolve_hosts(1) == 1


def test_the_collective_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("RECSYS_PG_TIMEOUT_S", raising=False)
    assert pg_timeout_from_env() == timedelta(seconds=600)
    assert pg_timeout_from_env(30) == timedelta(seconds=30)
    monkeypatch.setenv("RECSYS_PG_TIMEOUT_S", "2.5")
    assert pg_timeout_from_env() == timedelta(seconds=2.5)
    monkeypatch.setenv("RECSYS_PG_TIMEOUT_S", "ten")
    with pytest.raises(ValueError, match=r"^RECSYS_PG_TIMEOUT_S='ten' is not a number of seconds$"):
        pg_timeout_from_env()
    monkeypatch.setenv("RECSYS_PG_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match=r"^RECSYS_PG_TIMEOUT_S='-1' must be positive$"):
        pg_timeout_from_env()
