"""K-step model merging across hosts (PaddleBox-style); see docs/kstep.md.

Each host trains its own replica (embeddings sharded inside the host, dense data-parallel inside
the host); every k steps `KStepMerger` averages, over `replica_pg` (the ranks holding the same
shard on every host), every dense parameter, every local embedding shard and, with
`merge_moments`, every floating-point optimizer state tensor (Adam exp_avg / exp_avg_sq,
(rowwise) Adagrad momentum). Step counters are not averaged: every host takes the same number of
steps, so they are equal already.

The two-line hook for an existing TorchRec loop (DMP built on the host group):

    merger = KStepMerger(dmp, optimizer, groups.replica_pg, every_k=16)
    ...
    merger.step(step)  # after each optimizer step (TrainPipelineSparseDist.progress)

The all-reduce works in place on the real storage: the embedding shards are the local shards of
the fused optimizer's ShardedTensors, which are views of FBGEMM's weight / momentum buffers.
Tensors are coalesced into flat buffers per dtype (at most `bucket_bytes` each), so a merge is a
handful of collectives, not one per table.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

_SKIP_STATE_KEYS = ("step",)


def _local_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors this rank holds for a parameter / state value (ShardedTensor -> local shards)."""
    if hasattr(value, "local_shards"):  # ShardedTensor
        return [s.tensor for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):  # DTensor
            return [value.to_local()]
        return [value]
    return []


def _params_of(optimizer: Any) -> list[Any]:
    if hasattr(optimizer, "params"):  # torchrec KeyedOptimizer / CombinedOptimizer
        return list(optimizer.params.values())
    return [p for g in optimizer.param_groups for p in g["params"]]


class KStepMerger:
    def __init__(
        self,
        dmp: nn.Module,
        optimizer: Any,
        replica_pg: dist.ProcessGroup | None,
        every_k: int,
        merge_moments: bool = False,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        if every_k <= 0:
            raise ValueError(f"every_k must be positive, got {every_k}")
        self.dmp = dmp
        self.optimizer = optimizer
        self.pg = replica_pg
        self.every_k = every_k
        self.merge_moments = merge_moments
        self.bucket_bytes = bucket_bytes
        self.hosts = dist.get_world_size(replica_pg) if replica_pg is not None else 1
        self.merges = 0
        self.cross_host_bytes_total = 0  # bytes this rank sent across hosts (ring all-reduce model)
        self.payload_bytes_per_merge = 0  # bytes this rank averages per merge
        self._avg_ok = True

    # -- what gets merged ------------------------------------------------------------------------
    def _param_tensors(self) -> list[torch.Tensor]:
        values = _params_of(self.optimizer)
        fused = getattr(self.dmp, "fused_optimizer", None)
        if fused is not None and fused is not self.optimizer:
            values += list(fused.params.values())
        return [t for v in values for t in _local_tensors(v)]

    def _state_tensors(self) -> list[torch.Tensor]:
        out = []
        opts = [self.optimizer]
        fused = getattr(self.dmp, "fused_optimizer", None)
        if fused is not None and fused is not self.optimizer:
            opts.append(fused)
        for opt in opts:
            for state in opt.state.values():
                for key, value in state.items():
                    if key in _SKIP_STATE_KEYS:
                        continue
                    out += [t for t in _local_tensors(value) if t.is_floating_point()]
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a merge averages, without duplicates (same storage, offset and shape)."""
        seen, out = set(), []
        for t in self._param_tensors() + (self._state_tensors() if self.merge_moments else []):
            if t.numel() == 0:
                continue
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if key not in seen:
                seen.add(key)
                out.append(t)
        return out

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
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        for t in self.tensors():
            by_dtype[(t.dtype, t.device)].append(t)
        payload = 0
        for (dtype, device), ts in by_dtype.items():
            for bucket in _buckets(ts, self.bucket_bytes):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                self._all_reduce_avg(flat)
                offset = 0
                for t in bucket:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n
                payload += flat.numel() * flat.element_size()
        self.payload_bytes_per_merge = payload
        self.cross_host_bytes_total += int(2 * (self.hosts - 1) / self.hosts * payload)
        self.merges += 1

    @torch.no_grad()
    def max_divergence(self) -> float:
        """Largest |difference| between replicas over the model's state_dict (re-read through
        DMP, not through the merger's own tensor list, so it also checks that merging wrote to the
        real storage). Collective over replica_pg."""
        if self.hosts == 1:
            return 0.0
        worst = torch.zeros(1, dtype=torch.float64)
        for value in self.dmp.state_dict().values():
            for t in _local_tensors(value):
                if not t.is_floating_point() or t.numel() == 0:
                    continue
                hi, lo = t.detach().clone(), t.detach().clone().neg_()
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.pg)
                dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.pg)
                worst = torch.maximum(worst, (hi + lo).abs().max().double().reshape(1))
        return float(worst.item())


def _buckets(ts: Iterable[torch.Tensor], cap: int) -> Iterable[list[torch.Tensor]]:
    bucket, size = [], 0
    for t in ts:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > cap:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket
