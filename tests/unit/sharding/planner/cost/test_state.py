"""Incremental scoring (sharding/planner/cost/state.py): a ``CostState`` adds shards one at a time
and prices "this shard on that rank" for the greedy placement. Figures are worked by hand on two
hosts of two GPUs with round bandwidths (and an SSD tier), and on one host of two sockets."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import PlacedShard
from sharding.topology.topology_file import load_topology
from sharding.planner.cost.candidates import candidate_scores, candidate_step_times
from tests.support.round_cluster import (
    GB,
    HBM_BW,
    NIC_BW,
    NVLINK_BW,
    PORT_BW,
    SSD_READ_BW,
    SSD_WRITE_BW,
    UPLINK_BW,
    shard,
    two_hosts,
    two_sockets,
)

B = 1000
LATENCY = 25e-6  # one collective spanning hosts
LOOKUP_BYTES = 3 * 128 + 204  # a 25-column row: 3 passes over 4 sectors, plus a CUDA TBE's id handling
IDS = B * (8 + 4)  # one rank's ids and lengths for a table of pooling 1
POOLED = B * 25 * 4  # a 25-column table's pooled output for one rank's batch


@pytest.fixture(scope="module")
def model() -> TopologyCostModel:
    return TopologyCostModel(two_hosts(ssd_on=(True, False)), B)  # host a with an SSD tier


def added(model: TopologyCostModel, *shards: PlacedShard):
    st = model.new_state()
    for s in shards:
        st.add(s)
    return st


# --- latency and phases ---------------------------------------------------------------------------


def test_a_sharding_types_latency_is_paid_once_whatever_its_number_of_tables(model):
    st = model.new_state()
    assert st.new_type_latency("row_wise") == pytest.approx(5 * LATENCY)
    st.mark_type("row_wise")
    st.mark_type("row_wise")
    assert st.latency == pytest.approx(5 * LATENCY) and st.new_type_latency("row_wise") == 0.0
    st.mark_type("data_parallel")
    assert st.latency == pytest.approx(6 * LATENCY) and st.types == {"row_wise", "data_parallel"}


def test_comm_time_is_each_phases_busiest_link_plus_the_latency(model):
    st = model.new_state()
    n = model.links.count
    assert st.load("x").tolist() == [0.0] * n and st.comm_time() == 0.0
    st.add_load("x", np.eye(n)[0] * 2e-6)
    st.add_load("x", np.eye(n)[0] * 1e-6 + np.eye(n)[1] * 2.5e-6)
    st.add_load("y", np.eye(n)[5] * 4e-6)
    st.mark_type("data_parallel")
    assert st.load("x")[:2].tolist() == [3e-6, 2.5e-6]
    assert st.comm_time() == pytest.approx(3e-6 + 4e-6 + LATENCY, rel=1e-12)
    assert st.comm.tolist() == pytest.approx([3e-6 + 4e-6 + LATENCY] * 4, rel=1e-12)  # every rank waits for all


def test_a_placed_table_wise_table_adds_its_lookups_and_all_to_alls(model):
    st = added(model, shard(0))
    lookup = B * 4 * LOOKUP_BYTES / HBM_BW
    assert st.lookup.tolist() == pytest.approx([lookup, 0, 0, 0], rel=1e-12)
    assert st.comm_time() == pytest.approx((2 * IDS + 4 * POOLED) / NIC_BW + 5 * LATENCY, rel=1e-12)
    assert st.step_time() == pytest.approx(lookup + st.comm_time(), rel=1e-12)
    assert st.rank_time().tolist() == pytest.approx([lookup + st.comm_time()] + [st.comm_time()] * 3, rel=1e-12)
    assert st.hbm_bytes.tolist() == [1000 * 25 * 4 + 1000 * 4, 0, 0, 0]


# --- one shard's collectives --------------------------------------------------------------------------


def test_a_row_wise_shard_alone_in_its_group_receives_its_ids_and_rings_nothing(model):
    loads = dict(model.new_state().shard_loads(shard(2, rows=100, st="row_wise", group=(2,))))
    ids = (B * 8) * 0.1 + B * 4  # a tenth of each rank's ids (its rows' share) and all its lengths
    assert np.allclose(loads["row_wise:ids"], ids * model.links.in_inv[2], rtol=1e-12, atol=0)
    assert not loads["row_wise:fwd"].any() and not loads["row_wise:bwd"].any()


def test_a_row_wise_shard_without_a_group_rings_over_every_rank(model):
    loads = dict(model.new_state().shard_loads(shard(0, rows=250, st="row_wise")))
    ring = model.ring_rank_inv((0, 1, 2, 3), 0) * (0.75 * B * 4 * 25 * 4)
    assert np.allclose(loads["row_wise:fwd"], ring, rtol=1e-12, atol=0) and np.allclose(loads["row_wise:bwd"], ring, rtol=1e-12, atol=0)


def test_one_replica_and_unknown_sharding_types_have_no_collectives(model):
    st = model.new_state()
    assert st.shard_loads(shard(1, st="data_parallel", group=(1,))) == []
    assert st.shard_loads(shard(1, st="grid_shard")) == []


def test_a_table_row_wise_shard_without_a_group_uses_its_hosts_ranks(model):
    st = model.new_state()
    implicit = dict(st.shard_loads(shard(3, rows=500, st="table_row_wise")))
    explicit = dict(st.shard_loads(shard(3, rows=500, st="table_row_wise", group=(2, 3))))
    assert implicit.keys() == explicit.keys() == {f"table_row_wise:{p}" for p in ("ids", "fwd_rs", "fwd_a2a", "bwd_a2a", "bwd_ag")}
    for phase in implicit:
        assert np.array_equal(implicit[phase], explicit[phase])
    # its half of a rank's output, to ranks 0 and 1 through the NICs
    assert np.allclose(implicit["table_row_wise:fwd_a2a"], POOLED / 2 * model.links.out_off_inv[3], rtol=1e-12, atol=0)


# --- memory ---------------------------------------------------------------------------------------


WEIGHTS = 1000 * 25 * 4
STATE = 1000 * 4  # row-wise Adagrad's float per row


@pytest.mark.parametrize(
    ("kernel", "load_factor", "hbm", "host", "ssd"),
    [
        ("fused", None, WEIGHTS + STATE, 0, 0),
        ("fused_uvm", None, 0, WEIGHTS + STATE, 0),
        ("fused_uvm_caching", 0.5, 0.5 * WEIGHTS, WEIGHTS + STATE, 0),
        ("fused_uvm_caching", None, 0.2 * WEIGHTS, WEIGHTS + STATE, 0),  # torchrec's default load factor
        ("key_value", 0.25, 0.25 * WEIGHTS, 0, WEIGHTS + STATE),
    ],
)
def test_where_a_shard_is_held(model, kernel, load_factor, hbm, host, ssd):
    st = added(model, shard(1, kernel=kernel, load_factor=load_factor))
    assert (st.hbm_bytes[1], st.host_bytes[1], st.ssd_bytes[1]) == (pytest.approx(hbm), host, ssd)


def test_cpu_ranks_hold_everything_in_host_memory():
    st = added(TopologyCostModel(load_topology("cpu-gloo"), B), shard(1))
    assert st.hbm_bytes.tolist() == [0, 0] and st.host_bytes.tolist() == [0, WEIGHTS + STATE]
    assert st.numa_used == {(0, 0): WEIGHTS + STATE}
    assert st.host_io().tolist() == [0.0, 0.0]  # no PCIe between a CPU rank and its memory


# --- host memory traffic --------------------------------------------------------------------------


def test_a_uvm_cache_without_a_load_factor_misses_four_fifths(model):
    st = added(model, shard(0, kernel="fused_uvm_caching"))
    rows = B * 4 * 3 * 128
    assert st.host_io()[0] == pytest.approx(0.8 * rows / UPLINK_BW, rel=1e-12)
    assert st.lookup[0] == pytest.approx(B * 4 * (0.2 * 3 * 128 + 204) / HBM_BW, rel=1e-12)


@pytest.mark.parametrize(("miss_rate", "used"), [(1.5, 1.0), (-0.5, 0.0), (0.3, 0.3)])
def test_a_measured_miss_rate_is_clamped_to_between_none_and_all(model, miss_rate, used):
    st = added(model, shard(0, kernel="fused_uvm_caching", load_factor=0.5, miss_rate=miss_rate))
    assert st.host_io()[0] == pytest.approx(used * B * 4 * 3 * 128 / UPLINK_BW, rel=1e-12, abs=0)


def test_host_memory_spills_to_the_other_socket_when_the_local_node_is_full():
    rows = 6_000_000  # 624 MB each with their row-wise state: two do not fit one 1 GiB node
    held = rows * (25 * 4 + 4)
    m = TopologyCostModel(two_sockets(ddr_bytes=2**30), B)
    st = added(m, shard(0, rows=rows, table_rows=rows, kernel="fused_uvm", table="a"))
    assert st.numa_used == {(0, 0): held, (0, 1): 0}
    st.add(shard(0, rows=rows, table_rows=rows, kernel="fused_uvm", table="b"))
    assert st.numa_used == {(0, 0): held, (0, 1): held}
    each = B * 2 * 3 * 128  # both ranks' ids, the rows' three passes
    # rank 0's uplink carries both tables (61.44 us), the inter-socket link the second one (76.8 us)
    assert st.host_io().tolist() == pytest.approx([each / (10 * GB), 0.0], rel=1e-12)
    # neither node has room: the third table's memory is counted on the local node
    st.add(shard(0, rows=rows, table_rows=rows, kernel="fused_uvm", table="c"))
    assert st.numa_used == {(0, 0): 2 * held, (0, 1): held}


# --- the SSD tier ---------------------------------------------------------------------------------


def test_a_key_value_shard_reads_and_writes_its_misses_on_its_hosts_drives(model):
    s = shard(1, rows=250, cols=64, st="row_wise", kernel="key_value", load_factor=0.25, group=(1,))
    st = added(model, s)
    misses = 0.75 * B * 4 * 0.25  # every rank's ids, this shard's quarter of the rows, 1 - load factor
    io = misses * (64 * 4 + 4)
    assert st.ssd_traffic(s) == pytest.approx(io, rel=1e-12)
    assert (st.ssd_read.tolist(), st.ssd_write.tolist()) == ([pytest.approx(io), 0.0], [pytest.approx(io), 0.0])
    seconds = io / SSD_READ_BW + io / SSD_WRITE_BW
    assert st.ssd_io().tolist() == pytest.approx([0.0, seconds, 0.0, 0.0], rel=1e-12)  # rank 0 holds none: it does not wait
    assert st.local_time()[1] == pytest.approx(st.lookup[1] + seconds, rel=1e-12)
    # a second shard on the host's other rank: the drives serve both, both ranks wait for all of it
    st.add(shard(0, rows=250, cols=64, st="row_wise", kernel="key_value", load_factor=0.25, group=(0,)))
    assert st.ssd_io().tolist() == pytest.approx([2 * seconds, 2 * seconds, 0.0, 0.0], rel=1e-12)


def test_a_key_value_replica_misses_on_its_own_batch(model):
    s = shard(0, cols=64, st="data_parallel", kernel="key_value", miss_rate=0.1, group=(0,))
    assert model.new_state().ssd_traffic(s) == pytest.approx(0.1 * B * (64 * 4 + 4), rel=1e-12)


def test_ssd_time_on_a_host_without_drives_is_infinite_unless_there_is_nothing_to_move(model):
    st = model.new_state()
    assert st.ssd_seconds(1, 0.0, 0.0) == 0.0
    assert math.isinf(st.ssd_seconds(1, 1.0, 0.0)) and math.isinf(st.ssd_seconds(1, 0.0, 1.0))
    assert st.ssd_seconds(0, 4e9, 2e9) == pytest.approx(2.0)
    assert st.ssd_traffic(shard(0)) == 0.0 and st.ssd_io().tolist() == [0.0] * 4


# --- shards added together ------------------------------------------------------------------------


def _same_cost(a, b) -> None:
    ca, cb = a.cost(), b.cost()
    assert ca.step_time == pytest.approx(cb.step_time, rel=1e-12)
    for f in ("rank_time", "lookup", "host_io", "comm", "hbm_bytes", "host_bytes"):
        assert getattr(ca, f).tolist() == pytest.approx(getattr(cb, f).tolist(), rel=1e-12), f
    assert {p: v[1] for p, v in ca.phases.items()} == pytest.approx({p: v[1] for p, v in cb.phases.items()}, rel=1e-12)


@pytest.mark.parametrize(
    "shards",
    [
        [shard(r, rows=250, st="row_wise", group=(0, 1, 2, 3)) for r in range(4)],
        [shard(r, rows=rows, st="row_wise") for r, rows in enumerate((100, 200, 300, 400))],  # no group: every rank
        [shard(r, st="data_parallel", group=(0, 1, 2, 3)) for r in range(4)],
        [shard(r, rows=500, st="row_wise", group=(1, 2)) for r in (1, 2)],  # fewer than 4: one by one
    ],
    ids=["row_wise", "row_wise_uneven", "data_parallel", "two_shards"],
)
def test_a_tables_shards_added_together_cost_what_they_cost_one_by_one(model, shards):
    together = model.new_state()
    together.add_many(shards)
    _same_cost(together, added(model, *shards))


def test_add_many_of_nothing_changes_nothing(model):
    st = model.new_state()
    st.add_many([])
    assert st.step_time() == 0.0 and st.types == set()


def test_table_row_wise_shards_priced_in_closed_form_cost_what_they_add(model):
    protos = [shard(0, rows=300, st="table_row_wise"), shard(0, rows=700, st="table_row_wise")]
    st = model.new_state()
    lk, loads = st.twrw_loads(protos, [2, 3])
    assert lk.tolist() == pytest.approx([0, 0, B * 4 * LOOKUP_BYTES * 0.3 / HBM_BW, B * 4 * LOOKUP_BYTES * 0.7 / HBM_BW], rel=1e-12)
    one_by_one = added(model, shard(2, rows=300, st="table_row_wise", group=(2, 3)), shard(3, rows=700, st="table_row_wise", group=(2, 3)))
    assert {p for p, _ in loads} == set(one_by_one.loads)
    for phase, v in loads:
        assert np.allclose(v, one_by_one.loads[phase], rtol=1e-12, atol=0), phase


# --- trials for the greedy placement --------------------------------------------------------------


def test_a_trial_prices_a_shards_loads_without_adding_them(model):
    st = model.new_state()
    s = shard(0)
    lookup = B * 4 * LOOKUP_BYTES / HBM_BW
    delta = np.array([lookup, 0, 0, 0])
    step, spread = st.step_time_with(delta, st.shard_loads(s), new_type="table_wise")
    assert step == pytest.approx(lookup + (2 * IDS + 4 * POOLED) / NIC_BW + 5 * LATENCY, rel=1e-12)
    # every link's load squared, in (bytes to one peer / bandwidth)^2: NVLink 2 links x 1, PCIe 3 links x 2^2 (the
    # owner's port, host a's NIC port, host b's NIC port carry both remote peers) + 2 x 1, NICs 2 links x 2^2
    per_byte_sq = 2 / NVLINK_BW**2 + 14 / PORT_BW**2 + 8 / NIC_BW**2
    assert spread == pytest.approx(lookup**2 + (IDS**2 + 2 * POOLED**2) * per_byte_sq, rel=1e-12)
    assert st.step_time() == 0.0 and st.loads == {}  # nothing added
    st.add(s)
    assert (st.step_time(), st.spread()) == (pytest.approx(step, rel=1e-12), pytest.approx(spread, rel=1e-12))
    # from the state's precomputed base, a second table on rank 2 (its type's latency already paid)
    base = st.base_scores()
    again, _ = st.step_time_with(np.array([0, 0, lookup, 0]), st.shard_loads(shard(2)), base=base)
    assert again == pytest.approx(lookup + (2 * IDS + 4 * POOLED) / NIC_BW + 5 * LATENCY, rel=1e-12)


def test_a_second_table_is_cheapest_on_the_other_host(model):
    st = added(model, shard(0, table="a"))
    steps = candidate_step_times(st, shard(0, table="b"), [0, 1, 2, 3])
    lookup = B * 4 * LOOKUP_BYTES / HBM_BW
    one_nic = (2 * IDS + 4 * POOLED) / NIC_BW + 5 * LATENCY  # each host's NIC carries one owner's traffic
    both_on_a = (4 * IDS + 8 * POOLED) / NIC_BW + 5 * LATENCY  # host a's NIC carries both owners'
    assert steps.tolist() == pytest.approx([2 * lookup + both_on_a, lookup + both_on_a, lookup + one_nic, lookup + one_nic], rel=1e-12)


def _placed_scores(st, proto: PlacedShard, ranks: list[int]) -> tuple[list[float], list[float]]:
    """(step time, spread) of a copy of ``st`` with ``proto`` added on each rank."""
    steps, spreads = [], []
    for r in ranks:
        placed = st.copy()
        placed.add(dataclasses.replace(proto, rank=r))
        steps.append(placed.step_time())
        spreads.append(placed.spread())
    return steps, spreads


def _state_with_a_table_wise_and_a_row_wise_table(model):
    return added(model, shard(0, table="a"), shard(3, rows=500, st="row_wise", table="c", group=(3,)))


@pytest.mark.parametrize(
    "proto",
    [shard(0, table="b"), shard(0, table="b", kernel="fused_uvm"), shard(0, rows=500, st="row_wise", table="b", group=(0,))],
    ids=["table_wise", "uvm", "row_wise"],
)
def test_a_candidates_step_time_is_the_placed_states_and_its_spread_orders_candidates_alike(model, proto):
    st = _state_with_a_table_wise_and_a_row_wise_table(model)
    steps, spreads = candidate_scores(st, proto, [0, 1, 2, 3])
    placed_steps, placed_spreads = _placed_scores(st, proto, [0, 1, 2, 3])
    assert steps.tolist() == pytest.approx(placed_steps, rel=1e-12)
    assert (spreads - spreads[0]).tolist() == pytest.approx([x - placed_spreads[0] for x in placed_spreads], rel=1e-9, abs=1e-24)
    assert st.cost().step_time == _state_with_a_table_wise_and_a_row_wise_table(model).step_time()  # the trials added nothing


@pytest.mark.parametrize(
    "proto",
    [shard(0, table="b"), shard(0, table="b", kernel="fused_uvm"), shard(0, rows=500, st="row_wise", table="b", group=(0,))],
    ids=["table_wise", "uvm", "row_wise"],
)
def test_a_candidates_spread_on_a_state_without_its_type_is_the_placed_states(model, proto):
    other = shard(0, table="a") if proto.sharding_type == "row_wise" else shard(3, rows=500, st="row_wise", table="c", group=(3,))
    st = added(model, other)
    _, spreads = candidate_scores(st, proto, [0, 1, 2, 3])
    assert spreads.tolist() == pytest.approx(_placed_scores(st, proto, [0, 1, 2, 3])[1], rel=1e-9)


def test_a_candidates_spread_on_a_state_holding_its_type_is_the_placed_states(model):
    st = _state_with_a_table_wise_and_a_row_wise_table(model)
    _, spreads = candidate_scores(st, shard(0, table="b"), [0, 1, 2, 3])
    assert spreads.tolist() == pytest.approx(_placed_scores(st, shard(0, table="b"), [0, 1, 2, 3])[1], rel=1e-9)


def test_a_copy_is_independent_of_its_original(model):
    st = added(model, shard(0, kernel="fused_uvm", table="a"))
    before = st.cost()
    c = st.copy()
    c.add(shard(1, kernel="key_value", st="row_wise", rows=500, group=(1,), table="b"))
    c.add(shard(2, st="data_parallel", group=(2, 3), table="d"))
    after = st.cost()
    assert after.step_time == before.step_time and after.phases == before.phases
    assert after.host_io.tolist() == before.host_io.tolist() and st.types == {"table_wise"}
    assert st.ssd_bytes.tolist() == [0.0] * 4 and c.ssd_bytes[1] > 0


# --- the plan's cost ------------------------------------------------------------------------------


def test_cost_attributes_each_phase_to_the_ranks_own_links(model):
    cost = added(model, shard(3)).cost()
    own = [
        (IDS + 2 * POOLED) / PORT_BW,  # ranks 0, 1: their own PCIe port, one peer's bytes each way
        (IDS + 2 * POOLED) / PORT_BW,
        (IDS + 2 * POOLED) / NVLINK_BW,  # rank 2: NVLink to the owner
        (2 * IDS + 4 * POOLED) / PORT_BW,  # the owner's port: both of host a's ranks
    ]
    lookup = B * 4 * LOOKUP_BYTES / HBM_BW
    assert cost.comm.tolist() == pytest.approx([x + 5 * LATENCY for x in own], rel=1e-12)
    assert cost.rank_time.tolist() == pytest.approx([x + 5 * LATENCY for x in (own[0], own[1], own[2], lookup + own[3])], rel=1e-12)
    assert cost.step_time == pytest.approx(lookup + (2 * IDS + 4 * POOLED) / NIC_BW + 5 * LATENCY, rel=1e-12)
    assert cost.step_time >= cost.rank_time.max()
