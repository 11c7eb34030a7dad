"""sharding/planner/load_factor_tuning.py: cache load factors grown into the HBM a plan leaves free."""

from __future__ import annotations

import logging

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, Storage, TopologyFactory, TrainerConfig
from torchrec.distributed.types import CacheParams

from sharding.planner.cache_sizing import IdFrequencyStats
from sharding.planner.enumerators import TopologyEnumerator
from sharding.planner.load_factor_tuning import grow_cache_load_factors
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
T0 = 100_000 * 64 * 4  # t_0: HBM per +1.0 of load factor (rows x dim x fp32)
T1 = 50_000 * 64 * 4  # t_1


def _topology(hbm: int):
    """2 CUDA ranks with ``hbm`` bytes each."""
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=2, local_world_size=2),
        hardware_config=HardwareConfig(hbm_cap_bytes=hbm),
        kernel_config=KernelConfig(compute_device="cuda"),
    )


def _plan(kernels: dict[str, str], placed: dict[str, tuple[int, int]]):
    """Table-wise options of t_0 (100,000 x 64) and t_1 (50,000 x 64) with the given kernels, each
    shard on ``placed[name] = (rank, hbm bytes)``."""
    cons = {name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[kernel]) for name, kernel in kernels.items()}
    space = TopologyEnumerator(_topology(10**9), 64, (), cons).enumerate(
        meta_ebc([(100_000, 64), (50_000, 64)]), [EmbeddingBagCollectionSharder()]
    )
    for so in space:
        rank, hbm = placed[so.name]
        so.shards[0].rank = rank
        so.shards[0].storage = Storage(hbm=hbm, ddr=7, ssd=0)
    return space


def _load_factors(plan) -> dict[str, float | None]:
    return {so.name: None if so.cache_params is None else so.cache_params.load_factor for so in plan}


def test_a_caching_table_grows_into_95_percent_of_its_ranks_free_hbm():
    # rank 0: 11 MB, t_0 holds 1 MB: 10 MB free = 0.390625 of t_0's full size. From torchrec's
    # default 0.2: 0.2 + 0.95 x 0.390625 = 0.571 -> 0.57 (a 0.01 grid, rounded down)
    plan = _plan({"t_0": "fused_uvm_caching", "t_1": "fused"}, {"t_0": (0, 1_000_000), "t_1": (1, 500)})
    assert grow_cache_load_factors(plan, _topology(11_000_000)) is plan
    assert _load_factors(plan) == {"t_0": 0.57, "t_1": None}
    t0, t1 = plan
    assert t0.shards[0].storage.hbm == pytest.approx(1_000_000 + 0.37 * T0, abs=1)
    assert (t0.shards[0].storage.ddr, t1.shards[0].storage) == (7, Storage(hbm=500, ddr=7, ssd=0))  # fused: untouched


def test_growth_stops_at_the_most_a_cache_may_hold():
    plan = _plan({"t_0": "fused_uvm_caching", "t_1": "fused_uvm_caching"}, {"t_0": (0, 0), "t_1": (1, 0)})
    grow_cache_load_factors(plan, _topology(10**10))
    assert _load_factors(plan) == {"t_0": 0.8, "t_1": 0.8}
    assert [so.shards[0].storage.hbm for so in plan] == [pytest.approx(0.6 * T0, abs=1), pytest.approx(0.6 * T1, abs=1)]


def test_the_largest_table_goes_first_unless_another_has_measured_statistics():
    # one rank, 2.56 MB free: t_0 (the larger) takes 0.2 + 0.95 x 0.1 -> 0.29 (2.304 MB); the 256 KB
    # left would lift t_1 to 0.219 -> 0.21, not more than 0.01 above 0.2: it stays
    plan = _plan({"t_0": "fused_uvm_caching", "t_1": "fused_uvm_caching"}, {"t_0": (0, 0), "t_1": (0, 0)})
    grow_cache_load_factors(plan, _topology(2_560_000))
    assert _load_factors(plan) == {"t_0": 0.29, "t_1": None}
    # t_1 measured (every row seen twice: its hit rate rises until the cache holds it all): t_1
    # first, 0.2 + 0.95 x 0.2 = 0.39 (2.432 MB); the 128 KB left are too little for t_0
    plan = _plan({"t_0": "fused_uvm_caching", "t_1": "fused_uvm_caching"}, {"t_0": (0, 0), "t_1": (0, 0)})
    plan[1].cache_params = CacheParams(load_factor=0.2, stats=IdFrequencyStats([2] * 50_000, rows=50_000))
    grow_cache_load_factors(plan, _topology(2_560_000))
    assert _load_factors(plan) == {"t_0": None, "t_1": 0.39}
    assert plan[1].cache_params.stats is not None  # the other cache parameters are kept


def test_a_measured_table_stops_where_its_hit_rate_stops_rising():
    # half of t_1's rows seen, twice each: a cache of half the rows serves every lookup
    stats = IdFrequencyStats([2] * 25_000, rows=50_000)
    plan = _plan({"t_0": "fused", "t_1": "fused_uvm_caching"}, {"t_0": (0, 0), "t_1": (1, 0)})
    plan[1].cache_params = CacheParams(load_factor=0.3, stats=stats)
    grow_cache_load_factors(plan, _topology(10**10))
    assert _load_factors(plan)["t_1"] == 0.5
    # at or past that point already: unchanged
    plan[1].cache_params = CacheParams(load_factor=0.6, stats=stats)
    grow_cache_load_factors(plan, _topology(10**10))
    assert _load_factors(plan)["t_1"] == 0.6


def test_without_a_placement_the_plan_is_returned_as_it_is():
    plan = _plan({"t_0": "fused_uvm_caching", "t_1": "fused_uvm_caching"}, {"t_0": (0, 0), "t_1": (1, 0)})
    assert grow_cache_load_factors(plan, None) is plan
    assert _load_factors(plan) == {"t_0": None, "t_1": None}
