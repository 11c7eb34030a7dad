"""Cross-rank part of CowClip for column-wise and data-parallel tables.

CowClip's clip ``r * cnt_k * max(||w_k||, zeta')`` needs, per row of the batch, the count over
the *global* batch and the norms of the *full* row. Table-wise, row-wise and table-row-wise
shards see both locally (after torchrec's input all-to-all a shard gets every sample touching
its rows, with whole rows), so they update in backward. Two sharding types do not:

* column-wise (and table-column-wise): every column shard sees the same ids and the same samples
  (so ``cnt`` is local), but only its columns of ``w`` and ``g``. The holders sum partial squared
  norms; each then scales its own columns by the same factor.
* data-parallel: every replica sees only its slice of the batch. Replicas union their rows, sum
  gradients and counts, divide gradients by the world size (the global-batch mean, as DDP would),
  and all apply the identical update, so replicas stay bit-equal.

Both run inside backward, in the lookup's exchange node after all of its kernels staged their
rows, on every rank of the sharding's process group at the same point of the collective order
(``recsys.optim.cowclip.sharder`` says why that order holds). Every rank knows, from the plan,
which tables take part, so ranks that hold none still join.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from recsys.optim.cowclip.tbe import CowClipAdamTBE
from recsys.optim.cowclip.staging import StagedRows


@dataclass(frozen=True)
class ExchangeTable:
    """A CowClip table of one sharding type, known identically on every rank (from the plan)."""

    name: str
    num_embeddings: int
    embedding_dim: int


def _local_tables(tbes: list[tuple[CowClipAdamTBE, list[str]]]) -> dict[str, list[tuple[CowClipAdamTBE, StagedRows]]]:
    """Staged rows of this rank, grouped by table name (several column shards may share one)."""
    out: dict[str, list[tuple[CowClipAdamTBE, StagedRows]]] = {}
    for tbe, names in tbes:
        for s in tbe.take_staged():
            out.setdefault(names[s.table], []).append((tbe, s))
    return out


@torch.no_grad()
def column_wise_step(tables: list[ExchangeTable], tbes: list[tuple[CowClipAdamTBE, list[str]]], pg: dist.ProcessGroup | None) -> None:
    """Sum the partial squared norms of each CW table's batch rows over its column shards, then
    update every local shard with the full-row clip. Two all-reduces over ``pg``."""
    local = _local_tables(tbes)
    order = {t.name: i for i, t in enumerate(tables)}
    unknown = set(local) - set(order)
    if unknown:
        raise RuntimeError(f"CowClip column-wise exchange: tables {sorted(unknown)} are not in the plan's list")
    device = next((tbe.weights.device for tbe, _ in tbes), torch.device("cpu"))
    sizes = torch.zeros(len(tables), dtype=torch.long, device=device)
    partial: dict[str, tuple[Tensor, Tensor, Tensor, list]] = {}
    for name, items in local.items():
        rows, counts = items[0][1].rows, items[0][1].counts
        wsq = torch.zeros(rows.numel(), dtype=torch.float32, device=device)
        gsq = torch.zeros_like(wsq)
        prepared = []
        for tbe, s in items:
            if not torch.equal(s.rows, rows):
                raise RuntimeError(f"CowClip column-wise exchange: shards of table {name} saw different ids")
            w = tbe._view(tbe.weights, s.table).index_select(0, s.rows)
            g = s.grads.to(w.dtype)
            if tbe.hyper.l2:
                g = g + (2 * tbe.hyper.l2) * w  # each column lives on exactly one shard: add L2 here, once
            wsq += (w * w).sum(1)
            gsq += (g * g).sum(1)
            prepared.append((tbe, s, g))
        sizes[order[name]] = rows.numel()
        partial[name] = (rows, counts, torch.stack([wsq, gsq], 1), prepared)
    if pg is not None and dist.get_world_size(pg) > 1:
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=pg)
    starts = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    if total == 0:
        return
    buf = torch.zeros(total, 2, dtype=torch.float32, device=device)
    for name, (rows, _, sq, _) in partial.items():
        i = order[name]
        if rows.numel() != int(sizes[i]):
            raise RuntimeError(f"CowClip column-wise exchange: shards of table {name} saw different batches")
        s0 = int(starts[i])
        buf[s0 : s0 + rows.numel()] = sq
    if pg is not None and dist.get_world_size(pg) > 1:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=pg)
    for name, (rows, _counts, _, prepared) in partial.items():
        i = order[name]
        s0 = int(starts[i])
        full = buf[s0 : s0 + rows.numel()]
        for tbe, s, g in prepared:
            tbe.apply_rows(s.table, s.rows, g, s.counts, wsq=full[:, 0], gsq=full[:, 1], add_l2=False)


@torch.no_grad()
def data_parallel_step(tables: list[ExchangeTable], tbes: list[tuple[CowClipAdamTBE, list[str]]], pg: dist.ProcessGroup | None) -> None:
    """Merge the replicas' batch rows of every DP table (union of ids, summed gradients / W and
    summed counts) and apply the same update on every replica."""
    local = _local_tables(tbes)
    world = dist.get_world_size(pg) if pg is not None else 1
    device = next((tbe.weights.device for tbe, _ in tbes), torch.device("cpu"))
    row_base = torch.tensor([0] + [t.num_embeddings for t in tables], dtype=torch.long).cumsum(0).tolist()
    # this rank's rows, grads (+ count column), linearised over the DP tables
    owner = {name: (tbe, lt) for tbe, tnames in tbes for lt, name in enumerate(tnames)}
    ids, payload = [], []
    for i, t in enumerate(tables):
        items = local.get(t.name, [])
        if len(items) > 1:
            raise RuntimeError(f"CowClip data-parallel table {t.name} appears twice in one rank's kernels")
        if items:
            s = items[0][1]
            ids.append(s.rows + row_base[i])
            payload.append(torch.cat([s.grads.float(), s.counts.float().unsqueeze(1)], 1))
        else:
            payload.append(torch.zeros(0, t.embedding_dim + 1, device=device))
    my_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long, device=device)
    if world > 1:
        n = torch.tensor([my_ids.numel()], dtype=torch.long, device=device)
        ns = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(ns, n, group=pg)
        ns_l = [int(x) for x in ns]
        pad = max(ns_l)
        mine = torch.full((pad,), -1, dtype=torch.long, device=device)
        mine[: my_ids.numel()] = my_ids
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=pg)
        union = torch.unique(torch.cat([g[:k] for g, k in zip(gathered, ns_l)]), sorted=True)
    else:
        union = my_ids
    # per table: its slice of the union, and this rank's contribution scattered into it
    bounds = torch.searchsorted(union, torch.tensor(row_base, dtype=torch.long, device=device)).tolist()
    flat_parts, spans = [], []
    for i, t in enumerate(tables):
        u = union[bounds[i] : bounds[i + 1]] - row_base[i]
        block = torch.zeros(u.numel(), t.embedding_dim + 1, dtype=torch.float32, device=device)
        if payload[i].numel():
            s = local[t.name][0][1]
            block.index_copy_(0, torch.searchsorted(u, s.rows), payload[i])
        flat_parts.append(block.reshape(-1))
        spans.append(u)
    flat = torch.cat(flat_parts) if flat_parts else torch.zeros(0, device=device)
    if world > 1 and flat.numel():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
    off = 0
    for i, t in enumerate(tables):
        u = spans[i]
        k = u.numel() * (t.embedding_dim + 1)
        block = flat[off : off + k].view(u.numel(), t.embedding_dim + 1)
        off += k
        if u.numel() == 0:
            continue
        if t.name not in owner:
            raise RuntimeError(f"CowClip data-parallel table {t.name} has no local replica on this rank")
        tbe, lt = owner[t.name]
        g = block[:, :-1] / world
        counts = block[:, -1].round().long()
        tbe.apply_rows(lt, u, g, counts, add_l2=True)
