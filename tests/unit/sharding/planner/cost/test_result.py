"""PlanCost: the figures a report prints, from a cost written out by hand."""

from __future__ import annotations

import numpy as np

from sharding.planner.cost.result import PlanCost


def _cost(**kw) -> PlanCost:
    z = np.zeros(3)
    base = dict(
        step_time=2.5e-3,
        rank_time=np.array([1e-3, 2.5e-3, 2e-3]),
        lookup=z,
        host_io=z,
        comm=z,
        hbm_bytes=np.array([10.0, 30.0, 20.0]),
        host_bytes=np.array([0.0, 5.0, 7.0]),
        comm_time=1.25e-3,
        phases={"table_wise:fwd": ("gpu1>out", 0.0004), "row_wise:rs": ("nic0>in", 0.0002)},
    )
    base.update(kw)
    return PlanCost(**base)


def test_the_bottleneck_is_the_slowest_rank_and_ssd_fields_default_to_zero():
    c = _cost()
    assert c.bottleneck_rank == 1
    assert c.ssd_io.tolist() == [0.0, 0.0, 0.0] and c.ssd_bytes.tolist() == [0.0, 0.0, 0.0]


def test_as_dict_in_milliseconds_with_the_busiest_link_of_each_phase():
    d = _cost().as_dict()
    assert d["step_time_ms"] == 2.5 and d["comm_time_ms"] == 1.25
    assert d["rank_time_ms"] == [1.0, 2.5, 2.0]
    assert d["busiest_links"] == {"row_wise:rs": ["nic0>in", 0.2], "table_wise:fwd": ["gpu1>out", 0.4]}
    assert (d["max_hbm_bytes"], d["max_host_bytes_per_rank"]) == (30, 7)
    assert "ssd_io_ms" not in d and "max_ssd_bytes_per_rank" not in d  # no key_value shard


def test_as_dict_adds_the_ssd_tier_only_when_a_rank_holds_ssd_bytes():
    d = _cost(ssd_io=np.array([0.0, 3e-4, 0.0]), ssd_bytes=np.array([0.0, 4096.0, 0.0])).as_dict()
    assert d["ssd_io_ms"] == [0.0, 0.3, 0.0] and d["max_ssd_bytes_per_rank"] == 4096
