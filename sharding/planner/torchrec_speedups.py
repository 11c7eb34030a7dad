"""Faster torchrec planner internals, applied only while the topology-aware planner plans.

Profiling the 500-table model on 128 ranks (benchmarks/2026-11-26-planner.md) showed most of
the time in torchrec itself, not in our cost model:

- the v2 shard perf estimator (``torchrec/distributed/planner/estimator``) looks up its
  annotated config methods by scanning ``dir(config)`` on every call (``_get_annotated_method``,
  ``_get_coefficient_method``): 9 scans per shard, ~200K shards for 500 tables x 15 options x up
  to 128 shards. We memoize the lookup per (config object, marker, sharding type); the method
  found is the same one (same attribute name, fetched from the same object again);
- ``copy.deepcopy`` of sharding options (the enumerator keeps a deep copy of the whole search
  space; the search deep-copies every new best plan) goes through the generic reconstructor for
  every ``Shard``. We copy ``ShardingOption`` lists with a specialised copier that gives the same
  result (fresh shards, fresh size/offset lists, fresh Storage/Perf; ``tensor``/``module``
  shared as torchrec's own ``__deepcopy__`` does; every other attribute deep-copied).

- the same estimator computes every shard's perf from a context (shape, batch, bandwidths, ...)
  built per shard; the 128 shards of a row-wise option on 128 ranks share one. We memoize
  ``compute_perf`` on the context's field values (each shard gets its own copy of the Perf).

- torchrec's search loop keys each proposal by its options' hashes, each hashing every shard
  (``_OptionHashes``): an option's hash is kept while its shards have no rank.

- the v2 estimator builds one ``ShardPerfContext`` per shard, although a context depends on the
  option and the shard's size only; shards of one size share one (``_shared_contexts``), and
  ``compute_perf`` finds a shared context's perf by the object before building its key.

- the enumerator ends by deep-copying the whole search space, to answer a second ``enumerate``
  of the same module from the copy. ``TopologyEnumerator`` is built for one plan and asks once
  (it also clears that cache, so a second call enumerates afresh), so within its call
  (``no_search_space_copy``) the copy is skipped: for 500 tables on 128 ranks ~3 s of the
  enumeration, and ~1-2 s more of the search (measured), which ran with the copy's ~230,000
  shard objects alive.

- Python's cyclic garbage collector is paused while ``TopologyAwarePlanner.plan`` runs
  (``paused_gc``; not a torchrec internal, but the same cause of lost time): the
  search allocates millions of short-lived objects, so the collector ran ~6,000 times over a heap
  of ~10^6 live options, shards and estimates, and found ~10,000 objects in all (the garbage
  goes by reference counting). 500 tables on 128 ranks: 26.3 -> 22.7 s.

``fast_planner_internals()`` is a context manager; torchrec's functions are restored on exit, so
torchrec's own planner (e.g. in ``tools/bench/planner.py``) runs unpatched outside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy as _copy
import gc
import operator
import threading
import types
from typing import Any, Iterator

_lock = threading.RLock()


def _memoized(fn, skip_attrs=()):
    cache: dict[tuple, str | None] = {}

    def lookup(config: Any, marker: str, sharding_type: str | None = None):
        key = (id(config), type(config), marker, sharding_type)
        name = cache.get(key, _MISSING)
        if name is _MISSING:
            method = fn(config, marker, sharding_type)
            name = None if method is None else getattr(method, "__name__", None)
            if method is not None and (name is None or getattr(config, name, None) != method):
                return method  # not a plain named method: do not cache
            cache[key] = name
            return method
        return None if name is None else getattr(config, name)

    lookup.cache = cache  # type: ignore[attr-defined]
    return lookup


_MISSING = object()


def _shallow(obj: Any) -> Any:
    """copy.copy for plain dataclasses of numbers (Storage, Perf), without the reduce protocol."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


_SHARD_FIELDS = frozenset(("size", "offset", "storage", "perf", "rank"))


