"""K-step model merging across hosts (PaddleBox-style); see docs/kstep.md.

Each host trains its own replica (embeddings sharded inside the host, dense data-parallel inside
the host); every k steps `KStepMerger` averages, over `replica_pg` (the ranks holding the same
shard on every host), every dense parameter, every local embedding shard and, with
`merge_moments`, every floating-point optimizer state tensor (Adam exp_avg / exp_avg_sq,
(rowwise) Adagrad momentum). Step counters are not averaged: every host takes the same number of
steps, so they are equal already.

The two-line hook for an existing TorchRec loop is ``KStepMergeHook``
(recsys/training/kstep/merge_hook.py, docs/dropin.md). ``KStepMerger`` below is the engine, for
loops that build their own groups (recsys/training/job.py):

    merger = KStepMerger(dmp, optimizer, groups.replica_pg, every_k=16, host_pg=groups.host_pg)
    merger.step(step)  # after each optimizer step, with the 1-based step number

Which embedding rows (``rows=``): ``touched`` (the default) averages only the rows some host
looked up since the last merge, with their optimizer state, agreed in one all-gather of row lists
or bitmaps (``recsys.training.kstep.touched_rows``: why every other row is equal on every host
already); a shard whose union holds most of its rows goes whole. ``all``: whole shards. Both
end at the same model (tests/integration/training/test_kstep_merge.py); the bytes of a touched-row merge follow the
rows the batches touched, not the table sizes.

``outer="nesterov"`` (DiLoCo's outer step on the parameters) and ``compress="bf16"`` (bf16 deltas
with error feedback) keep per-tensor state between merges: ``recsys.training.kstep.outer``.

The all-reduce works in place on the real storage: the embedding shards are the local shards of
the fused optimizer's ShardedTensors, which are views of FBGEMM's weight / momentum buffers.
Tensors are coalesced into flat buffers per dtype (at most `bucket_bytes` each), so a merge is a
handful of collectives, not one per table.

Routes (`route=`):
- "flat": every tensor is all-reduced over replica_pg. The dense parameters (and dense moments)
  are the same on every rank of a host (DDP), so the R replica groups of a host all send the
  same dense bytes across hosts: R times more than needed.
- "hierarchical" (default when `host_pg` has more than one rank): embedding shards (distinct per
  rank) go as in "flat"; for the host-replicated tensors rank r of the host takes the r-th of R
  slices of the flat buffer (no communication: its copy is the host's copy), all-reduces only that
  slice across hosts over replica_pg, and the slices are all-gathered inside the host. This is
  reduce-scatter / cross-host all-reduce / all-gather with the reduce-scatter free because the
  host's copies are already equal. Cross-host bytes of the dense part: 1/R of "flat". The
  results are bitwise those of "flat" (same elements averaged over the same H values). At the
  first merge the host copies are checked to be equal (checksums over host_pg); if they are not
  (a loop without DDP), the merger falls back to "flat" with a warning.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from recsys.optim.cowclip.catchup import catch_up_all_tables
from recsys.training.distributed import collective_device, local_tensors
from recsys.training.kstep.divergence import max_divergence
from recsys.training.kstep.outer import Compress, OuterKind, OuterOptimizer, Part
from recsys.training.kstep.touched_rows import WHOLE_SHARD_FRACTION, TouchedRows, rows_to_merge

log = logging.getLogger(__name__)

_SKIP_STATE_KEYS = ("step",)


def _params_of(optimizer: Any) -> list[Any]:
    if hasattr(optimizer, "params"):  # torchrec KeyedOptimizer / CombinedOptimizer
        return list(optimizer.params.values())
    return [p for g in optimizer.param_groups for p in g["params"]]


class KStepMerger:
    """Averages a DMP model's replicas (and optionally optimizer moments) over ``replica_pg``
    every ``every_k`` steps (module docstring). For a user's loop, ``KStepMergeHook`` builds the
    groups and this object; the project's loop builds them itself.

    Example (groups from ``recsys.training.kstep.host_groups.build_host_groups``)::

        merger = KStepMerger(dmp, optimizer, groups.replica_pg, every_k=16, host_pg=groups.host_pg)
        for step in range(1, steps + 1):
            pipeline.progress(batches)
            merger.step(step)
    """

    def __init__(
        self,
        dmp: nn.Module,
        optimizer: Any,
        replica_pg: dist.ProcessGroup | None,
        every_k: int,
        merge_moments: bool = False,
        bucket_bytes: int = 64 << 20,
        host_pg: dist.ProcessGroup | None = None,
        route: str = "auto",
        rows: str = "touched",
        tracking_from_start: bool = True,
        *,
        outer: OuterKind = "average",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compress: Compress = "none",
    ) -> None:
        """``rows``: ``touched`` (the default) averages only the embedding rows some host looked
        up since the last merge (``recsys.training.kstep.touched_rows``), ``all`` whole shards.
        ``tracking_from_start``: the merger exists before the model's first forward, so it sees
        every row that moves; when False (a hook bound after the first step) the first merge
        takes whole shards. ``outer`` / ``outer_lr`` / ``outer_momentum``: the parameters'
        outer step (``nesterov``: DiLoCo's, ``average``: none); ``compress="bf16"``: parameters
        travel as bf16 deltas from the last merge with error feedback
        (``recsys.training.kstep.outer``; optimizer moments stay averaged in their dtype).
        With either, a tracked shard always goes by its merged rows (lazy: the rows nobody
        touched keep their value, momentum and residual), never whole."""
        if every_k <= 0:
            raise ValueError(f"every_k must be positive, got {every_k}")
        if route not in ("auto", "flat", "hierarchical"):
            raise ValueError(f"route must be auto, flat or hierarchical, got {route!r}")
        if rows not in ("touched", "all"):
            raise ValueError(f"rows must be touched or all, got {rows!r}")
        host_size = dist.get_world_size(host_pg) if host_pg is not None else 1
        if route == "hierarchical" and host_size == 1:
            route = "flat"  # one rank per host: nothing to split
        if route == "auto":
            route = "hierarchical" if host_size > 1 else "flat"
        self.route = route
        self.host_pg = host_pg
        self.host_size = host_size
        self.host_rank = dist.get_rank(host_pg) if host_pg is not None else 0
        self._checked_replicated = False
        self.dmp = dmp
        self.optimizer = optimizer
        self.pg = replica_pg
        self.every_k = every_k
        self.merge_moments = merge_moments
        self.bucket_bytes = bucket_bytes
        self.hosts = dist.get_world_size(replica_pg) if replica_pg is not None else 1
        self.merges = 0
        self.cross_host_bytes_total = 0  # bytes this rank sent across hosts (ring all-reduce model)
        self.payload_bytes_per_merge = 0  # bytes this rank averages across hosts per merge
        self.intra_host_bytes_total = 0  # hierarchical route: all-gather bytes inside the host (model)
        self._avg_ok = True
        self.rows = rows
        self.touched = TouchedRows(dmp, complete=tracking_from_start) if rows == "touched" and self.hosts > 1 else None
        # the last merge's embedding rows: averaged / held in tracked tables; bytes sent to agree on them
        self.rows_merged = 0
        self.rows_tracked = 0
        self.union_bytes_per_merge = 0
        # merge time by phase, summed over merges: catch-up, the union of touched rows; whole
        # tensors (dense part, untracked shards); touched rows packed, all-reduced, unpacked; counters
        self.seconds: dict[str, float] = {}
        self.outer = OuterOptimizer(outer, outer_lr, outer_momentum, compress, self.hosts)
        if self.outer.active and self.touched is not None:  # lazy anchors of the shards merged by rows
            self.touched.keep_first_values([t for t, rep, _ in self._param_tensors() if not rep])

    # -- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters (per rank); checkpoints save them so totals survive a resume. With an
        outer step or bf16 deltas also this rank's outer momentum and residuals: checkpoints are
        taken at merges, where the anchors are the model itself."""
        out: dict[str, Any] = {
            "merges": self.merges,
            "cross_host_bytes_total": self.cross_host_bytes_total,
            "intra_host_bytes_total": self.intra_host_bytes_total,
        }
        if self.outer.active:
            out["outer"] = self.outer.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Call after the model was loaded from a checkpoint taken at a merge: with an outer step
        or bf16 deltas the anchors are taken from the model now."""
        self.merges = int(state.get("merges", 0))
        self.cross_host_bytes_total = int(state.get("cross_host_bytes_total", 0))
        self.intra_host_bytes_total = int(state.get("intra_host_bytes_total", 0))
        if self.outer.active or state.get("outer"):
            with torch.no_grad():
                self.outer.resume(self._anchor_tensors() if self.outer.active else [], state.get("outer"))

    # -- what gets merged ------------------------------------------------------------------------
    def _optimizers(self) -> list[Any]:
        fused = getattr(self.dmp, "fused_optimizer", None)
        return [self.optimizer] + ([fused] if fused is not None and fused is not self.optimizer else [])

    def _param_tensors(self) -> list[tuple[torch.Tensor, bool, torch.Tensor | None]]:
        """(tensor, host-replicated, the embedding shard whose rows it holds or None)."""
        values = _params_of(self.optimizer)
        fused = getattr(self.dmp, "fused_optimizer", None)
        if fused is not None and fused is not self.optimizer:
            values += list(fused.params.values())
        out = []
        for v in values:
            rep = _host_replicated(v)
            out += [(t, rep, None if rep else t) for t in local_tensors(v)]
        return out

    def _state_tensors(self, floating: bool = True) -> list[tuple[torch.Tensor, bool, torch.Tensor | None]]:
        """The optimizers' state tensors (floating, or the integer counters), each with the
        embedding shard whose rows it follows (a state shard with the shard's row count)."""
        fused = getattr(self.dmp, "fused_optimizer", None)
        out = []
        for opt in self._optimizers() if floating else ([fused] if fused is not None else []):
            for param, state in opt.state.items():
                shards = [] if _host_replicated(param) else local_tensors(param)
                for key, value in state.items():
                    if key in _SKIP_STATE_KEYS:
                        continue
                    rep = _host_replicated(value)
                    ts = local_tensors(value)
                    owners: list[torch.Tensor | None] = [None] * len(ts)
                    if not rep and len(ts) == len(shards):
                        owners = [s if t.dim() >= 1 and s.dim() >= 1 and t.shape[0] == s.shape[0] else None for t, s in zip(ts, shards)]
                    for t, owner in zip(ts, owners):
                        if t.is_floating_point() == floating and t.dtype != torch.bool:
                            out.append((t, rep, owner))
        return out

    def _counter_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Integer state of the fused (embedding) optimizer: not averaged, max-reduced."""
        out, seen = [], set()
        for t, _, owner in self._state_tensors(floating=False):
            k = (t.data_ptr(), tuple(t.shape))
            if t.numel() and k not in seen:
                seen.add(k)
                out.append((t, owner))
        return out

    def _classified_rows(self) -> list[tuple[torch.Tensor, bool, torch.Tensor | None]]:
        seen, out = set(), []
        for t, rep, owner in self._param_tensors() + (self._state_tensors() if self.merge_moments else []):
            if t.numel() == 0:
                continue
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if key not in seen:
                seen.add(key)
                out.append((t, rep, owner))
        return out

    def classified(self) -> list[tuple[torch.Tensor, bool]]:
        """(tensor, replicated inside the host) for every tensor a merge averages, without
        duplicates (same storage, offset and shape). Replicated: plain tensors (the dense
        parameters and their optimizer state, kept equal inside the host by DDP); not
        replicated: local shards of ShardedTensors / DTensors (embedding shards, their state)."""
        return [(t, rep) for t, rep, _ in self._classified_rows()]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a merge averages, without duplicates (same storage, offset and shape)."""
        return [t for t, _ in self.classified()]

    # -- merging ---------------------------------------------------------------------------------
    def should_merge(self, global_step: int) -> bool:
        return global_step > 0 and global_step % self.every_k == 0

    def step(self, global_step: int) -> bool:
        """Call after each optimizer step with the 1-based step number; merges every k steps."""
        if not self.should_merge(global_step):
            return False
        self.merge()
        return True

    def _all_reduce_avg(self, buf: torch.Tensor) -> None:
        if self._avg_ok:
            try:
                dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=self.pg)
                return
            except (RuntimeError, ValueError):  # a backend without AVG
                self._avg_ok = False
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.pg)
        buf.div_(self.hosts)

    @torch.no_grad()
    def merge(self) -> None:
        """Averages now (collective over replica_pg: every replica must call it at the same step)."""
        if self.hosts == 1:
            return
        # CowClip tables with the reference's semantics by catch-up (embedding_l2_scope=catchup):
        # rows are current at different steps on different hosts; bring every row to this step
        # first, so the average is of the dense reference's replicas (O(table), once per merge)
        t0 = time.perf_counter()
        catch_up_all_tables(self.dmp)
        t_caught = time.perf_counter()
        hierarchical = self.route == "hierarchical"
        items = self._classified_rows()
        counters = self._counter_tensors() if self.merge_moments else []
        rows_of = self._rows_to_merge(
            [owner for t, rep, owner in items if not rep and owner is not None] + [owner for _, owner in counters if owner is not None]
        )
        keys = self._param_keys()
        by_kind, by_rows = self._grouped(items, rows_of, keys)
        if hierarchical and not self._checked_replicated:
            self._check_replicated([t for (rep, *_), ts in by_kind.items() if rep for t in ts])
            if self.route != "hierarchical":  # fell back: everything goes flat
                return self.merge()
        t1 = time.perf_counter()
        payload = 0
        # the same collective order on every rank of a host (their shard lists differ): the
        # host-replicated buckets (with their all-gather over host_pg) first, then the shards
        for split, dtype, device, outer in sorted(by_kind, key=_kind_order):
            ts = by_kind[(split, dtype, device, outer)]
            for b, bucket in enumerate(_buckets(ts, self.bucket_bytes)):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                if not outer:
                    payload += self._merge_split(flat) if split else self._merge_whole(flat)
                elif split:  # the outer step on this rank's slice, before the all-gather
                    key = _split_key(dtype, device, b)
                    payload += self._merge_split(flat, lambda mine, key=key: self._outer_merge(mine, [Part(key, mine)]))
                else:
                    payload += self._outer_merge(flat, [Part(keys[_tensor_key(t)], t, before=self._before(t)) for t in bucket])
                offset = 0
                for t in bucket:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n
        t2 = time.perf_counter()
        pack = reduce = unpack = 0.0
        # touched rows of the embedding shards (and their state): one packed buffer per dtype
        for dtype, device, outer in sorted(by_rows, key=str):
            pairs = by_rows[(dtype, device, outer)]
            for bucket in _buckets(pairs, self.bucket_bytes, _rows_bytes):
                ta = time.perf_counter()
                flat = torch.cat([t.index_select(0, idx).reshape(-1) for t, idx in bucket])
                tb = time.perf_counter()
                payload += (
                    self._outer_merge(flat, [Part(keys[_tensor_key(t)], t, idx, self._before(t)) for t, idx in bucket])
                    if outer
                    else self._merge_whole(flat)
                )
                tc = time.perf_counter()
                offset = 0
                for t, idx in bucket:
                    n = idx.numel() * (t.numel() // max(t.shape[0], 1))
                    t.index_copy_(0, idx, flat[offset : offset + n].view(idx.numel(), *t.shape[1:]))
                    offset += n
                pack, reduce, unpack = pack + tb - ta, reduce + tc - tb, unpack + time.perf_counter() - tc
                for t, _ in bucket if outer and self.touched is not None else []:
                    if t.data_ptr() in self.touched.moves_when_absent:  # absent rows moved by the catch-up:
                        self.outer.refresh_anchor(keys[_tensor_key(t)], t)  # the anchor is the model now
        if self.merge_moments:  # integer per-row counters (CowClip-Adam's row_step): the largest
            for t, owner in counters:  # count, so bias correction agrees on every host
                idx = rows_of.get(owner.data_ptr()) if owner is not None else None
                part = t if idx is None else t.index_select(0, idx)
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=self.pg)
                if idx is not None:
                    t.index_copy_(0, idx, part)
                payload += part.numel() * part.element_size()
        if self.touched is not None:
            self.touched.reset()
        t3 = time.perf_counter()
        for key, seconds in (
            ("catch_up", t_caught - t0),
            ("union", t1 - t_caught),
            ("whole_tensors", t2 - t1),
            ("pack_rows", pack),
            ("all_reduce_rows", reduce),
            ("unpack_rows", unpack),
            ("counters", t3 - t2 - pack - reduce - unpack),
        ):
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.payload_bytes_per_merge = payload
        self.cross_host_bytes_total += int(2 * (self.hosts - 1) / self.hosts * payload) + self.union_bytes_per_merge
        self.merges += 1

    def _rows_to_merge(self, owners: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Embedding shard (storage pointer) -> the local rows to average (``rows_to_merge``);
        with an outer step or bf16 deltas never a whole tracked shard (the update is lazy)."""
        if self.touched is None or not self.touched.complete:
            self.union_bytes_per_merge = self.rows_merged = self.rows_tracked = 0
            return {}
        sel = rows_to_merge(
            self.touched, owners, self.pg, self.merge_moments, whole_fraction=None if self.outer.active else WHOLE_SHARD_FRACTION
        )
        self.union_bytes_per_merge, self.rows_merged, self.rows_tracked = sel.exchange_bytes, sel.merged, sel.tracked
        return sel.rows

    def _before(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For an embedding shard with a lazy anchor: its rows this replica changed since the last
        merge and their values before (``TouchedRows.first_values``); None otherwise."""
        return self.touched.first_values(t) if self.touched is not None and self.outer.active else None

    def _merge_whole(self, flat: torch.Tensor) -> int:
        self._all_reduce_avg(flat)
        return flat.numel() * flat.element_size()

    def _outer_merge(self, flat: torch.Tensor, parts: list[Part]) -> int:
        def total(buf: torch.Tensor) -> None:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.pg)

        return self.outer.merge(flat, parts, self._all_reduce_avg, total)

    def _param_keys(self) -> dict[tuple[Any, ...], str]:
        """The outer state's key of each parameter tensor (its place in the parameter list, the
        same on every replica of a plan); empty when the merge keeps no outer state."""
        if not self.outer.active:
            return {}
        keys: dict[tuple[Any, ...], str] = {}
        for t, _, _ in self._param_tensors():
            keys.setdefault(_tensor_key(t), f"t{len(keys)}")
        return keys

    def _grouped(
        self, items: list[tuple[torch.Tensor, bool, torch.Tensor | None]], rows_of: dict[int, torch.Tensor], keys: dict
    ) -> tuple[dict, dict]:
        """The tensors of a merge by (split, dtype, device, outer step) and the row-merged ones
        by (dtype, device, outer step); the outer step applies to the parameters in ``keys``."""
        by_kind: dict[tuple[bool, torch.dtype, torch.device, bool], list[torch.Tensor]] = defaultdict(list)
        by_rows: dict[tuple[torch.dtype, torch.device, bool], list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for t, rep, owner in items:
            idx = rows_of.get(owner.data_ptr()) if owner is not None and not rep else None
            outer = _tensor_key(t) in keys
            if idx is not None:
                by_rows[(t.dtype, t.device, outer)].append((t, idx))
            else:
                by_kind[(self.route == "hierarchical" and rep, t.dtype, t.device, outer)].append(t)
        return by_kind, by_rows

    def _anchor_tensors(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(key, the tensor its anchor is now, lazy) for every parameter a merge takes the outer
        step on: whole tensors, and on the hierarchical route this rank's slice of each
        host-replicated bucket, cut as ``merge`` cuts it."""
        keys = self._param_keys()
        by_kind, _ = self._grouped(self._classified_rows(), {}, keys)
        out = []
        for split, dtype, device, outer in sorted(by_kind, key=_kind_order):
            for b, bucket in enumerate(_buckets(by_kind[(split, dtype, device, outer)], self.bucket_bytes)):
                if outer and split:
                    mine = self._host_slices(torch.cat([t.reshape(-1) for t in bucket]))[self.host_rank]
                    out.append((_split_key(dtype, device, b), mine, False))
                elif outer:
                    out += [(keys[_tensor_key(t)], t, self._before(t) is not None) for t in bucket]
        return out

    def _merge_split(self, flat: torch.Tensor, reduce: Any = None) -> int:
        """Host-replicated buffer: my 1/R slice across hosts (``reduce``: merges the slice in
        place, returns the bytes sent; default the plain average), then all-gather inside the host."""
        parts = self._host_slices(flat)
        mine = parts[self.host_rank].clone()
        sent = (reduce or self._merge_whole)(mine)
        dist.all_gather(parts, mine, group=self.host_pg)
        flat.copy_(torch.cat(parts)[: flat.numel()])
        self.intra_host_bytes_total += (self.host_size - 1) * mine.numel() * flat.element_size()
        return sent

    def _host_slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` zero-padded and cut in R equal slices, one per rank of the host."""
        chunk = -(-flat.numel() // self.host_size)
        padded = torch.zeros(chunk * self.host_size, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        return list(padded.split(chunk))

    def _check_replicated(self, ts: list[torch.Tensor]) -> None:
        """The hierarchical route relies on the host's copies of the dense tensors being equal."""
        self._checked_replicated = True
        sums = torch.tensor(
            [[float(t.double().sum()), float(t.double().abs().sum())] for t in ts] or [[0.0, 0.0]],
            dtype=torch.float64,
            device=collective_device(self.pg),
        )
        hi, lo = sums.clone(), sums.neg()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.host_pg)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.host_pg)
        differ = torch.tensor([0.0 if torch.equal(hi, -lo) else 1.0], device=sums.device)
        dist.all_reduce(differ, op=dist.ReduceOp.MAX, group=self.pg)  # every host decides the same
        if differ.item() > 0:
            log.warning("k-step merge: dense tensors differ inside a host (no DDP?): using the flat route")
            self.route = "flat"

    def max_divergence(self) -> float:
        """Largest |difference| between the replicas (``recsys.training.kstep.divergence``).
        Collective over replica_pg."""
        return max_divergence(self.dmp, self.pg, self.hosts)


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _split_key(dtype: torch.dtype, device: torch.device, bucket: int) -> str:
    return f"slice:{dtype}:{device}:{bucket}"


def _kind_order(key: tuple[bool, torch.dtype, torch.device, bool]) -> tuple[Any, ...]:
    split, dtype, device, outer = key
    return (not split, str(dtype), str(device), outer)


def _host_replicated(value: Any) -> bool:
    """Plain tensors are the same on every rank of a host (dense params under DDP, their state);
    ShardedTensors / DTensors are this rank's part of something sharded."""
    return isinstance(value, torch.Tensor) and not hasattr(value, "local_shards") and not hasattr(value, "to_local")


def _rows_bytes(pair: tuple[torch.Tensor, torch.Tensor]) -> int:
    t, idx = pair
    return idx.numel() * (t.numel() // max(t.shape[0], 1)) * t.element_size()


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(ts: Iterable[Any], cap: int, size_of: Any = _tensor_bytes) -> Iterable[list[Any]]:
    bucket, size = [], 0
    for t in ts:
        nbytes = size_of(t)
        if bucket and size + nbytes > cap:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket
