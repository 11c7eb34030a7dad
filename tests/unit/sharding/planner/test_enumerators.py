"""sharding/planner/enumerators.py: torchrec's enumerator with column-wise variants cut finer and a fixed order."""

from __future__ import annotations

import logging
import random

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, TopologyFactory, TrainerConfig

from sharding.planner.constraints import default_constraints
from sharding.planner.enumerators import TopologyEnumerator, _sorted_enumeration
from sharding.planner.job_topology import torchrec_topology
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
SHARDERS = [EmbeddingBagCollectionSharder()]


def _cuda_topology(world: int, local: int):
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world, local_world_size=local),
        hardware_config=HardwareConfig(),
        kernel_config=KernelConfig(compute_device="cuda"),
    )


def _options(space) -> list[tuple[str, str, str, list[int]]]:
    """(table, sharding type, kernel, the shards' widths) per option, in the enumerator's order."""
    return [(so.name, so.sharding_type, so.compute_kernel, [int(sh.size[1]) for sh in so.shards]) for so in space]


def test_options_of_two_small_tables_on_two_cpu_ranks():
    # On CPU torchrec's sharder offers table-, column- and table-column-wise (row-wise needs CUDA),
    # the planner's defaults the fused kernel alone. t_0 (dim 16): torchrec cuts columns in blocks
    # of 128, so column-wise and table-column-wise are one shard each, and the planner adds their
    # cut into 2 shards of 8 columns (4 shards exceed the 2 ranks). t_1 (dim 256): torchrec's own
    # cut is already 2 shards of 128; 2 is no finer and 4 exceeds the ranks: nothing added.
    model = meta_ebc([(100, 16), (1000, 256)])
    enumerator = TopologyEnumerator(torchrec_topology(load_topology("cpu-gloo")), 64, (2, 4), default_constraints(model, "cpu"))
    space = enumerator.enumerate(model, SHARDERS)
    assert _options(space) == [
        ("t_0", "table_wise", "fused", [16]),
        ("t_0", "column_wise", "fused", [16]),
        ("t_0", "column_wise", "fused", [8, 8]),
        ("t_0", "table_column_wise", "fused", [16]),
        ("t_0", "table_column_wise", "fused", [8, 8]),
        ("t_1", "table_wise", "fused", [256]),
        ("t_1", "column_wise", "fused", [128, 128]),
        ("t_1", "table_column_wise", "fused", [128, 128]),
    ]
    assert enumerator.last_search_space == space
    cut = space[2]
    assert [sh.offset for sh in cut.shards] == [[0, 0], [0, 8]]
    assert all(sh.size[0] == 100 and sh.perf is not None and sh.storage is not None for sh in cut.shards)


def test_column_splits_need_four_aligned_columns_a_shard_and_a_rank_each():
    # 4 CUDA ranks, column-wise on the fused kernel only: dim 16 -> 16 | 8+8 | 4x4; dim 12 -> 6 and
    # 3 columns are not multiples of 4: no cut; dim 24 -> 12+12 (6 is not a multiple of 4)
    model = meta_ebc([(100, 16), (100, 12), (100, 24)])
    cons = {f"t_{i}": ParameterConstraints(sharding_types=["column_wise"], compute_kernels=["fused"]) for i in range(3)}
    space = TopologyEnumerator(_cuda_topology(4, 4), 64, (2, 4), cons).enumerate(model, SHARDERS)
    assert [(name, widths) for name, _, _, widths in _options(space)] == [
        ("t_0", [16]),
        ("t_0", [8, 8]),
        ("t_0", [4, 4, 4, 4]),
        ("t_1", [12]),
        ("t_2", [24]),
        ("t_2", [12, 12]),
    ]


def test_table_column_wise_cuts_are_limited_to_one_hosts_ranks():
    # 4 ranks, 2 per host: table-column-wise keeps a table on one host, so at most 2 shards
    model = meta_ebc([(100, 16)])
    cons = {"t_0": ParameterConstraints(sharding_types=["table_column_wise"], compute_kernels=["fused"])}
    space = TopologyEnumerator(_cuda_topology(4, 2), 64, (2, 4), cons).enumerate(model, SHARDERS)
    assert [widths for *_, widths in _options(space)] == [[16], [8, 8]]


def test_a_users_min_partition_and_empty_column_splits_add_no_cuts():
    model = meta_ebc([(100, 16), (100, 16)])
    cons = {
        "t_0": ParameterConstraints(sharding_types=["column_wise"], compute_kernels=["fused"], min_partition=16),
        "t_1": ParameterConstraints(sharding_types=["column_wise"], compute_kernels=["fused"]),
    }
    space = TopologyEnumerator(_cuda_topology(4, 4), 64, (2, 4), cons).enumerate(model, SHARDERS)
    assert [(name, widths) for name, _, _, widths in _options(space)] == [
        ("t_0", [16]),
        ("t_1", [16]),
        ("t_1", [8, 8]),
        ("t_1", [4, 4, 4, 4]),
    ]
    plain = TopologyEnumerator(_cuda_topology(4, 4), 64, (), cons).enumerate(model, SHARDERS)
    assert [(name, widths) for name, _, _, widths in _options(plain)] == [("t_0", [16]), ("t_1", [16])]


def test_the_order_does_not_depend_on_the_order_torchrec_lists_options_in():
    model = meta_ebc([(100, 16), (1000, 256)])
    enumerator = TopologyEnumerator(torchrec_topology(load_topology("cpu-gloo")), 64, (2, 4), default_constraints(model, "cpu"))
    space = enumerator.enumerate(model, SHARDERS)
    # torchrec builds each table's types and kernels from sets: any order within a table
    t0, t1 = space[:5], space[5:]
    for seed in range(3):
        a, b = list(t0), list(t1)
        random.Random(seed).shuffle(a)
        random.Random(seed + 10).shuffle(b)
        assert _sorted_enumeration(lambda shuffled=a + b: shuffled)() == space
    # tables stay in the order they were first listed
    assert [so.name for so in _sorted_enumeration(lambda: list(t1) + list(t0))()] == ["t_1"] * 3 + ["t_0"] * 5
