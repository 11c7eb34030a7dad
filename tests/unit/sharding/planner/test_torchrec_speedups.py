"""sharding/planner/torchrec_speedups.py: memoized torchrec planner internals that give torchrec's own results,
applied only inside ``fast_planner_internals``."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import enumerators, planners
from torchrec.distributed.planner.estimator import annotations, estimator
from torchrec.distributed.planner.types import Perf

from sharding.planner.constraints import default_constraints
from sharding.planner.enumerators import TopologyEnumerator
from sharding.planner.job_topology import torchrec_topology
from sharding.planner.torchrec_speedups import (
    _MemoEvaluator,
    _memoized,
    fast_deepcopy,
    fast_planner_internals,
    no_search_space_copy,
)
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
SPECS = [(100, 16), (1000, 256), (300, 32)]


def _space(topology: str = "cpu-gloo", specs=SPECS):
    model = meta_ebc(specs)
    cluster = load_topology(topology)
    enumerator = TopologyEnumerator(torchrec_topology(cluster), 64, (2, 4), default_constraints(model, cluster.compute_device))
    return enumerator.enumerate(model, [EmbeddingBagCollectionSharder()])


def _estimates(space) -> list[tuple]:
    return [(so.name, so.sharding_type, len(so.shards), [(sh.perf, sh.storage) for sh in so.shards]) for so in space]


def _patched() -> tuple:
    return (
        annotations._get_annotated_method,
        annotations._get_coefficient_method,
        enumerators.copy,
        planners.copy,
        estimator.get_embedding_perf_sharding_evaluator,
        estimator.ShardPerfContext.__dict__["build_shard_perf_contexts"],
    )


def test_the_fast_copy_of_a_search_space_equals_deepcopys():
    space = _space()
    fast, slow = fast_deepcopy(space), copy.deepcopy(space)
    assert len(fast) == len(slow) == len(space)
    for f, s, o in zip(fast, slow, space):
        assert f is not o and f.__dict__.keys() == s.__dict__.keys()
        for key in s.__dict__.keys() - {"shards", "_tensor", "_module"}:
            assert getattr(f, key) == getattr(s, key), key
        assert f.shards == s.shards == o.shards
        for fs, os_ in zip(f.shards, o.shards):  # fresh shards, lists and estimates
            assert fs is not os_ and fs.size is not os_.size and fs.offset is not os_.offset
            assert fs.storage is not os_.storage and fs.perf is not os_.perf
        assert f.tensor is s.tensor is o.tensor and f.module is s.module is o.module  # shared, as torchrec's own deep copy does
    # anything else: copy.deepcopy
    nested = [1, [2, 3]]
    other = fast_deepcopy(nested)
    assert other == nested and other[1] is not nested[1]


@pytest.mark.parametrize("topology", ["cpu-gloo", "workstation-4gpu-nvlink-pairs"])
def test_estimates_are_the_same_with_the_fast_internals(monkeypatch, topology):
    specs = SPECS + [(10, 16), (1001, 8)]  # rows 3, 3, 3, 1 on 4 ranks: shards of two sizes
    plain = _estimates(_space(topology, specs))
    built: list[int] = []
    build = estimator.ShardPerfContext._build_contexts.__func__

    def counting(cls, **kwargs):
        built.append(len(kwargs["shard_sizes"]))
        return build(cls, **kwargs)

    monkeypatch.setattr(estimator.ShardPerfContext, "_build_contexts", classmethod(counting))
    with fast_planner_internals():
        space = _space(topology, specs)
        fast = _estimates(space)
    assert fast == plain
    # shards of one size shared one context: fewer built than there are shards
    assert sum(built) < sum(len(so.shards) for so in space)
    assert any(len({tuple(sh.size) for sh in so.shards}) < len(so.shards) for so in space)


class _SizeEvaluator:
    """Prices a shard by its context's size alone, so a shard given another's context shows."""

    def compute_perf(self, ctx, config) -> Perf:
        return Perf(fwd_compute=float(ctx.hash_size), fwd_comms=float(ctx.emb_dim), bwd_compute=0.0, bwd_comms=0.0)


def test_each_shard_is_priced_from_a_context_of_its_own_size(monkeypatch):
    monkeypatch.setattr(estimator, "get_embedding_perf_sharding_evaluator", lambda sharding_type, is_inference=False: _SizeEvaluator())
    specs = SPECS + [(10, 16), (1001, 8)]
    with fast_planner_internals():
        space = _space("workstation-4gpu-nvlink-pairs", specs)
    two_sizes = 0
    for so in space:
        for sh in so.shards:
            assert (sh.perf.fwd_compute, sh.perf.fwd_comms) == (float(sh.size[0]), float(sh.size[1])), so.sharding_type
        sizes = [tuple(sh.size) for sh in so.shards]
        two_sizes += 1 < len(set(sizes)) < len(sizes)
    assert two_sizes  # options whose shards come in repeated and distinct sizes


def test_the_enumerator_keeps_no_copy_of_its_search_space_and_enumerates_again_afresh():
    model = meta_ebc(SPECS)
    enumerator = TopologyEnumerator(torchrec_topology(load_topology("cpu-gloo")), 64, (2, 4), default_constraints(model, "cpu"))
    with fast_planner_internals():
        first = enumerator.enumerate(model, [EmbeddingBagCollectionSharder()])
        assert enumerator._last_stored_search_space is None
        for so in first:  # what a search does to its options
            for sh in so.shards:
                sh.rank = 0
        second = enumerator.enumerate(model, [EmbeddingBagCollectionSharder()])
    assert len(second) == len(first) and all(a is not b for a, b in zip(first, second))
    assert _estimates(second) == _estimates(_space()) and all(sh.rank is None for so in second for sh in so.shards)
    # only inside no_search_space_copy is a list of options returned as it is
    with no_search_space_copy():
        assert fast_deepcopy(first) is first
    assert fast_deepcopy(first) is not first


def test_torchrecs_functions_are_restored_on_exit_and_on_error():
    before = _patched()
    with fast_planner_internals():
        inside = _patched()
    assert all(a is not b for a, b in zip(before, inside))
    assert _patched() == before
    with pytest.raises(RuntimeError, match="^inside$"):
        with fast_planner_internals():
            raise RuntimeError("inside")
    assert _patched() == before


class _Config:
    def rate(self) -> int:
        return 1

    def other(self) -> int:
        return 2


def test_the_method_lookup_is_memoized_per_config_marker_and_type():
    calls = []

    def lookup(config, marker, sharding_type=None):
        calls.append((marker, sharding_type))
        return config.rate if marker == "rate" else None

    memo = _memoized(lookup)
    a, b = _Config(), _Config()
    assert memo(a, "rate", "table_wise") == a.rate
    assert memo(a, "rate", "table_wise") == a.rate
    assert memo(a, "rate", "row_wise") == a.rate
    assert memo(b, "rate", "table_wise") == b.rate
    assert memo(a, "none") is None and memo(a, "none") is None
    assert calls == [("rate", "table_wise"), ("rate", "row_wise"), ("rate", "table_wise"), ("none", None)]


class _Context:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


class _Evaluator:
    def __init__(self) -> None:
        self.calls = 0

    def compute_perf(self, ctx, config) -> Perf:
        self.calls += 1
        return Perf(fwd_compute=float(ctx.rows), fwd_comms=1.0, bwd_compute=2.0, bwd_comms=3.0)


def test_perf_is_computed_once_per_context_and_each_shard_gets_its_own_copy():
    inner = _Evaluator()
    memo = _MemoEvaluator(inner, {}, {})
    config = _Config()
    first = memo.compute_perf(_Context(rows=10, sizes=[1, 2], name="t"), config)
    again = memo.compute_perf(_Context(rows=10, sizes=[1, 2], name="t"), config)
    assert inner.calls == 1 and first == again and first is not again
    shared = _Context(rows=12, sizes=[object()], name="t")  # one context of shards of one size
    assert memo.compute_perf(shared, config) == memo.compute_perf(shared, config)
    assert inner.calls == 2  # found by the object, though its fields are not a key
    inner.calls = 1
    assert first.total == 10.0 + 1.0 + 2.0 + 3.0
    assert memo.compute_perf(_Context(rows=11, sizes=[1, 2], name="t"), config).fwd_compute == 11.0
    assert inner.calls == 2
    # a list of objects is not a key: computed every time
    memo.compute_perf(_Context(rows=10, sizes=[object()], name="t"), config)
    memo.compute_perf(_Context(rows=10, sizes=[object()], name="t"), config)
    assert inner.calls == 4
    assert memo.calls == 4  # other attributes are the inner evaluator's


def test_the_collector_is_paused_while_planning_and_restored_after(monkeypatch):
    from sharding import TopologyAwarePlanner
    from sharding.planner.torchrec_speedups import paused_gc

    seen: list[bool] = []
    enumerate_ = TopologyEnumerator.enumerate

    def watched(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return enumerate_(self, *args, **kwargs)

    monkeypatch.setattr(TopologyEnumerator, "enumerate", watched)
    planner = TopologyAwarePlanner(load_topology("cpu-gloo"), batch_size=64)
    model = meta_ebc(SPECS)
    was = gc.isenabled()
    try:
        for on in (True, False):
            gc.enable() if on else gc.disable()
            planner.plan(model, [EmbeddingBagCollectionSharder()])
            assert gc.isenabled() is on  # as it was before
        assert seen == [False, False]
        gc.enable()
        with pytest.raises(RuntimeError, match="^inside$"):
            with paused_gc():
                assert not gc.isenabled()
                raise RuntimeError("inside")
        assert gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()
