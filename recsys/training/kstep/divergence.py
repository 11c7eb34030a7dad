"""How far apart the replicas of a k-step run are: the largest |difference| of any value of the
model between hosts, and the bit fingerprint that makes checking equal replicas cheap. Separate
from the merger: the check re-reads the model through DMP's ``state_dict()``, not through the
merger's own tensor list, so it also catches a merge that did not write to the real storage."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys.training.distributed import collective_device, local_tensors

_FP_CHUNK = 1 << 20  # elements per exact float64 partial sum (terms < 2^32: sums < 2^52)


@torch.no_grad()
def max_divergence(dmp: nn.Module, replica_pg: dist.ProcessGroup | None, hosts: int) -> float:
    """Largest |difference| between replicas over the model's state_dict. Collective over
    ``replica_pg``. Each tensor is first compared by a fingerprint of its bits (``fingerprint``:
    exact integer sums, independent of reduction order), a few numbers per tensor; only tensors
    whose fingerprints differ are compared element by element, so a check of equal replicas
    costs a pass over the tables, not their bytes across hosts (at Criteo's raw sizes, 4 GB
    through the link)."""
    if hosts == 1:
        return 0.0
    tensors = [t for value in dmp.state_dict().values() for t in local_tensors(value) if t.is_floating_point() and t.numel()]
    mine = [fingerprint(t) for t in tensors]
    every: list[Any] = [None] * hosts
    dist.all_gather_object(every, mine, group=replica_pg)
    worst = torch.zeros(1, dtype=torch.float64, device=collective_device(replica_pg))
    for i, t in enumerate(tensors):
        if all(fp[i] == mine[i] for fp in every):
            continue  # the same bits on every replica
        hi, lo = t.detach().clone(), t.detach().clone().neg_()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=replica_pg)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=replica_pg)
        worst = torch.maximum(worst, (hi + lo).abs().max().double().reshape(1))
    return float(worst.item())


def fingerprint(t: torch.Tensor) -> tuple[int, ...]:
    """Three exact integer sums over a tensor's bits (as 16-bit words): plain, and weighted by
    two functions of the position. Equal tensors give equal fingerprints on any machine and any
    thread count (integer-valued float64 partial sums below 2^53 are exact in any order); a
    differing element changes them unless the differences cancel in all three sums. Memory: a
    chunk's words at a time (widening a whole raw-size shard to int64 at once took 4x its bytes)."""
    words = t.detach().contiguous().view(-1).view(torch.uint8)
    words = words[: words.numel() // 2 * 2].view(torch.int16)  # a view: widened a chunk at a time
    out = [0, 0, 0]
    for start in range(0, words.numel(), _FP_CHUNK):
        w = (words[start : start + _FP_CHUNK].to(torch.int64) & 0xFFFF).double()
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        out[0] += int(w.sum().item())
        out[1] += int((w * ((pos % 65521) + 1).double()).sum().item())
        out[2] += int((w * ((pos * 40503) % 65536).double()).sum().item())
    return (t.numel(), *out)
