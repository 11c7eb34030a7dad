"""Bytes per step between ranks, by link kind, through PCIe switches and into hosts
(sharding/planner/cost/traffic.py): each figure is the module docstring's formula written out for
a batch of 10 per rank and tables of a few columns."""

from __future__ import annotations


import numpy as np
import pytest

from sharding.plan.report import ShardInfo, TableInfo
from sharding.planner.cost.traffic import (
    DEFAULT_BATCH_SIZE_PER_RANK,
    apply_topology,
    batch_size_of,
    format_text,
    link_kind,
    traffic,
)
from sharding.topology.cluster import ClusterTopology
from sharding.topology.topology_file import load_topology
from tests.support.round_cluster import GIB, host, two_hosts

B = 10


def two_by_two() -> ClusterTopology:
    """Ranks 0, 1 on host a, 2, 3 on host b; 512 GiB of host memory each."""
    return two_hosts(ddr_bytes=512 * GIB, name="two-by-two")


def table(sharding_type: str, *shards: tuple[int, int, int], kernel: str = "fused", name: str = "t") -> TableInfo:
    """A table with shards ``(rank, rows, cols)`` (their memory is not read here)."""
    return TableInfo(
        "ebc", name, sharding_type, kernel, sorted({r for r, _, _ in shards}), None, shards=[ShardInfo(r, n, c, 0, 0) for r, n, c in shards]
    )


# --- bytes between ranks ----------------------------------------------------------------------------


def test_a_table_wise_owner_receives_every_ranks_ids_and_sends_each_its_pooled_slice():
    tr = traffic([table("table_wise", (0, 100, 4))], 3, B)
    ids, pooled = B * 8, B * 4 * 4
    assert tr.fwd.tolist() == [[0, pooled, pooled], [ids, 0, 0], [ids, 0, 0]]
    assert tr.bwd.tolist() == [[0, 0, 0], [pooled, 0, 0], [pooled, 0, 0]]  # the gradient goes back the way the output came
    assert tr.lookups.tolist() == [3 * B, 0, 0]
    assert tr.compute_bytes.tolist() == [2 * 3 * B * 4 * 4, 0, 0] and tr.uvm_bytes.tolist() == [0, 0, 0]
    assert tr.sent.tolist() == [2 * pooled, ids + pooled, ids + pooled]
    assert tr.received.tolist() == [2 * ids + 2 * pooled, pooled, pooled]
    assert np.array_equal(tr.total, tr.fwd + tr.bwd)


def test_every_column_shard_receives_every_id():
    tr = traffic([table("column_wise", (0, 100, 2), (1, 100, 6))], 2, B)
    assert tr.fwd.tolist() == [[0, B * 2 * 4 + B * 8], [B * 6 * 4 + B * 8, 0]]
    assert tr.lookups.tolist() == [2 * B, 2 * B]
    assert tr.compute_bytes.tolist() == [2 * 2 * B * 2 * 4, 2 * 2 * B * 6 * 4]


def test_a_row_shard_receives_its_rows_share_of_the_ids_and_sends_whole_partial_sums():
    tr = traffic([table("row_wise", (0, 30, 4), (1, 70, 4))], 2, B)
    assert tr.fwd[1, 0] == pytest.approx(B * 8 * 0.3 + B * 4 * 4)  # rank 1's ids for shard 0, shard 1's partial sums
    assert tr.fwd[0, 1] == pytest.approx(B * 8 * 0.7 + B * 4 * 4)
    assert tr.bwd.tolist() == [[0, B * 4 * 4], [B * 4 * 4, 0]]
    assert tr.lookups.tolist() == pytest.approx([2 * B * 0.3, 2 * B * 0.7])


def test_a_data_parallel_table_all_reduces_its_gradient_in_a_ring_and_sends_nothing_forward():
    tr = traffic([table("data_parallel", (0, 50, 4), (1, 50, 4), (3, 50, 4))], 4, B)
    ring = 2 * (3 - 1) / 3 * 50 * 4 * 4  # 2 (n-1)/n x the table's bytes to the ring's next member
    expected = np.zeros((4, 4))
    expected[0, 1] = expected[1, 3] = expected[3, 0] = ring
    assert not tr.fwd.any()
    assert tr.bwd.ravel().tolist() == pytest.approx(expected.ravel().tolist(), rel=1e-12)
    assert tr.lookups.tolist() == [B, B, 0, B]
    assert tr.compute_bytes.tolist() == [2 * B * 4 * 4, 2 * B * 4 * 4, 0, 2 * B * 4 * 4]


def test_a_replica_on_one_rank_exchanges_nothing():
    tr = traffic([table("data_parallel", (1, 50, 4))], 2, B)
    assert not tr.total.any() and tr.lookups.tolist() == [0, B]


def test_a_fused_uvm_tables_lookups_are_all_host_memory_traffic():
    tr = traffic([table("table_wise", (1, 100, 4), kernel="fused_uvm"), table("table_wise", (0, 100, 4), name="u")], 2, B)
    assert tr.uvm_bytes.tolist() == [0, 2 * 2 * B * 4 * 4] and tr.compute_bytes.tolist() == [2 * 2 * B * 4 * 4] * 2


def test_shards_on_ranks_outside_the_world_are_left_out():
    tr = traffic([table("row_wise", (0, 30, 4), (5, 70, 4)), table("table_wise", (-1, 10, 4), name="u")], 2, B)
    assert tr.lookups.tolist() == [2 * B, 0]  # the only row shard left holds every row
    assert tr.fwd[1, 0] == B * 8 and tr.fwd[0, 1] == B * 4 * 4


def test_no_tables_no_traffic():
    tr = traffic([], 2, B)
    assert not tr.total.any() and not tr.lookups.any() and tr.to_dict()["forward_bytes"] == [[0, 0], [0, 0]]


def test_to_dict_without_a_topology_is_bytes_per_rank_as_integers():
    d = traffic([table("table_wise", (0, 100, 4))], 2, B).to_dict()
    assert d == {
        "model": "see sharding/planner/cost/traffic.py",
        "batch_size_per_rank": B,
        "forward_bytes": [[0, 160], [80, 0]],
        "backward_bytes": [[0, 0], [160, 0]],
        "ranks": [
            {"rank": 0, "sent_bytes": 160, "received_bytes": 240, "lookups": 20, "compute_bytes": 640},
            {"rank": 1, "sent_bytes": 240, "received_bytes": 160, "lookups": 0, "compute_bytes": 0},
        ],
    }


@pytest.mark.parametrize(
    ("header", "batch"),
    [
        ({"meta": {"batch_size_per_rank": 256}}, 256),
        ({"meta": {"batch_size_per_rank": 0}}, DEFAULT_BATCH_SIZE_PER_RANK),
        ({"meta": {"batch_size_per_rank": "256"}}, DEFAULT_BATCH_SIZE_PER_RANK),
        ({"meta": None}, DEFAULT_BATCH_SIZE_PER_RANK),
        ({}, DEFAULT_BATCH_SIZE_PER_RANK),
    ],
)
def test_the_batch_is_the_plans_or_512(header, batch):
    assert DEFAULT_BATCH_SIZE_PER_RANK == 512
    assert batch_size_of(header) == batch


# --- with a topology --------------------------------------------------------------------------------


def test_link_kinds():
    t = two_by_two()
    assert (link_kind(t, 0, 1), link_kind(t, 1, 0), link_kind(t, 0, 2), link_kind(t, 3, 1)) == ("nvlink", "nvlink", "network", "network")
    pcie_only = ClusterTopology((host("h", nvlink=False, ddr_bytes=512 * GIB),))
    assert link_kind(pcie_only, 0, 1) == "pcie"
    assert link_kind(load_topology("cpu-gloo"), 0, 1) == "shm"


