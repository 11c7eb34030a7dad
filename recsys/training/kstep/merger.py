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
from recsys.training.kstep.touched_rows import TouchedRows, union

log = logging.getLogger(__name__)

_SKIP_STATE_KEYS = ("step",)
# a shard whose union of touched rows holds more than this share of its rows is merged whole
WHOLE_SHARD_FRACTION = 0.75


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
    ) -> None:
        """``rows``: ``touched`` (the default) averages only the embedding rows some host looked
        up since the last merge (``recsys.training.kstep.touched_rows``), ``all`` whole shards.
        ``tracking_from_start``: the merger exists before the model's first forward, so it sees
        every row that moves; when False (a hook bound after the first step) the first merge
        takes whole shards."""
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

    # -- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The counters (per rank); checkpoints save them so totals survive a resume."""
        return {
            "merges": self.merges,
            "cross_host_bytes_total": self.cross_host_bytes_total,
            "intra_host_bytes_total": self.intra_host_bytes_total,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.merges = int(state.get("merges", 0))
        self.cross_host_bytes_total = int(state.get("cross_host_bytes_total", 0))
        self.intra_host_bytes_total = int(state.get("intra_host_bytes_total", 0))

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
        rows_of = self._touched_rows(
            [owner for t, rep, owner in items if not rep and owner is not None] + [owner for _, owner in counters if owner is not None]
        )
        by_kind: dict[tuple[bool, torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        by_rows: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for t, rep, owner in items:
            idx = rows_of.get(owner.data_ptr()) if owner is not None and not rep else None
            if idx is not None:
                by_rows[(t.dtype, t.device)].append((t, idx))
            else:
                by_kind[(hierarchical and rep, t.dtype, t.device)].append(t)
        if hierarchical and not self._checked_replicated:
            self._check_replicated([t for (rep, _, _), ts in by_kind.items() if rep for t in ts])
            if self.route != "hierarchical":  # fell back: everything goes flat
                return self.merge()
        t1 = time.perf_counter()
        payload = 0
        # the same collective order on every rank of a host (their shard lists differ): the
        # host-replicated buckets (with their all-gather over host_pg) first, then the shards
        order = sorted(by_kind, key=lambda key: (not key[0], str(key[1]), str(key[2])))
        for split, dtype, device in order:
            ts = by_kind[(split, dtype, device)]
            for bucket in _buckets(ts, self.bucket_bytes):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                payload += self._merge_split(flat) if split else self._merge_whole(flat)
                offset = 0
                for t in bucket:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n
        t2 = time.perf_counter()
        pack = reduce = unpack = 0.0
        # touched rows of the embedding shards (and their state): one packed buffer per dtype
        for dtype, device in sorted(by_rows, key=str):
            pairs = by_rows[(dtype, device)]
            for bucket in _buckets(pairs, self.bucket_bytes, _rows_bytes):
                ta = time.perf_counter()
                flat = torch.cat([t.index_select(0, idx).reshape(-1) for t, idx in bucket])
                tb = time.perf_counter()
                payload += self._merge_whole(flat)
                tc = time.perf_counter()
                offset = 0
                for t, idx in bucket:
                    n = idx.numel() * (t.numel() // max(t.shape[0], 1))
                    t.index_copy_(0, idx, flat[offset : offset + n].view(idx.numel(), *t.shape[1:]))
                    offset += n
                pack, reduce, unpack = pack + tb - ta, reduce + tc - tb, unpack + time.perf_counter() - tc
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

    def _touched_rows(self, owners: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Embedding shard (storage pointer) -> the local rows to average: the union over the hosts
        of the rows looked up since the last merge. Shards without a bitmap, or whose union holds
        most of their rows, are left out (merged whole). Collective over replica_pg when rows are
        tracked; every replica lists the same shards in the same order (the same plan)."""
        self.union_bytes_per_merge = 0
        self.rows_merged = self.rows_tracked = 0
        if self.touched is None or not self.touched.complete:
            return {}
        shards, seen = [], set()
        for owner in owners:
            bm = self.touched.bitmap_of(owner)
            if not self.merge_moments and owner.data_ptr() in self.touched.moves_when_absent:
                bm = None  # absent rows move by each host's own moments: not equal, merge whole
            if bm is not None and owner.data_ptr() not in seen:
                seen.add(owner.data_ptr())
                shards.append((owner.data_ptr(), bm))
        if not shards:
            return {}
        u = union([bm for _, bm in shards], self.pg)
        self.union_bytes_per_merge = u.exchange_bytes
        out = {}
        for (ptr, bm), idx in zip(shards, u.rows):
            n = bm.numel()
            self.rows_tracked += n
            if idx.numel() > WHOLE_SHARD_FRACTION * n:  # gathering most rows costs more than it saves
                self.rows_merged += n
                continue
            self.rows_merged += idx.numel()
            out[ptr] = idx
        return out

    def _merge_whole(self, flat: torch.Tensor) -> int:
        self._all_reduce_avg(flat)
        return flat.numel() * flat.element_size()

    def _merge_split(self, flat: torch.Tensor) -> int:
        """Host-replicated buffer: my 1/R slice across hosts, then all-gather inside the host."""
        n, r = flat.numel(), self.host_size
        chunk = -(-n // r)
        padded = torch.zeros(chunk * r, dtype=flat.dtype, device=flat.device)
        padded[:n] = flat
        parts = list(padded.split(chunk))
        mine = parts[self.host_rank].clone()
        self._all_reduce_avg(mine)
        dist.all_gather(parts, mine, group=self.host_pg)
        flat.copy_(padded[:n])
        self.intra_host_bytes_total += (r - 1) * chunk * flat.element_size()
        return chunk * flat.element_size()

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

    @torch.no_grad()
    def max_divergence(self) -> float:
        """Largest |difference| between replicas over the model's state_dict (re-read through
        DMP, not through the merger's own tensor list, so it also checks that merging wrote to the
        real storage). Collective over replica_pg. Each tensor is first compared by a fingerprint
        of its bits (``_fingerprint``: exact integer sums, independent of reduction order), a few
        numbers per tensor; only tensors whose fingerprints differ are compared element by
        element, so a check of equal replicas costs a pass over the tables, not their bytes
        across hosts (at Criteo's raw sizes, 4 GB through the link)."""
        if self.hosts == 1:
            return 0.0
        tensors = [t for value in self.dmp.state_dict().values() for t in local_tensors(value) if t.is_floating_point() and t.numel()]
        mine = [_fingerprint(t) for t in tensors]
        every: list[Any] = [None] * self.hosts
        dist.all_gather_object(every, mine, group=self.pg)
        worst = torch.zeros(1, dtype=torch.float64, device=collective_device(self.pg))
        for i, t in enumerate(tensors):
            if all(fp[i] == mine[i] for fp in every):
                continue  # the same bits on every replica
            hi, lo = t.detach().clone(), t.detach().clone().neg_()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.pg)
            dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.pg)
            worst = torch.maximum(worst, (hi + lo).abs().max().double().reshape(1))
        return float(worst.item())


_FP_CHUNK = 1 << 20  # elements per exact float64 partial sum (terms < 2^32: sums < 2^52)


def _fingerprint(t: torch.Tensor) -> tuple[int, ...]:
    """Three exact integer sums over a tensor's bits (as 16-bit words): plain, and weighted by
    two functions of the position. Equal tensors give equal fingerprints on any machine and any
    thread count (integer-valued float64 partial sums below 2^53 are exact in any order); a
    differing element changes them unless the differences cancel in all three sums."""
    words = t.detach().contiguous().view(-1).view(torch.uint8)
    words = words[: words.numel() // 2 * 2].view(torch.int16).to(torch.int64) & 0xFFFF
    out = [0, 0, 0]
    for start in range(0, words.numel(), _FP_CHUNK):
        w = words[start : start + _FP_CHUNK].double()
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        out[0] += int(w.sum().item())
        out[1] += int((w * ((pos % 65521) + 1).double()).sum().item())
        out[2] += int((w * ((pos * 40503) % 65536).double()).sum().item())
    return (t.numel(), *out)


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
