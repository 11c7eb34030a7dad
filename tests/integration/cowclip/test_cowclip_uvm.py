"""CowClip tables in host memory (UVM), the parts a CPU can check: the storage placement of
``CowClipAdamTBE(location=...)`` through FBGEMM's unified-memory allocator (whose CPU build hands
back host memory, so the same code runs here), the plan kernel -> placement mapping of the
sharder, what the sharder offers torchrec's planner per device, and the planner's memory
accounting of a CowClip UVM table on a CUDA topology planned on this machine.

The CUDA side (the tensors really are UVM, the DMP round trip with a checkpoint) is in
tests/gpu/test_cowclip_uvm_cuda.py (``make test-gpu``)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.modules.embedding_configs import DataType, PoolingType

from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam
from recsys.optim.cowclip.tables import split_by_location, state_location
from recsys.optim.cowclip.tbe import CowClipAdamTBE, unified_zeros
from recsys.optim.cowclip.hyper import CowClipHyper

SPECS = [(50, 8), (30, 4), (20, 8)]
FEATURE_TABLE = [2, 0, 1]  # features read the tables in another order than they are stored


def _train(location: str, steps: int = 4) -> CowClipAdamTBE:
    torch.manual_seed(0)  # FBGEMM draws the initial weights
    hp = CowClipHyper(learning_rate=0.05, l2=1e-3, cowclip_zeta=0.05)
    tbe = CowClipAdamTBE(SPECS, FEATURE_TABLE, hp, full_dims=[d for _, d in SPECS], mode="inline", location=location)
    gen = torch.Generator().manual_seed(1)
    B = 6
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(FEATURE_TABLE) * B,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        # ids below the smallest table's rows, with repeats across bags
        ids = torch.randint(0, 20, (int(lengths.sum()),), generator=gen)
        out = tbe(ids, offsets)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return tbe


def test_unified_memory_tables_train_exactly_like_device_memory_ones():
    ref = _train("device")
    assert int(ref.row_step.sum()) > 0
    for loc in ("managed", "host_mapped"):
        tbe = _train(loc)
        assert tbe.location == loc
        for name in ("weights", "momentum1", "momentum2", "row_step"):
            a, b = getattr(ref, name), getattr(tbe, name)
            assert b.dtype == a.dtype and b.shape == a.shape and b.device.type == "cpu"
            assert torch.equal(a, b), (loc, name)
        # four separate allocations, none a view of another
        ptrs = {getattr(tbe, n).untyped_storage().data_ptr() for n in ("weights", "momentum1", "momentum2", "row_step")}
        assert len(ptrs) == 4
        # the checkpointed views read the unified buffers
        st = tbe.get_optimizer_state()[1]
        assert st["exp_avg"].untyped_storage().data_ptr() == tbe.momentum1.untyped_storage().data_ptr()
        assert st["row_step"].shape == (SPECS[1][0],)


def test_unified_zeros_is_zero_filled_host_memory_on_cpu():
    for dtype in (torch.float32, torch.long):
        t = unified_zeros(1000, dtype, torch.device("cpu"), host_mapped=False)
        assert t.shape == (1000,) and t.dtype == dtype and t.device.type == "cpu" and not t.any()


def test_unknown_location_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^CowClip-Adam kernel: location must be device\|managed\|host_mapped, got 'hbm'$"):
        CowClipAdamTBE(SPECS, [0, 1, 2], CowClipHyper(), full_dims=[8, 4, 8], mode="inline", location="hbm")


def _table(name: str, kernel: EmbeddingComputeKernel):
    from torchrec.distributed.embedding_types import ShardedEmbeddingTable

    return ShardedEmbeddingTable(num_embeddings=10, embedding_dim=4, name=name, feature_names=[f"f_{name}"], compute_kernel=kernel)


def _group(tables, optimizer: str = "recsys.cowclip_adam", **fused) -> GroupedEmbeddingConfig:
    """A group as torchrec's grouping makes it: fused and fused_uvm tables filed under ``fused``."""
    return GroupedEmbeddingConfig(
        DataType.FP32, PoolingType.SUM, False, False, EmbeddingComputeKernel.FUSED, tables, fused_params={"optimizer": optimizer, **fused}
    )


def test_the_plan_kernel_of_each_table_decides_where_its_state_lives():
    K = EmbeddingComputeKernel
    assert state_location(_group([_table("t_big", K.FUSED)])) == "device"
    assert state_location(_group([_table("t_big", K.DENSE)])) == "device"
    assert state_location(_group([_table("t_big", K.FUSED_UVM)])) == "managed"
    assert state_location(_group([_table("t_big", K.FUSED_UVM)], uvm_host_mapped=True)) == "host_mapped"
    with pytest.raises(ValueError) as e:
        state_location(_group([_table("t_big", K.FUSED_UVM_CACHING)]))
    assert str(e.value) == (
        "CowClip-Adam table t_big: compute kernel fused_uvm_caching is not supported (FBGEMM's cache of hot "
        "rows cannot stay coherent with the CowClip update); use fused_uvm or fused"
    )
    with pytest.raises(
        ValueError,
        match=r"^CowClip-Adam table t_big needs compute kernel fused or fused_uvm "
        r"\(dense for data_parallel\), the plan says key_value$",
    ):
        state_location(_group([_table("t_big", K.KEY_VALUE)]))


def test_mixed_groups_are_cut_into_runs_of_one_location():
    """torchrec puts fused and fused_uvm tables with equal fused params in one group; our TBE holds
    one location, so the lookup gets consecutive runs, in the same table (= feature) order."""
    K = EmbeddingComputeKernel
    tables = [_table("a", K.FUSED), _table("b", K.FUSED_UVM), _table("c", K.FUSED_UVM), _table("d", K.FUSED)]
    cow = _group(tables)
    stock = _group([_table("e", K.FUSED), _table("f", K.FUSED_UVM)], optimizer="exact_sgd")
    out = split_by_location([cow, stock])
    assert [[t.name for t in g.embedding_tables] for g in out] == [["a"], ["b", "c"], ["d"], ["e", "f"]]
    assert [state_location(g) for g in out[:3]] == ["device", "managed", "device"]
    assert out[3] is stock and all(g.fused_params == cow.fused_params for g in out[:3])
    with pytest.raises(ValueError, match=r"one kernel holds tables of one location, got \['device', 'managed'\]$"):
        state_location(cow)


# ---------------------------------------------------------------------------- the planner

ROWS, DIM = 100_000, 64
WEIGHT_BYTES = ROWS * DIM * 4


def _cowclip_ebc(n: int = 1, rows: int = ROWS) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t_{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{i}"]) for i in range(n)],
        device=torch.device("meta"),
    )
    tag_cowclip_adam(ebc.parameters(), lr=1e-3)
    return ebc


def test_sharder_offers_what_the_kernel_supports_per_device():
    s = CowClipEmbeddingBagCollectionSharder()
    for st in ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"):
        assert s.compute_kernels(st, "cuda") == ["fused", "fused_uvm"]
        assert s.compute_kernels(st, "cpu") == ["fused"]
    assert s.compute_kernels("data_parallel", "cuda") == ["dense"]
    # what torchrec's enumerator makes of it, on a CUDA topology planned on this CPU machine
    opts = EmbeddingEnumerator(Topology(world_size=2, compute_device="cuda"), batch_size=512).enumerate(_cowclip_ebc(), [s])
    kinds = {(o.sharding_type == "data_parallel", o.compute_kernel) for o in opts}
    assert kinds == {(False, "fused"), (False, "fused_uvm"), (True, "dense")}
    cpu = EmbeddingEnumerator(Topology(world_size=2, compute_device="cpu"), batch_size=512).enumerate(_cowclip_ebc(), [s])
    assert {(o.sharding_type == "data_parallel", o.compute_kernel) for o in cpu} == {(False, "fused"), (True, "dense")}