def test_bytes_by_link_kind_through_each_switch_and_into_each_host():
    infos = [table("table_wise", (0, 100, 4)), table("table_wise", (3, 100, 4), kernel="fused_uvm", name="u")]
    memory = [{"hbm_bytes": 1600, "host_bytes": 0}, {"hbm_bytes": 0, "host_bytes": 0}, {"hbm_bytes": 0, "host_bytes": 0}]
    memory.append({"hbm_bytes": 0, "host_bytes": 1600, "ssd_bytes": 0})
    tr = apply_topology(traffic(infos, 4, B), two_by_two(), infos, memory)
    ids, pooled = B * 8, B * 4 * 4
    assert tr.topology == "two-by-two"
    # each owner's slices go to its host's other rank over NVLink and to the other host's over the network;
    # the others send each owner their ids and gradient slices the same ways
    assert tr.bytes_by_kind["nvlink"].tolist() == [pooled, ids + pooled, ids + pooled, pooled]
    assert tr.bytes_by_kind["network"].tolist() == [ids + 3 * pooled, ids + pooled, ids + pooled, ids + 3 * pooled]
    assert not tr.bytes_by_kind["pcie"].any() and not tr.bytes_by_kind["shm"].any()
    # each host's switch: every transfer between the hosts (both tables), plus rank 3's UVM lookups on host b
    between = 4 * (ids + 2 * pooled)
    uvm = 2 * 4 * B * 4 * 4
    assert [h["pcie_switches"][0]["bytes_per_step"] for h in tr.hosts] == [between, between + uvm]
    assert tr.hosts[0] == {
        "host": 0,
        "name": "a",
        "ranks": [0, 1],
        "hbm_bytes": 1600,
        "hbm_capacity": 160 * GIB,
        "host_bytes": 0,
        "host_capacity": 512 * GIB,
        "ssd_bytes": 0,
        "ssd_capacity": 0,
        "pcie_switches": [{"switch": "sw", "numa": 0, "gpus": [0, 1], "bytes_per_step": between}],
    }
    assert tr.hosts[1]["host_bytes"] == 1600 and tr.hosts[1]["ranks"] == [2, 3]
    d = tr.to_dict()
    assert d["topology"] == "two-by-two" and d["hosts"] == tr.hosts
    assert d["ranks"][1]["sent_bytes_by_link"] == {"nvlink": ids + pooled, "pcie": 0, "network": ids + pooled, "shm": 0}


def test_without_rank_memory_the_hosts_hold_nothing():
    tr = apply_topology(traffic([], 4, B), two_by_two())
    assert [(h["hbm_bytes"], h["host_bytes"], h["ssd_bytes"]) for h in tr.hosts] == [(0, 0, 0), (0, 0, 0)]


def test_a_topology_of_another_world_size_is_refused():
    with pytest.raises(ValueError, match=r"^topology two-by-two: 4 ranks, the plan has 2$"):
        apply_topology(traffic([], 2, B), two_by_two())


def test_the_text_report_in_megabytes_per_rank_and_gigabytes_per_host():
    mb = 2**20
    infos = [table("table_wise", (0, 100, 4096))]  # 160 KiB of pooled output per peer
    tr = apply_topology(
        traffic(infos, 4, B),
        two_by_two(),
        infos,
        [{"hbm_bytes": 2 * GIB, "host_bytes": 0}] + [{"hbm_bytes": 0, "host_bytes": 0}] * 3,
    )
    lines = format_text(tr).splitlines()
    assert lines[0].startswith("traffic by link kind on two-by-two (MB per step, forward + backward, batch 10 per rank;")
    assert lines[1].split() == ["rank", "sent", "MB", "NVLink", "PCIe", "network", "shared", "memory", "lookups"]
    pooled = B * 4096 * 4 / mb
    assert lines[2].split() == ["0", f"{3 * pooled:,.2f}", f"{pooled:,.2f}", "0.00", f"{2 * pooled:,.2f}", "0.00", "40"]
    switch = 2 * (B * 8 + 2 * B * 4096 * 4) / mb
    assert lines[6] == f"host 0 (a): HBM 2.00 / 160 GB, host 0.00 / 512 GB; PCIe switch load per step: sw {switch:,.1f} MB"
    assert len(lines) == 8