def _copy_shard(sh, Shard):
    """A deep copy of a ``Shard`` of torchrec's five fields, without its ``__init__`` (a Shard
    with other fields: ``copy.deepcopy``)."""
    d = sh.__dict__
    if d.keys() != _SHARD_FIELDS:
        return _copy.deepcopy(sh)
    new = object.__new__(Shard)
    storage, perf = d["storage"], d["perf"]
    new.__dict__.update(
        size=list(d["size"]),
        offset=list(d["offset"]),
        storage=None if storage is None else _shallow(storage),
        perf=None if perf is None else _shallow(perf),
        rank=d["rank"],
    )
    return new


_ATOMIC = (int, float, str, bool, type(None))

# set while a TopologyEnumerator runs torchrec's enumerate, whose one deep copy of a list of
# options is the search space it stores for a second call that never comes
_skip_search_space_copy: contextvars.ContextVar[bool] = contextvars.ContextVar("skip_search_space_copy", default=False)


@contextlib.contextmanager
def no_search_space_copy() -> Iterator[None]:
    """Within it, a deep copy of a list of ``ShardingOption`` (under ``fast_planner_internals``)
    returns the list itself: for an enumerator whose stored search space is never read."""
    token = _skip_search_space_copy.set(True)
    try:
        yield
    finally:
        _skip_search_space_copy.reset(token)


def fast_deepcopy(obj: Any, memo: dict | None = None) -> Any:
    """``copy.deepcopy`` with a fast path for lists of torchrec ``ShardingOption``."""
    from torchrec.distributed.planner.types import Shard, ShardingOption

    if isinstance(obj, list) and obj and all(type(o) is ShardingOption for o in obj):
        if _skip_search_space_copy.get():
            return obj
        memo = {} if memo is None else memo
        out = []
        for so in obj:
            new = ShardingOption.__new__(ShardingOption)
            for k, v in so.__dict__.items():
                if k in ("_tensor", "_module"):
                    setattr(new, k, v)
                elif k == "shards" and all(type(sh) is Shard for sh in v):
                    setattr(new, k, [_copy_shard(sh, Shard) for sh in v])
                else:
                    setattr(new, k, _copy.deepcopy(v, memo))
            out.append(new)
        return out
    return _copy.deepcopy(obj, memo)