def test_storage_estimate_of_a_cowclip_uvm_table_is_host_memory():
    """fused_uvm: weights + both Adam moments (3x the weight bytes) in host memory (DDR), only the
    lookup's input/output buffers in HBM; fused: the same 3x in HBM, nothing in DDR."""
    opts = EmbeddingEnumerator(Topology(world_size=1, compute_device="cuda"), batch_size=512).enumerate(
        _cowclip_ebc(), [CowClipEmbeddingBagCollectionSharder()]
    )
    tw = {o.compute_kernel: o for o in opts if o.sharding_type == "table_wise"}
    uvm, fused = tw["fused_uvm"].total_storage, tw["fused"].total_storage
    assert uvm.ddr == 3 * WEIGHT_BYTES
    io_bytes = fused.hbm - 3 * WEIGHT_BYTES  # the lookup's buffers, the same for both kernels
    assert 0 < io_bytes < WEIGHT_BYTES / 100
    assert uvm.hbm == io_bytes and fused.ddr == 0


def test_tight_hbm_plan_on_a_cuda_topology_puts_cowclip_tables_in_host_memory():
    """The project's planner on a shipped 8-GPU topology with 64 MiB of HBM per GPU: 8 CowClip
    tables of 1M x 64 (256 MB of weights, 768 MB with the moments, each) cannot stay in HBM, so
    the plan offloads them with fused_uvm, never fused_uvm_caching, and counts their weights and
    state in host memory."""
    from sharding.topology.topology_file import load_topology
    from sharding.planner.topology_planner import TopologyAwarePlanner

    logging.disable(logging.WARNING)
    try:
        topo = load_topology("dgx-a100")
        hosts = tuple(dataclasses.replace(h, gpus=tuple(dataclasses.replace(g, hbm_bytes=64 << 20) for g in h.gpus)) for h in topo.hosts)
        topo = dataclasses.replace(topo, hosts=hosts, name="dgx-a100-64mib")
        rows = 1_000_000
        planner = TopologyAwarePlanner(topo, 512, column_splits=())
        plan = planner.plan(_cowclip_ebc(8, rows), [CowClipEmbeddingBagCollectionSharder()])
    finally:
        logging.disable(logging.NOTSET)
    kernels = {name: ps.compute_kernel for m in plan.plan.values() for name, ps in m.items()}
    assert len(kernels) == 8 and "fused_uvm_caching" not in kernels.values()
    assert "fused_uvm" in kernels.values()
    for so in planner.best_plan:
        shard_weight_bytes = sum(sh.size[0] * sh.size[1] * 4 for sh in so.shards)
        ddr = sum(sh.storage.ddr for sh in so.shards)
        hbm = sum(sh.storage.hbm for sh in so.shards)
        if so.compute_kernel == "fused_uvm":
            assert ddr == pytest.approx(3 * shard_weight_bytes, rel=1e-6), so.name
            assert hbm < shard_weight_bytes / 100, so.name
        else:
            assert ddr == 0 and hbm >= 3 * shard_weight_bytes, so.name


@pytest.mark.parametrize("world", [1, 2])
def test_dmp_with_uvm_planned_cowclip_tables_trains_and_resumes_on_cpu(tmp_path, world):
    """tests/support/cowclip_uvm_dmp.py over gloo on CPU: a plan with fused and fused_uvm CowClip tables
    (table-wise, row-wise, column-wise, one host-mapped), the fused and a fused_uvm table in one
    torchrec group: each table's TBE has the planned location, training equals the per-table
    formula, a DCP round trip replays bit-identically. (On CUDA: tests/gpu/test_cowclip_uvm_cuda.py.)"""
    from tests.support import cowclip_uvm_dmp
    from recsys.training.distributed import free_port
    from tests.support.processes import start_workers

    start_workers(cowclip_uvm_dmp.gloo_worker, (world, free_port(), str(tmp_path)), world)
    cowclip_uvm_dmp.check(tmp_path, world, uvm=False)
