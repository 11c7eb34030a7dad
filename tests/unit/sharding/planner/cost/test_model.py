"""The rank-aware step-time model (sharding/planner/cost/model.py) on clusters small enough to work
by hand: two hosts of two GPUs with round bandwidths, one host of two sockets, the CPU/gloo pair.

Every expected figure below is the module docstring's formula written out for the shards at hand:
bytes over the bandwidth of the link that carries them."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torchrec.distributed.planner.types import Shard, ShardingOption
from torchrec.distributed.types import ParameterSharding, ShardingPlan

from sharding.planner.cost.model import TopologyCostModel, TopologyPerfModel
from sharding.topology.cluster import ClusterTopology
from sharding.topology.topology_file import load_topology
from tests.support.round_cluster import DDR_BW, GB, HBM_BW, NIC_BW, NVLINK_BW, PORT_BW, UPLINK_BW, host, shard, two_hosts, two_sockets

B = 1000  # batch per rank
LATENCY = 15e-6 + 10e-6  # one collective spanning hosts (network latency 0)
INDEX_BYTES = 8 + 20 + 4 * 24 + 16 + 2 * 32  # a CUDA TBE's id handling per lookup and shard


@pytest.fixture(scope="module")
def model() -> TopologyCostModel:
    return TopologyCostModel(two_hosts(), B)


def by_name(m: TopologyCostModel, load: np.ndarray) -> dict[str, float]:
    """The links a load vector is nonzero on, by name."""
    return {m.links.names[i]: float(v) for i, v in enumerate(load) if v}


def approx_links(expected: dict[str, float]):
    return pytest.approx(expected, rel=1e-12)


# --- bytes per lookup -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cols", "gpu", "cpu"), [(1, 32, 64), (4, 32, 64), (8, 32, 64), (9, 64, 64), (16, 64, 64), (17, 96, 128), (25, 128, 128)]
)
def test_a_row_moves_whole_32_byte_sectors_on_gpus_and_64_byte_lines_on_cpus(model, cols, gpu, cpu):
    assert model.row_bytes(cols) == gpu
    assert TopologyCostModel(load_topology("cpu-gloo"), B).row_bytes(cols) == cpu


def test_lookup_bytes_are_three_passes_over_the_row_plus_the_gpu_id_handling(model):
    cpu = TopologyCostModel(load_topology("cpu-gloo"), B)
    assert INDEX_BYTES == 204
    assert model.lookup_bytes(25) == 3 * 128 + 204
    assert cpu.lookup_bytes(25) == 3 * 128  # the CPU kernels' id handling is in the row passes
    assert model.row_share(25) == pytest.approx(384 / 588, rel=1e-15)
    assert cpu.row_share(25) == 1.0


def test_ssd_rows_and_input_ids_in_bytes(model):
    assert TopologyCostModel.ssd_row_bytes(64) == 64 * 4 + 4  # fp32 weights + row-wise Adagrad's float
    assert model.ids_bytes(2.5) == B * (2.5 * 8 + 4)  # int64 ids of 2.5 per bag, one int32 length per bag
    assert model.ids_bytes(0.0) == B * 4


# --- latency ----------------------------------------------------------------------------------


def test_a_collectives_latency_grows_with_hosts_and_the_networks_latency():
    assert TopologyCostModel(ClusterTopology((host("a"),)), B).collective_latency == pytest.approx(15e-6)
    assert TopologyCostModel(two_hosts(), B).collective_latency == pytest.approx(25e-6)
    assert TopologyCostModel(two_hosts(latency=5e-6), B).collective_latency == pytest.approx(30e-6)
    assert TopologyCostModel(load_topology("cpu-gloo"), B).collective_latency == pytest.approx(170e-6)  # gloo over loopback


@pytest.mark.parametrize(
    ("sharding_type", "collectives"), [("table_wise", 5), ("row_wise", 5), ("table_row_wise", 7), ("data_parallel", 1)]
)
def test_each_sharding_type_pays_its_collectives_latency(model, sharding_type, collectives):
    assert model.type_latency(sharding_type) == pytest.approx(collectives * LATENCY, rel=1e-12)


def test_table_row_wise_in_one_nvlink_domain_prices_as_row_wise_and_unknown_types_have_no_collectives(model):
    one = TopologyCostModel(ClusterTopology((host("a"),)), B)
    assert one.type_latency("table_row_wise") == one.type_latency("row_wise") == pytest.approx(5 * 15e-6)
    assert model.type_latency("grid_shard") == 0.0


# --- rings and groups -------------------------------------------------------------------------


def test_a_ring_inside_a_host_is_one_channel_and_across_hosts_one_channel_per_member_of_a_host(model):
    assert model.ring_channels((0, 1)) == [(0, 1)]
    # two members per host: two channels, the second entering each host at its second member
    assert model.ring_channels((0, 1, 2, 3)) == [(0, 1, 2, 3), (1, 0, 3, 2)]
    assert model.ring_channels((0, 2, 3)) == [(0, 2, 3)]  # host a holds one member: one channel


# the links of a transfer from host a's GPU i to host b's GPU j (per byte: 1 / bandwidth)
def _cross(i: int, j: int, src: str = "a#0", dst: str = "b#1") -> dict[str, float]:
    return {
        f"{src}/sw.port.gpu{i}>up": 1 / PORT_BW,
        f"{src}/sw.port.n0>down": 1 / PORT_BW,
        f"{src}/n0>out": 1 / NIC_BW,
        f"{dst}/n0>in": 1 / NIC_BW,
        f"{dst}/sw.port.n0>up": 1 / PORT_BW,
        f"{dst}/sw.port.gpu{j}>down": 1 / PORT_BW,
    }


def _sum(*loads: dict[str, float], scale: float = 1.0) -> dict[str, float]:
    out: dict[str, float] = {}
    for load in loads:
        for k, v in load.items():
            out[k] = out.get(k, 0.0) + v * scale
    return out


def test_a_ranks_ring_share_averages_its_channels_next_members(model):
    nvlink_0_to_1 = {"a#0/gpu0.nvlink>out": 1 / NVLINK_BW, "a#0/gpu1.nvlink>in": 1 / NVLINK_BW}
    # channel (0, 1, 2, 3): 0 sends to 1 over NVLink; channel (1, 0, 3, 2): 0 sends to 3 through the NICs
    assert by_name(model, model.ring_rank_inv((0, 1, 2, 3), 0)) == approx_links(_sum(nvlink_0_to_1, _cross(0, 1), scale=0.5))
    assert by_name(model, model.ring_rank_inv((0, 1), 0)) == approx_links(nvlink_0_to_1)


def test_a_whole_ring_loads_each_nic_with_one_member_of_each_channel(model):
    ring = by_name(model, model.ring_inv((0, 1, 2, 3)))
    # channel 1: 1 -> 2 and 3 -> 0 cross; channel 2: 0 -> 3 and 2 -> 1 cross; each channel half the bytes
    assert ring["a#0/n0>out"] == pytest.approx(2 * 0.5 / NIC_BW) and ring["b#1/n0>out"] == pytest.approx(2 * 0.5 / NIC_BW)
    assert ring["a#0/gpu0.nvlink>out"] == pytest.approx(0.5 / NVLINK_BW)  # 0 -> 1 in channel 1 only
    assert not model.ring_inv((2,)).any()  # a ring of one sends nothing


def test_off_group_loads_are_a_ranks_transfers_to_and_from_ranks_outside_its_group(model):
    out, inn = model.off_group_inv((0, 1), 0)  # the host: its peers off the group are 2 and 3
    assert by_name(model, out) == approx_links(_sum(_cross(0, 0), _cross(0, 1)))
    assert by_name(model, inn) == approx_links(_sum(_cross(0, 0, "b#1", "a#0"), _cross(1, 0, "b#1", "a#0")))
    # a group that is not an NVLink domain: rank 1 is off it too
    out_alone, _ = model.off_group_inv((0,), 0)
    assert by_name(model, out_alone) == approx_links(
        _sum(_cross(0, 0), _cross(0, 1), {"a#0/gpu0.nvlink>out": 1 / NVLINK_BW, "a#0/gpu1.nvlink>in": 1 / NVLINK_BW})
    )


def test_group_sums_and_candidate_rows_are_the_link_matrices_rows(model):
    L = model.links
    in_sum, out_off, in_off = model.group_sums((2, 3))
    assert np.array_equal(in_sum, L.in_inv[2] + L.in_inv[3]) and np.array_equal(out_off, L.out_off_inv[2] + L.out_off_inv[3])
    assert np.array_equal(in_off, L.in_off_inv[2] + L.in_off_inv[3])
    rows = model.link_rows(np.array([3, 0]))
    assert np.array_equal(rows["in"], L.in_inv[[3, 0]].T) and np.array_equal(rows["out"], L.out_inv[[3, 0]].T)
    assert np.array_equal(rows["in_max"], L.in_inv[[3, 0]].max(axis=0))
    with pytest.raises(ValueError, match="read-only"):
        rows["in"][0, 0] = 1.0


def test_a_ranks_attached_links_are_its_first_and_last_hops(model):
    names = sorted(model.links.names[i] for i in model.attached[0])
    assert names == ["a#0/gpu0.nvlink>in", "a#0/gpu0.nvlink>out", "a#0/sw.port.gpu0>down", "a#0/sw.port.gpu0>up"]


def test_the_lower_bounds_link_weightings_each_sum_to_one(model):
    # the first/last-hop weighting, then one per bandwidth class of the links paths cross (25, 50, 100 GB/s)
    assert model.bound_weights.shape == (model.links.count, 4)
    assert model.bound_weights.sum(axis=0) == pytest.approx([1.0, 1.0, 1.0, 1.0], rel=1e-12)


# --- host memory resources ----------------------------------------------------------------------


def test_host_traffic_crosses_the_gpus_port_its_switchs_uplink_and_the_numa_nodes_ddr(model):
    names = {i: n for n, i in model._res_index.items()}
    assert [names[i] for i in model.local_path[1]] == ["0/port1", "0/sw.uplink", "0/numa0"]
    assert [model.res_bw[i] for i in model.local_path[1]] == [PORT_BW, UPLINK_BW, DDR_BW]
    assert model.local_path[0][1:] == model.local_path[1][1:]  # one switch: one uplink, one DDR
    assert [names[i] for i in model.local_path[2]] == ["1/port0", "1/sw.uplink", "1/numa0"]


def test_memory_on_the_other_socket_adds_the_inter_socket_link():
    m = TopologyCostModel(two_sockets(), B)
    remote = m.remote_path(0, 1)
    names = {i: n for n, i in m._res_index.items()}
    assert [names[i] for i in remote] == ["0/port0", "0/sw0.uplink", "0/inter_socket", "0/numa1"]
    assert [m.res_bw[i] for i in remote] == [PORT_BW, UPLINK_BW, 10 * GB, DDR_BW]
    assert m.numa_cap == {(0, 0): 2**30, (0, 1): 2**30}


def test_cpu_ranks_host_traffic_is_their_numa_nodes_ddr_only():
    m = TopologyCostModel(load_topology("cpu-gloo"), B)
    assert m.local_path == [[0], [0]] and m.res_bw == [6 * GB]
    assert m.mem_bw.tolist() == [3 * GB, 3 * GB]  # each rank's share of the node's 6 GB/s


# --- whole plans --------------------------------------------------------------------------------


def test_an_empty_plan_costs_nothing(model):
    cost = model.score_shards([])
    assert (cost.step_time, cost.comm_time, cost.phases) == (0.0, 0.0, {})
    assert cost.rank_time.tolist() == [0.0] * 4


def test_one_table_wise_table_lookups_and_its_three_all_to_alls(model):
    cost = model.score_shards([shard(0)])
    lookup = B * 4 * 1.0 * (3 * 128 + 204) / HBM_BW  # every rank's batch, pooling 1, a 100-byte row in 4 sectors
    assert cost.lookup.tolist() == pytest.approx([lookup, 0, 0, 0], rel=1e-12)
    assert cost.hbm_bytes.tolist() == [1000 * 25 * 4 + 1000 * 4, 0, 0, 0]  # weights + row-wise state
    assert cost.host_bytes.tolist() == [0] * 4 and cost.host_io.tolist() == [0] * 4
    ids = B * (8 + 4)  # each rank's ids and lengths for the table
    pooled = B * 25 * 4  # the owner's pooled slice for each rank
    # the busiest link of each phase: host a's NIC, which carries ranks 2 and 3's share both ways
    assert cost.phases["table_wise:ids"][1] == pytest.approx(2 * ids / NIC_BW, rel=1e-12)
    assert cost.phases["table_wise:fwd"][1] == pytest.approx(2 * pooled / NIC_BW, rel=1e-12)
    assert cost.phases["table_wise:bwd"][1] == pytest.approx(2 * pooled / NIC_BW, rel=1e-12)
    assert cost.phases["table_wise:fwd"][0] in ("a#0/n0>out", "b#1/n0>in")
    assert cost.phases["table_wise:bwd"][0] in ("b#1/n0>out", "a#0/n0>in")
    comm = (2 * ids + 4 * pooled) / NIC_BW + 5 * LATENCY
    assert cost.comm_time == pytest.approx(comm, rel=1e-12)
    assert cost.step_time == pytest.approx(lookup + comm, rel=1e-12)
    # each rank's share: the busiest of its own first and last hops in each phase
    own = [
        (2 * ids + 4 * pooled) / PORT_BW,  # rank 0's PCIe port: ranks 2 and 3's bytes
        (ids + 2 * pooled) / NVLINK_BW,  # rank 1: NVLink
        (ids + 2 * pooled) / PORT_BW,  # ranks 2, 3: their own PCIe port
        (ids + 2 * pooled) / PORT_BW,
    ]
    assert cost.comm.tolist() == pytest.approx([x + 5 * LATENCY for x in own], rel=1e-12)
    assert cost.rank_time.tolist() == pytest.approx([lookup + own[0] + 5 * LATENCY] + [x + 5 * LATENCY for x in own[1:]], rel=1e-12)
    assert cost.bottleneck_rank == 0


def test_a_table_cut_into_column_shards_pays_the_id_handling_and_the_ids_per_shard(model):
    whole = model.score_shards([shard(0, cols=16)])
    halves = model.score_shards([shard(0, cols=8, st="column_wise"), shard(0, cols=8, st="column_wise")])
    # a 16-column row is 2 sectors, an 8-column one 1: the rows' passes cost the same, the ids twice
    assert whole.lookup[0] == pytest.approx(B * 4 * (3 * 64 + 204) / HBM_BW, rel=1e-12)
    assert halves.lookup[0] == pytest.approx(2 * B * 4 * (3 * 32 + 204) / HBM_BW, rel=1e-12)
    assert halves.phases["column_wise:ids"][1] == pytest.approx(2 * whole.phases["table_wise:ids"][1], rel=1e-12)
    assert halves.phases["column_wise:fwd"][1] == pytest.approx(whole.phases["table_wise:fwd"][1], rel=1e-12)


def test_a_row_wise_table_over_every_rank_reduce_scatters_over_both_nics(model):
    shards = [shard(r, rows=250, st="row_wise", group=(0, 1, 2, 3)) for r in range(4)]
    cost = model.score_shards(shards)
    assert cost.lookup.tolist() == pytest.approx([B * 4 * 588 * 0.25 / HBM_BW] * 4, rel=1e-12)  # a quarter of the ids each
    pooled = B * 4 * 25 * 4  # the partial sums of every rank's batch
    # each member sends 3/4 of them to the next; each NIC is the crossing of one member per channel
    assert cost.phases["row_wise:fwd"][1] == pytest.approx(0.75 * pooled / NIC_BW, rel=1e-12)
    assert cost.phases["row_wise:bwd"][1] == pytest.approx(0.75 * pooled / NIC_BW, rel=1e-12)
    ids = (B * 8) * 0.25 + B * 4  # a quarter of a rank's ids and all its lengths, to each shard
    assert cost.phases["row_wise:ids"][1] == pytest.approx(4 * ids / NIC_BW, rel=1e-12)  # ranks 2, 3 -> shards 0, 1
    assert cost.comm_time == pytest.approx((1.5 * pooled + 4 * ids) / NIC_BW + 5 * LATENCY, rel=1e-12)
    assert cost.hbm_bytes.tolist() == [250 * 25 * 4 + 250 * 4] * 4


def test_a_data_parallel_table_all_reduces_its_gradient(model):
    shards = [shard(r, st="data_parallel", group=(0, 1, 2, 3)) for r in range(4)]
    cost = model.score_shards(shards)
    assert cost.lookup.tolist() == pytest.approx([B * 588 / HBM_BW] * 4, rel=1e-12)  # each replica its own batch
    table = 1000 * 25 * 4
    assert list(cost.phases) == ["data_parallel:allreduce"]
    link, seconds = cost.phases["data_parallel:allreduce"]
    assert seconds == pytest.approx(1.5 * table / NIC_BW, rel=1e-12)  # each NIC: one member of each channel, 2 (n-1)/n each
    assert link in ("a#0/n0>out", "a#0/n0>in", "b#1/n0>out", "b#1/n0>in")
    assert cost.comm_time == pytest.approx(1.5 * table / NIC_BW + LATENCY, rel=1e-12)
    assert cost.hbm_bytes.tolist() == [table + 1000 * 4] * 4


def test_a_replica_on_one_rank_has_no_all_reduce(model):
    cost = model.score_shards([shard(2, st="data_parallel", group=(2,))])
    assert cost.phases == {} and cost.comm_time == pytest.approx(LATENCY)


def test_a_table_row_wise_table_on_one_host_rings_inside_it_and_sends_slices_off_it(model):
    shards = [shard(r, rows=500, st="table_row_wise", group=(0, 1)) for r in (0, 1)]
    cost = model.score_shards(shards)
    p = cost.phases
    ids = B * 12 / 2  # each rank's ids and lengths, bucketized over the host's 2 ranks
    assert p["table_row_wise:ids"][1] == pytest.approx(4 * ids / NIC_BW, rel=1e-12)  # ranks 2, 3 -> ranks 0, 1
    ring = 0.5 * B * 4 * 25 * 4  # half of every rank's partial sums to the other member, over NVLink
    assert p["table_row_wise:fwd_rs"][1] == pytest.approx(ring / NVLINK_BW, rel=1e-12)
    assert p["table_row_wise:bwd_ag"][1] == pytest.approx(ring / NVLINK_BW, rel=1e-12)
    part = B * 25 * 4 / 2  # each member's half of a rank's output, to ranks 2 and 3
    assert p["table_row_wise:fwd_a2a"][1] == pytest.approx(4 * part / NIC_BW, rel=1e-12)
    assert p["table_row_wise:bwd_a2a"][1] == pytest.approx(4 * part / NIC_BW, rel=1e-12)
    assert cost.comm_time == pytest.approx((4 * ids + 8 * part) / NIC_BW + 2 * ring / NVLINK_BW + 7 * LATENCY, rel=1e-12)


def test_two_sharding_types_each_pay_their_collectives_latency(model):
    cost = model.score_shards([shard(0, table="a"), shard(1, table="b", st="data_parallel", group=(1,))])
    assert cost.comm_time == pytest.approx(sum(p[1] for p in cost.phases.values()) + 6 * LATENCY, rel=1e-12)


def test_a_fused_uvm_table_reads_its_rows_over_the_switch_uplink(model):
    cost = model.score_shards([shard(0, kernel="fused_uvm")])
    rows = B * 4 * 3 * 128  # the rows' passes go to host memory
    assert cost.host_io[0] == pytest.approx(rows / UPLINK_BW, rel=1e-12)  # port 50, uplink 25, DDR 100 GB/s: the uplink
    assert cost.lookup[0] == pytest.approx(B * 4 * 204 / HBM_BW, rel=1e-12)  # the id handling stays in HBM
    assert cost.hbm_bytes[0] == 0 and cost.host_bytes[0] == 1000 * 25 * 4 + 1000 * 4
    assert cost.step_time == pytest.approx(cost.lookup[0] + cost.host_io[0] + cost.comm_time, rel=1e-12)


def test_two_uvm_tables_below_one_switch_share_its_uplink_and_tables_on_two_hosts_do_not(model):
    alone = B * 4 * 3 * 128 / UPLINK_BW
    same = model.score_shards([shard(0, kernel="fused_uvm", table="a"), shard(1, kernel="fused_uvm", table="b")])
    assert same.host_io.tolist() == pytest.approx([2 * alone, 2 * alone, 0, 0], rel=1e-12)
    apart = model.score_shards([shard(0, kernel="fused_uvm", table="a"), shard(2, kernel="fused_uvm", table="b")])
    assert apart.host_io.tolist() == pytest.approx([alone, 0, alone, 0], rel=1e-12)


def test_a_uvm_cache_sends_its_misses_to_host_memory(model):
    cost = model.score_shards([shard(0, kernel="fused_uvm_caching", load_factor=0.25)])
    assert cost.host_io[0] == pytest.approx(0.75 * B * 4 * 3 * 128 / UPLINK_BW, rel=1e-12)
    assert cost.lookup[0] == pytest.approx(B * 4 * (0.25 * 3 * 128 + 204) / HBM_BW, rel=1e-12)
    assert cost.hbm_bytes[0] == pytest.approx(0.25 * 1000 * 25 * 4) and cost.host_bytes[0] == 1000 * 25 * 4 + 1000 * 4
    measured = model.score_shards([shard(0, kernel="fused_uvm_caching", load_factor=0.25, miss_rate=0.1)])
    assert measured.host_io[0] == pytest.approx(0.1 * B * 4 * 3 * 128 / UPLINK_BW, rel=1e-12)


def test_cpu_ranks_look_up_in_ddr_and_exchange_through_it():
    m = TopologyCostModel(load_topology("cpu-gloo"), B)
    cost = m.score_shards([shard(1, rows=100, cols=16, table_rows=100, pooling=2.0)])
    lookup = B * 2 * 2.0 * 3 * 64 / (3 * GB)  # both ranks' batch, pooling 2, one 64-byte line a row
    assert cost.lookup.tolist() == pytest.approx([0.0, lookup], rel=1e-12)
    assert cost.host_bytes.tolist() == [0, 100 * 16 * 4 + 100 * 4] and cost.hbm_bytes.tolist() == [0, 0]
    ids, pooled = B * (2.0 * 8 + 4), B * 16 * 4  # rank 0's ids for rank 1; rank 1's slice for rank 0 and its gradient
    assert cost.comm_time == pytest.approx((ids + 2 * pooled) / (6 * GB) + 5 * 170e-6, rel=1e-12)
    assert cost.step_time == pytest.approx(lookup + cost.comm_time, rel=1e-12)


# --- torchrec's inputs ----------------------------------------------------------------------------


def _option(ranks: list[int], sharding_type: str = "row_wise") -> ShardingOption:
    return ShardingOption(
        name="t",
        tensor=torch.empty(1000, 25, device="meta"),
        module=("ebc", torch.nn.Module()),
        input_lengths=[1.0],
        batch_size=B,
        sharding_type=sharding_type,
        partition_by="uniform",
        compute_kernel="fused",
        shards=[Shard(size=[1000 // len(ranks), 25], offset=[0, 0], rank=r) for r in ranks],
    )


def test_sharding_options_and_a_sharding_plan_are_scored_as_their_shards(model):
    # the row-wise table over every rank of test_a_row_wise_table_over_every_rank_reduce_scatters_over_both_nics
    ids, pooled = B * 8 * 0.25 + B * 4, B * 4 * 25 * 4
    row_wise = B * 4 * 588 * 0.25 / HBM_BW + (4 * ids + 1.5 * pooled) / NIC_BW + 5 * LATENCY
    assert model.score([_option([0, 1, 2, 3])]).step_time == pytest.approx(row_wise, rel=1e-12)
    assert TopologyPerfModel(model).rate([_option([0, 1, 2, 3])]) == pytest.approx(row_wise * 1e3, rel=1e-12)  # milliseconds
    # a data-parallel entry of a plan file: a replica on each of its ranks, all-reducing its gradient
    plan = ShardingPlan({"ebc": {"t": ParameterSharding("data_parallel", "fused", [0, 1, 2, 3])}})
    data_parallel = B * 588 / HBM_BW + 1.5 * 1000 * 25 * 4 / NIC_BW + LATENCY
    scored = model.score_sharding_plan(plan, {"t": {"num_embeddings": 1000, "embedding_dim": 25}})
    assert scored.step_time == pytest.approx(data_parallel, rel=1e-12)


def test_placed_shards_are_memoized_until_the_option_is_placed_elsewhere(model):
    so = _option([0, 1])
    first = model.placed(so)
    assert model.placed(so) is first
    so.shards[1].rank = 3
    moved = model.placed(so)
    assert [p.rank for p in moved] == [0, 3] and [p.group for p in moved] == [(0, 3), (0, 3)]