class _MemoEvaluator:
    """An evaluator whose ``compute_perf`` is memoized on the context's field values (the
    shards of a row-wise option on 128 ranks have one context, repeated 128 times)."""

    def __init__(self, inner: Any, cache: dict, by_object: dict) -> None:
        self._inner = inner
        self._cache = cache
        self._by_object = by_object

    def compute_perf(self, ctx: Any, config: Any) -> Any:
        # a context shared by shards of one size (``_shared_contexts``): found by the object
        key = (type(self._inner), id(config), id(ctx))
        hit = self._by_object.get(key)
        if hit is None:
            hit = self._by_object[key] = (self._by_fields(ctx, config), ctx, config)  # ids stay taken
        return _shallow(hit[0])

    def _by_fields(self, ctx: Any, config: Any) -> Any:
        key = [type(self._inner), id(config)]
        refs = [config]  # objects keyed by id stay referenced, so their ids are not reused
        for v in ctx.__dict__.values():
            t = type(v)
            if t is list:
                if not all(type(x) in _ATOMIC for x in v):
                    return self._inner.compute_perf(ctx=ctx, config=config)
                v = tuple(v)
            elif t not in _ATOMIC:
                refs.append(v)
                v = ("id", id(v))
            key.append(v)
        key = tuple(key)
        hit = self._cache.get(key)
        if hit is None:
            perf = self._inner.compute_perf(ctx=ctx, config=config)
            hit = self._cache[key] = (perf, refs)
        return hit[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _shared_contexts(build: Any) -> Any:
    """``ShardPerfContext.build_shard_perf_contexts`` building one context per distinct shard size
    (a context is the option's values and the shard's [rows, columns]); shards of one size get the
    same object, which the estimator only reads."""

    def shared(cls: Any, *args: Any, **kwargs: Any) -> list:
        sizes = kwargs.get("shard_sizes")
        if args or sizes is None:
            return build.__func__(cls, *args, **kwargs)
        first: dict[tuple[int, ...], int] = {}
        for size in sizes:
            first.setdefault(tuple(size), len(first))
        if len(first) == len(sizes):
            return build.__func__(cls, *args, **kwargs)
        made = build.__func__(cls, **dict(kwargs, shard_sizes=[list(size) for size in first]))
        return [made[first[tuple(size)]] for size in sizes]

    return classmethod(shared)


class _OptionHashes:
    """``hash`` for torchrec's search loop, which keys every proposal by its options' hashes:
    a ``ShardingOption`` hashes its shards' sizes, offsets, storage, perf and ranks, ~100 us for
    a 128-shard data-parallel option, ~300 options of them in every proposal. The same option
    hashes the same while its shards have no rank (the loop clears them after each partition,
    and nothing in the search changes a shard's storage or perf), so that hash is kept per
    option; anything else is hashed as usual."""

    def __init__(self) -> None:
        from torchrec.distributed.planner.types import ShardingOption

        self.option_type = ShardingOption
        self.memo: dict[int, tuple[Any, int]] = {}

    def __call__(self, obj: Any) -> int:
        if type(obj) is self.option_type and set(map(_rank, obj.shards)) <= {None}:
            hit = self.memo.get(id(obj))
            if hit is None or hit[0] is not obj:
                hit = self.memo[id(obj)] = (obj, hash(obj))  # the option stays referenced: its id is not reused
            return hit[1]
        return hash(obj)


_rank = operator.attrgetter("rank")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off within (reference counting still frees everything that
    is not in a cycle); back on at exit if it was on before."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextlib.contextmanager
def fast_planner_internals() -> Iterator[None]:
    from torchrec.distributed.planner import enumerators, planners
    from torchrec.distributed.planner.estimator import annotations, estimator

    copy_ns = types.SimpleNamespace(**{k: getattr(_copy, k) for k in dir(_copy) if not k.startswith("__")})
    copy_ns.deepcopy = fast_deepcopy
    with _lock:
        saved = (
            annotations._get_annotated_method,
            annotations._get_coefficient_method,
            enumerators.copy,
            planners.copy,
            estimator.get_embedding_perf_sharding_evaluator,
            planners.__dict__.get("hash"),
        )
        perf_cache: dict = {}
        perf_by_object: dict = {}
        get_evaluator = saved[4]
        annotations._get_annotated_method = _memoized(saved[0])
        annotations._get_coefficient_method = _memoized(saved[1])
        enumerators.copy = copy_ns
        planners.copy = copy_ns
        evaluators: dict[tuple[str, bool], _MemoEvaluator] = {}  # asked for once per shard

        def memo_evaluator(sharding_type: str, is_inference: bool = False) -> _MemoEvaluator:
            ev = evaluators.get((sharding_type, is_inference))
            if ev is None:
                ev = _MemoEvaluator(get_evaluator(sharding_type=sharding_type, is_inference=is_inference), perf_cache, perf_by_object)
                evaluators[(sharding_type, is_inference)] = ev
            return ev

        estimator.get_embedding_perf_sharding_evaluator = memo_evaluator
        planners.hash = _OptionHashes()  # the module's name for the builtin, which its search loop calls
        context_type = getattr(estimator, "ShardPerfContext", None)
        build = context_type.__dict__.get("build_shard_perf_contexts") if context_type is not None else None
        if isinstance(build, classmethod):
            context_type.build_shard_perf_contexts = _shared_contexts(build)
        try:
            yield
        finally:
            if isinstance(build, classmethod):
                context_type.build_shard_perf_contexts = build
            (
                annotations._get_annotated_method,
                annotations._get_coefficient_method,
                enumerators.copy,
                planners.copy,
                estimator.get_embedding_perf_sharding_evaluator,
            ) = saved[:5]
            if saved[5] is None:
                del planners.hash
            else:
                planners.hash = saved[5]
