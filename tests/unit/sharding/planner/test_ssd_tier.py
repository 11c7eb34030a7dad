"""The SSD tier: the topology format's ``ssd:`` key, torchrec's ``ssd_cap`` / ``ssd_mem_bw``, the
planner's key_value (FBGEMM SSD kernel) options, SSD capacity per host, the cost model's SSD
time, reports and validation (sharding/planner/ssd_tier.py, docs/topology.md "SSD tier").

FBGEMM's SSD kernels run on CUDA only: these plans are made, checked and reported here, not trained.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import PlacedShard
from sharding.topology.cluster import GB, SsdSpec, TopologyError
from sharding.topology.topology_dump import dump_topology, topology_to_dict
from sharding.topology.topology_file import load_topology
from sharding.planner.job_topology import torchrec_topology
from sharding.planner.topology_planner import ModelDoesNotFitError, TopologyAwarePlanner
from sharding.planner.cost.candidates import candidate_step_times

logging.disable(logging.WARNING)
GIB = 1024**3

# dgx-a100-ssd: 8 x 80 GB HBM + 2 TB DDR = 2,688 GB; t_big is 6e9 x 128 fp32 = 2,861 GiB of
# weights (+ 22 GiB of row-wise Adagrad state): it fits neither, not even with UVM caching
BIG_ROWS, BIG_DIM = 6_000_000_000, 128
SPECS = [(BIG_ROWS, BIG_DIM), (1_000_000, 64), (20_000, 16)]
SSD_BYTES_BIG = BIG_ROWS * BIG_DIM * 4 + BIG_ROWS * 4  # weights + row-wise Adagrad's float per row


def write(tmp_path: Path, text: str, name: str = "t.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


HOST = """
name: t
hosts:
  - name: box
    gpus: {count: 2, hbm_gb: 80, hbm_bw_gb_s: 2000}
    pcie: {port_gb_s: 25, switches: [{name: sw0, numa: 0, uplink_gb_s: 25, gpus: [0, 1]}]}
    numa_nodes: [{ddr_gb: 512, ddr_bw_gb_s: 200}]
"""


# -- the file format --------------------------------------------------------------------------


def test_shipped_dgx_a100_ssd_loads_and_round_trips(tmp_path):
    t = load_topology("dgx-a100-ssd")
    plain = load_topology("dgx-a100")
    assert t.world_size == 8 and len(t.hosts) == 1
    assert t.hosts[0].ssd == SsdSpec(capacity=28610 * GB, read_bw=25e9, write_bw=12e9)
    assert t.hosts[0].ssd_bytes == 28610 * 2**30 and plain.hosts[0].ssd is None and plain.hosts[0].ssd_bytes == 0
    # everything else is dgx-a100's host
    assert dataclasses.replace(t.hosts[0], ssd=None) == plain.hosts[0]
    assert "28610 GB SSD per host (read 25 GB/s, write 12 GB/s)" in t.summary()
    assert "SSD" not in plain.summary()
    assert topology_to_dict(t)["hosts"][0]["ssd"] == {"capacity_gb": 28610, "read_gb_s": 25, "write_gb_s": 12}
    assert "ssd" not in topology_to_dict(plain)["hosts"][0]
    again = load_topology(write(tmp_path, dump_topology(t), "again.yaml"))
    assert again.hosts[0].ssd == t.hosts[0].ssd


def test_inline_ssd_key_and_from_with_ssd(tmp_path):
    inline = load_topology(write(tmp_path, HOST + "    ssd: {capacity_gb: 1024.5, read_gb_s: 6.8, write_gb_s: 4}\n"))
    assert inline.hosts[0].ssd == SsdSpec(round(1024.5 * 2**30), 6.8e9, 4e9)
    write(tmp_path, HOST, "base.yaml")
    one = load_topology(
        write(tmp_path, "hosts:\n  - {from: base.yaml, ssd: {capacity_gb: 100, read_gb_s: 10, write_gb_s: 5}}\n", "one.yaml")
    )
    assert one.hosts[0].ssd == SsdSpec(100 * 2**30, 10e9, 5e9)
    assert load_topology(write(tmp_path, "hosts:\n  - {from: base.yaml}\n", "none.yaml")).hosts[0].ssd is None


@pytest.mark.parametrize(
    "ssd, message",
    [
        (
            "{capacity_gb: abc, read_gb_s: 25, write_gb_s: 12}",
            "t.yaml: key 'hosts[0].ssd.capacity_gb': expected a positive number, got 'abc'",
        ),
        ("{capacity_gb: 100, read_gb_s: 0, write_gb_s: 12}", "t.yaml: key 'hosts[0].ssd.read_gb_s': expected a positive number, got 0"),
        ("{capacity_gb: 100, read_gb_s: 25, write_gb_s: -1}", "t.yaml: key 'hosts[0].ssd.write_gb_s': expected a positive number, got -1"),
        ("{capacity_gb: 100, read_gb_s: 25}", "t.yaml: key 'hosts[0].ssd.write_gb_s': missing required key"),
        (
            "{capacity_gb: 100, read_gbs: 25, write_gb_s: 12}",
            "t.yaml: key 'hosts[0].ssd.read_gbs': unknown key (did you mean 'hosts[0].ssd.read_gb_s'?)",
        ),
        ("28000", "t.yaml: key 'hosts[0].ssd': expected a mapping, got 28000"),
    ],
)
def test_bad_ssd_values_are_one_line_naming_the_key(tmp_path, ssd, message):
    with pytest.raises(TopologyError) as e:
        load_topology(write(tmp_path, HOST + f"    ssd: {ssd}\n"))
    assert str(e.value) == message


def test_bad_ssd_in_a_from_entry_names_its_key(tmp_path):
    write(tmp_path, HOST, "base.yaml")
    with pytest.raises(TopologyError) as e:
        load_topology(write(tmp_path, "hosts:\n  - {from: base.yaml, ssd: {capacity_gb: 1, read_gb_s: x, write_gb_s: 1}}\n"))
    assert str(e.value) == "t.yaml: key 'hosts[0].ssd.read_gb_s': expected a positive number, got 'x'"


# -- torchrec's Topology ----------------------------------------------------------------------


def test_torchrec_topology_gets_ssd_cap_and_bandwidth_per_rank():
    t = torchrec_topology(load_topology("dgx-a100-ssd"))
    assert [d.storage.ssd for d in t.devices] == [28610 * 2**30 // 8] * 8  # the host's SSD over its 8 ranks
    assert t.ssd_mem_bw == pytest.approx(25e9 / 8 / 1e3)  # read bandwidth per rank, bytes/ms as ddr_mem_bw
    assert t.ddr_mem_bw == pytest.approx(204.8e9 / 1e3)  # (the same unit)
    plain = torchrec_topology(load_topology("dgx-a100"))
    assert [d.storage.ssd for d in plain.devices] == [0] * 8  # not torchrec's 2 TB default: there is none


def test_ssd_cap_is_the_smallest_hosts_share():
    two = load_topology("dgx-a100-2host")
    small, big = SsdSpec(800 * GB, 8e9, 4e9), SsdSpec(1600 * GB, 16e9, 8e9)
    hosts = (dataclasses.replace(two.hosts[0], ssd=big), dataclasses.replace(two.hosts[1], ssd=small))
    t = torchrec_topology(dataclasses.replace(two, hosts=hosts))
    assert {d.storage.ssd for d in t.devices} == {800 * GB // 8}
    assert t.ssd_mem_bw == pytest.approx(8e9 / 8 / 1e3)
    one_without = (hosts[0], two.hosts[1])  # a host without an SSD tier: no key_value anywhere
    assert {d.storage.ssd for d in torchrec_topology(dataclasses.replace(two, hosts=one_without)).devices} == {0}


# -- which tables are offered key_value ---------------------------------------------------------


def test_key_value_tables_only_where_hbm_and_host_memory_cannot_hold_them():
    from sharding.planner.ssd_tier import key_value_tables

    t = torchrec_topology(load_topology("dgx-a100-ssd"))
    usable = 0.85 * (640 + 2048) * GIB  # after torchrec's 15% reserve
    assert key_value_tables({"a": 10 * GIB, "b": 100 * GIB}, t) == []
    # the model exceeds HBM + host memory: the largest tables, largest first, until the rest fit
    sizes = {"a": int(usable * 0.5), "b": int(usable * 0.4), "c": int(usable * 0.3), "d": GIB}
    assert key_value_tables(sizes, t) == ["a"]
    sizes["e"] = int(usable * 0.45)
    assert key_value_tables(sizes, t) == ["a", "e"]
    # one table larger than all host memory (UVM's most) though the model fits HBM + host memory
    assert key_value_tables({"huge": int(0.86 * 2048 * GIB), "x": GIB}, t) == ["huge"]
    # no SSD tier, or CPU ranks: never
    assert key_value_tables(sizes, torchrec_topology(load_topology("dgx-a100"))) == []
    assert key_value_tables(sizes, torchrec_topology(load_topology("cpu-gloo"))) == []


# -- planning ---------------------------------------------------------------------------------


def model(specs=SPECS) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f_{i}"]) for i, (n, d) in enumerate(specs)
        ],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01})
    return ebc


def plan_on(topo, specs=SPECS):
    planner = TopologyAwarePlanner(topo, 512)
    ebc = model(specs)
    return planner, ebc, planner.plan(ebc, [EmbeddingBagCollectionSharder()])


def with_ssd_capacity(capacity: int):
    t = load_topology("dgx-a100-ssd")
    return dataclasses.replace(t, hosts=(dataclasses.replace(t.hosts[0], ssd=dataclasses.replace(t.hosts[0].ssd, capacity=capacity)),))


@pytest.fixture(scope="module")
def ssd_plan():
    return plan_on(load_topology("dgx-a100-ssd"))


def test_table_too_large_for_hbm_and_host_memory_goes_to_ssd(ssd_plan):
    from sharding.optimizer_state import state_bytes

    planner, _, plan = ssd_plan
    opts = {so.name: so for so in planner.best_plan}
    big = opts["t_0"]
    assert big.compute_kernel == "key_value"
    assert {so.compute_kernel for n, so in opts.items() if n != "t_0"} == {"fused"}  # the rest stay in HBM
    # its SSD storage: weights + the optimizer state as sharding/optimizer_state.py counts it
    assert state_bytes("rowwise_adagrad", BIG_ROWS, BIG_DIM) == BIG_ROWS * 4
    assert sum(sh.storage.ssd for sh in big.shards) == BIG_ROWS * BIG_DIM * 4 + BIG_ROWS * 4 == SSD_BYTES_BIG
    assert all(sh.storage.ddr == 0 for sh in big.shards)
    # the HBM cache: load factor x the shard's weights, on top of torchrec's buffers, within HBM
    lf = big.cache_params.load_factor
    assert 0 < lf < 0.05
    for sh in big.shards:
        assert sh.storage.hbm >= lf * sh.size[0] * sh.size[1] * 4
    hbm = np.zeros(8)
    for so in planner.best_plan:
        for sh in so.shards:
            hbm[sh.rank] += sh.storage.hbm
    assert (hbm <= 80 * GIB).all()
    # the plan's modelled step has SSD time on the ranks holding it, none elsewhere
    cost = planner.last_cost
    owners = {sh.rank for sh in big.shards}
    assert all(cost.ssd_io[r] > 0 for r in owners) and all(cost.ssd_io[r] == 0 for r in set(range(8)) - owners)
    assert cost.step_time >= cost.ssd_io.max()


def test_lower_bound_stays_below_a_key_value_plan(ssd_plan):
    from sharding.planner.bounds import step_time_lower_bound

    planner, _, _ = ssd_plan
    bound = step_time_lower_bound(planner.cost_model, planner.search_space)
    assert 0 < bound <= planner.last_cost.step_time


def test_without_the_ssd_tier_the_same_model_does_not_fit():
    planner = TopologyAwarePlanner("dgx-a100", 512)
    assert "key_value" not in planner.constraints_for(model())["t_0"].compute_kernels
    with pytest.raises(ModelDoesNotFitError) as e:
        planner.plan(model(), [EmbeddingBagCollectionSharder()])
    msg = str(e.value)
    assert "\n" not in msg and "t_0" in msg and "SSD" not in msg


def test_ssd_capacity_is_counted_per_host():
    """With the host's SSD just above the table's SSD bytes it plans; 8 MiB below, the planner
    raises the fit error naming the SSD tier. The table-wise shard needs 8x one rank's share of
    the host's SSD: like DDR, SSD is a per-host budget (torchrec's own partitioner, which checks
    per rank, could not place it)."""
    need = SSD_BYTES_BIG
    planner, _, plan = plan_on(with_ssd_capacity(need + 8 * 2**20))
    assert {so.name: so.compute_kernel for so in planner.best_plan}["t_0"] == "key_value"
    with pytest.raises(ModelDoesNotFitError) as e:
        plan_on(with_ssd_capacity(need - 8 * 2**20))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{(need - 8 * 2**20) / GIB:,.2f} GiB SSD per host" in msg and "more SSD per host" in msg


def test_nothing_fits_even_with_ssd_mentions_ssd_capacity():
    huge = [(4 * BIG_ROWS, BIG_DIM), (BIG_ROWS, BIG_DIM)] * 6  # ~43 TiB
    with pytest.raises(ModelDoesNotFitError) as e:
        plan_on(load_topology("dgx-a100-ssd"), huge)
    msg = str(e.value)
    assert "28,610.00 GiB SSD per host (28,610.00 GiB in all)" in msg and "hosts like these" in msg


def test_plans_that_fit_without_ssd_are_unchanged():
    small = [(1_000_000, 64), (500_000, 64), (200_000, 32), (10_000, 16)]
    a = plan_on(load_topology("dgx-a100"), small)
    b = plan_on(load_topology("dgx-a100-ssd"), small)
    assert all("key_value" not in c.compute_kernels for c in b[0].constraints.values())
    assert str(a[2]) == str(b[2])
    assert a[0].last_cost.step_time == b[0].last_cost.step_time


# -- the cost model -----------------------------------------------------------------------------


def kv(rank, rows, cols, table_rows, lf=0.25, miss=None, kernel="key_value", st="row_wise"):
    return PlacedShard("t", st, kernel, rank, rows, cols, table_rows, cols, 2.0, lf, (), miss)


def test_ssd_time_is_misses_times_row_bytes_over_read_plus_write_bandwidth():
    topo = load_topology("dgx-a100-ssd")
    B = 512
    m = TopologyCostModel(topo, B)
    rows, cols, table_rows, lf = 1_000_000, 64, 4_000_000, 0.25
    cost = m.score_shards([kv(3, rows, cols, table_rows, lf)])
    lookups = B * 8 * 2.0 * rows / table_rows  # every rank's batch x pooling 2, this shard's share of the rows
    misses = (1 - lf) * lookups
    row_bytes = cols * 4 + 4  # fp32 weights + row-wise Adagrad's float
    expected = misses * row_bytes / 25e9 + misses * row_bytes / 12e9
    assert cost.ssd_io[3] == pytest.approx(expected, rel=1e-12)
    assert cost.ssd_io[[0, 1, 2, 4, 5, 6, 7]].sum() == 0
    assert cost.ssd_bytes[3] == rows * cols * 4 + rows * 4 and cost.host_bytes.sum() == 0
    assert cost.hbm_bytes[3] == pytest.approx(lf * rows * cols * 4)
    # the hits are lookups in HBM: the fused shard's row traffic x the hit rate, plus the id
    # handling (sort, row-wise state) of every lookup, which stays in HBM
    from sharding.planner.cost.model import GPU_INDEX_BYTES_PER_LOOKUP

    fused = m.score_shards([kv(3, rows, cols, table_rows, kernel="fused")])
    row_part = 3 * cols * 4  # three passes over a 256-byte row (8 whole sectors)
    assert cost.lookup[3] == pytest.approx(
        fused.lookup[3] * (lf * row_part + GPU_INDEX_BYTES_PER_LOOKUP) / (row_part + GPU_INDEX_BYTES_PER_LOOKUP), rel=1e-12
    )
    assert cost.rank_time[3] == pytest.approx(cost.lookup[3] + expected + cost.comm[3], rel=1e-12)
    assert cost.step_time == pytest.approx(cost.lookup[3] + expected + cost.comm_time, rel=1e-12)
    # a measured miss rate (cache statistics) replaces 1 - load_factor
    measured = m.score_shards([kv(3, rows, cols, table_rows, lf, miss=0.1)])
    assert measured.ssd_io[3] == pytest.approx(expected * 0.1 / (1 - lf), rel=1e-12)
    # the host's drives serve all its ranks: two shards' traffic adds up, both ranks wait for it
    both = m.score_shards([kv(3, rows, cols, table_rows, lf), kv(5, rows, cols, table_rows, lf)])
    assert both.ssd_io[3] == both.ssd_io[5] == pytest.approx(2 * expected, rel=1e-12)
    # the greedy placement's incremental state agrees with the whole-plan score
    st = m.new_state()
    st.add(kv(3, rows, cols, table_rows, lf))
    assert st.cost().ssd_io[3] == pytest.approx(expected, rel=1e-12)
    assert candidate_step_times(st, kv(0, rows, cols, table_rows, lf), [5])[0] == pytest.approx(both.step_time, rel=1e-9)


def test_key_value_on_a_host_without_ssd_costs_infinite_time():
    m = TopologyCostModel(load_topology("dgx-a100"), 512)
    assert np.isinf(m.score_shards([kv(0, 1000, 16, 1000, st="table_wise")]).step_time)


# -- plan files, reports, validation -----------------------------------------------------------


@pytest.fixture(scope="module")
def ssd_plan_file(ssd_plan, tmp_path_factory):
    import sharding.plan.io as plan_io

    _, ebc, plan = ssd_plan
    path = plan_io.save_plan(
        plan, tmp_path_factory.mktemp("ssd") / "plan.json", ebc, world_size=8, compute_device="cuda", meta={"batch_size_per_rank": 512}
    )
    return plan, path


def test_key_value_plan_file_round_trips(ssd_plan_file):
    import sharding.plan.io as plan_io

    plan, path = ssd_plan_file
    back = plan_io.load_plan(path)
    assert str(back) == str(plan)
    ps = next(m["t_0"] for m in back.plan.values() if "t_0" in m)
    assert (
        ps.compute_kernel == "key_value"
        and ps.cache_params.load_factor == next(m["t_0"] for m in plan.plan.values() if "t_0" in m).cache_params.load_factor
    )


def test_show_reports_ssd_bytes_per_rank(ssd_plan_file):
    import sharding.plan.io as plan_io
    import sharding.plan.report as plan_report
    import sharding.planner.cost.traffic as plan_traffic
    from sharding.planner.cost.plan_cost import format_step, modeled_step, plan_tables

    plan, path = ssd_plan_file
    _, header = plan_io.read_plan_file(path)
    rep = plan_report.report(plan, header)
    big = next(t for t in rep["tables"] if t["table"] == "t_0")
    assert big["ssd_bytes"] == SSD_BYTES_BIG and big["host_bytes"] == 0
    ssd_ranks = {r["rank"]: r["ssd_bytes"] for r in rep["ranks"] if r["ssd_bytes"]}
    assert sum(ssd_ranks.values()) == SSD_BYTES_BIG
    text = plan_report.format_text(rep)
    assert " SSD" in text.splitlines()[2] and "largest SSD: rank" in text
    topo = load_topology("dgx-a100-ssd")
    infos = plan_report.table_infos(plan, header)
    tr = plan_traffic.apply_topology(plan_traffic.traffic(infos, 8, 512), topo, infos, rep["ranks"])
    assert tr.hosts[0]["ssd_bytes"] == SSD_BYTES_BIG and tr.hosts[0]["ssd_capacity"] == 28610 * GB
    assert f"SSD {SSD_BYTES_BIG / GIB:,.2f} / 28,610 GB" in plan_traffic.format_text(tr)
    cost = modeled_step(plan, plan_tables(header), topo, 512)
    assert "ssd io ms" in format_step(cost, "dgx-a100-ssd", 512)


def test_reports_of_plans_without_ssd_have_no_ssd_column(tmp_path):
    import sharding.plan.io as plan_io
    import sharding.plan.report as plan_report

    planner, ebc, plan = plan_on(load_topology("dgx-a100"), [(10_000, 16), (2_000, 16)])
    _, header = plan_io.read_plan_file(plan_io.save_plan(plan, tmp_path / "p.json", ebc))
    assert "SSD" not in plan_report.format_text(plan_report.report(plan, header))
    assert "ssd_io_ms" not in planner.last_cost.as_dict()


def test_key_value_plan_for_cpu_is_one_line_error(ssd_plan_file):
    import sharding.plan.io as plan_io
    from sharding.plan.validation import plan_problems

    plan, path = ssd_plan_file
    _, header = plan_io.read_plan_file(path)
    assert plan_problems(plan, header, "plan.json") == []  # valid for cuda
    problems = plan_problems(plan, dict(header, compute_device="cpu"), "plan.json")
    kv_key = next(f"modules.{p}.t_0" for p, m in plan.plan.items() if "t_0" in m)
    assert (
        f"plan.json: key '{kv_key}.compute_kernel': 'key_value' keeps the table on SSD with FBGEMM's SSD kernels, "
        "which run on CUDA only; this plan is for cpu (use fused there, or plan for a cuda topology with an SSD tier)" in problems
    )


# ---- one count of a table's bytes: weights plus the state of the optimizer it trains with ----
def _tagged_ebc(specs: dict[str, tuple[int, int, str]]):
    """EBC on meta: name -> (rows, dim, optimizer: cowclip | rowwise | none | fp16)."""
    from torchrec.modules.embedding_configs import DataType

    from recsys import tag_cowclip_adam

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=n,
                embedding_dim=d,
                num_embeddings=r,
                feature_names=[f"f_{n}"],
                data_type=DataType.FP16 if opt == "fp16" else DataType.FP32,
            )
            for n, (r, d, opt) in specs.items()
        ],
        device=torch.device("meta"),
    )
    for n, (_, _, opt) in specs.items():
        w = ebc.embedding_bags[n].weight
        if opt == "cowclip":
            tag_cowclip_adam([w], lr=1e-3)
        elif opt == "rowwise":
            apply_optimizer_in_backward(RowWiseAdagrad, [w], {"lr": 0.01})
    return ebc


def test_table_bytes_counts_each_tables_own_optimizer_state():
    """CowClip-Adam keeps two fp32 moments and an int64 step per row (~3x the weights); row-wise
    Adagrad one float per row; plain SGD nothing; FP16 weights take 2 bytes. Untagged tables take
    the fused_params of the sharder of their module."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from sharding.optimizer_state import table_bytes

    R, D = 1000, 16
    ebc = _tagged_ebc({"cow": (R, D, "cowclip"), "ada": (R, D, "rowwise"), "plain": (R, D, "none"), "fp16_t": (R, D, "fp16")})
    got = table_bytes(ebc)
    assert got == {"cow": R * D * 4 + R * D * 8 + R * 8, "ada": R * D * 4 + R * 4, "plain": R * D * 4, "fp16_t": R * D * 2}
    with_fp = table_bytes(ebc, [EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})])
    assert with_fp["plain"] == R * D * 4 + R * 4 and with_fp["fp16_t"] == R * D * 2 + R * 4
    assert with_fp["cow"] == got["cow"]  # the table's own tag wins over the sharder's


def test_ssd_tier_is_offered_to_a_cowclip_table_whose_state_does_not_fit():
    """A table whose weights take 40% of the cluster's usable HBM + host memory: with row-wise
    Adagrad it fits (no key_value offered); with CowClip-Adam its state makes it ~1.2x of what the
    cluster holds, so the SSD tier is offered to it. (Counting fp32 weights + 4 B/row for every
    optimizer, as the planner once did, offered it to neither.)"""
    from sharding.planner.ssd_tier import TORCHREC_RESERVE

    topo = torchrec_topology(load_topology("dgx-a100-ssd"))
    usable = (1 - TORCHREC_RESERVE) * sum(d.storage.hbm + d.storage.ddr for d in topo.devices)
    dim = 128
    rows = int(0.4 * usable / (dim * 4))
    planner = TopologyAwarePlanner("dgx-a100-ssd", 512)
    ada = planner.constraints_for(_tagged_ebc({"big": (rows, dim, "rowwise"), "small": (1000, 16, "rowwise")}))
    cow = planner.constraints_for(_tagged_ebc({"big": (rows, dim, "cowclip"), "small": (1000, 16, "rowwise")}))
    assert "key_value" not in ada["big"].compute_kernels
    assert "key_value" in cow["big"].compute_kernels and "key_value" not in cow["small"].compute_kernels


# -- the storage of a key_value shard ---------------------------------------------------------


def test_ssd_tier_needs_cuda_ranks_each_with_ssd_capacity():
    from sharding.planner.ssd_tier import has_ssd_tier

    assert has_ssd_tier(torchrec_topology(load_topology("dgx-a100-ssd")))
    assert not has_ssd_tier(torchrec_topology(load_topology("dgx-a100")))
    assert not has_ssd_tier(torchrec_topology(load_topology("cpu-gloo")))


def _key_value_option(opt: str):
    """The table-wise key_value option of a 1000 x 16 fp32 table trained by ``opt``."""
    from torchrec.distributed.planner import ParameterConstraints

    from sharding.planner.enumerators import TopologyEnumerator

    topo = torchrec_topology(load_topology("dgx-a100-ssd"))
    cons = {"t": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["key_value"])}
    space = TopologyEnumerator(topo, 64, (), cons).enumerate(_tagged_ebc({"t": (1000, 16, opt)}), [EmbeddingBagCollectionSharder()])
    (so,) = space
    return so


def test_key_value_storage_is_weights_and_state_on_ssd_and_a_cache_in_hbm():
    from torchrec.distributed.planner.types import Storage
    from torchrec.distributed.types import CacheParams

    from sharding.constants import KEY_VALUE_START_LOAD_FACTOR
    from sharding.planner.ssd_tier import key_value_storage

    so = _key_value_option("rowwise")
    so.cache_params = None
    so.shards[0].storage = Storage(hbm=1000, ddr=5, ssd=9)  # as if torchrec's estimate
    key_value_storage(so)
    # ssd: 1000 x 16 x 4 B of weights + 1000 x 4 B of row-wise Adagrad state; hbm: torchrec's
    # buffers + the start cache, 0.01 of the weights; nothing in host memory
    assert so.cache_params.load_factor == KEY_VALUE_START_LOAD_FACTOR == 0.01
    assert so.shards[0].storage == Storage(hbm=1000 + 640, ddr=0, ssd=64_000 + 4_000)
    # a load factor the user gave is kept, and sizes the cache
    so.cache_params = given = CacheParams(load_factor=0.5)
    so.shards[0].storage = Storage(hbm=1000, ddr=5, ssd=9)
    key_value_storage(so)
    assert so.cache_params is given and so.shards[0].storage == Storage(hbm=1000 + 32_000, ddr=0, ssd=68_000)
    # plain SGD keeps no state
    sgd = _key_value_option("none")
    sgd.shards[0].storage = Storage(hbm=1000, ddr=5, ssd=9)
    key_value_storage(sgd)
    assert sgd.shards[0].storage.ssd == 64_000
