"""Which embedding rows moved since the last k-step merge, and their union across hosts.

A merge need only average the rows some host touched since the last merge: every other row was
equal on every host after that merge (the merge made it so) and has not moved since on any host.
This holds for every optimizer that updates only the rows of the batch (FBGEMM's fused ones,
lazy Adam) and for CowClip's catch-up (``update_scope="catchup"``) when the moments are merged
too: a row nobody looked up is advanced by the same deterministic catch-up from the same state
over the same steps on every host, bit for bit (``tests/integration/training/test_kstep_merge.py`` checks both
against whole-shard merges). With unmerged moments an absent row's catch-up reads each host's
own moments, so it moves differently on each host: such tables (``moves_when_absent``) are
merged whole unless the moments are merged.

``TouchedRows`` records the rows each embedding kernel looks up, with a forward pre-hook on the
kernel (torchrec calls every kernel as ``kernel(features)`` with the rows of its local tables,
after the input dist: shard-local ids for row-wise shards, table ids otherwise, exactly the rows
the kernel reads and its backward updates). A bitmap per local table (one byte a row) is keyed by
the table's local weight (storage pointer), which is what the merger finds among the fused
optimizer's local shards.

For an outer step or bf16 deltas (``recsys.training.kstep.outer``) the hook can also keep each
row's value as it was before its first update since the last merge (``keep_first_values``): the
row's anchor, so the merge needs no copy of the table.

``union`` agrees on the rows across a replica group in one all-gather, of whichever is smaller:
sorted row lists (4 bytes a touched row) or packed bitmaps (1 bit a local row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def embedding_kernels(model: nn.Module) -> list[nn.Module]:
    """Every torchrec embedding kernel of the sharded modules in ``model`` (they sit in the sharded
    modules' plain ``_lookups`` lists, data-parallel lookups wrapped in DDP)."""
    out: list[nn.Module] = []
    for m in model.modules():
        for lookup in getattr(m, "_lookups", None) or []:
            lookup = getattr(lookup, "module", lookup)
            out.extend(getattr(lookup, "_emb_modules", None) or [])
    return out


class TouchedRows:
    """Per local embedding table, the rows looked up since ``reset``. ``complete`` is False until
    the first ``reset``: tracking that starts after the model has trained (a hook bound at the
    first step) cannot tell which rows moved before it, so that merge must take whole shards."""

    def __init__(self, model: nn.Module, complete: bool = True) -> None:
        self.bitmaps: dict[int, Tensor] = {}  # data_ptr of a table's local weight -> bool[rows]
        # tables whose optimizer moves rows absent from the batch (CowClip/Adam with the dense
        # semantics: catch-up or every row every step), by the same key
        self.moves_when_absent: set[int] = set()
        self.complete = complete
        # tables whose rows' first values since the last merge are kept (``keep_first_values``):
        # data_ptr -> [(rows, their values before the rows first changed)]
        self.first: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._handles = []
        for kernel in embedding_kernels(model):
            split = getattr(kernel, "split_embedding_weights", None)
            ftm = getattr(kernel, "_feature_table_map", None)
            if split is None or ftm is None:
                continue
            maps, weights = [], []
            for w in split():
                if not isinstance(w, Tensor) or w.dim() != 2:  # a kernel whose weights are not plain rows
                    maps = []
                    break
                bm = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
                maps.append(bm)
                weights.append(w)
                if w.shape[0] == 0:  # an empty shard shares its storage pointer with the next table's
                    continue
                self.bitmaps[w.data_ptr()] = bm
                hyper = getattr(getattr(kernel, "emb_module", None), "hyper", None)
                if getattr(hyper, "update_scope", "batch") != "batch":
                    self.moves_when_absent.add(w.data_ptr())
            if maps:
                self._handles.append(kernel.register_forward_pre_hook(_recorder(list(ftm), maps, weights, self.first)))

    def bitmap_of(self, weight: Tensor) -> Tensor | None:
        """The bitmap of a table's local weight (a view at the same storage offset), or None."""
        bm = self.bitmaps.get(weight.data_ptr())
        return bm if bm is not None and bm.numel() == weight.shape[0] else None

    def keep_first_values(self, weights: list[Tensor]) -> None:
        """From now on keep, for these tables' local weights (those tracked here whose absent rows
        do not move), each row's value before its first lookup since ``reset``: the value the
        last merge left, as the row is updated only after the lookup."""
        for w in weights:
            if self.bitmap_of(w) is not None and w.data_ptr() not in self.moves_when_absent:
                self.first.setdefault(w.data_ptr(), [])

    def first_values(self, weight: Tensor) -> tuple[Tensor, Tensor] | None:
        """The rows of ``weight`` looked up since ``reset`` (sorted) and their values before that
        first lookup; None for a table whose first values are not kept."""
        kept = self.first.get(weight.data_ptr()) if self.bitmap_of(weight) is not None else None
        if kept is None:
            return None
        if not kept:
            return torch.empty(0, dtype=torch.long, device=weight.device), weight.new_empty((0, *weight.shape[1:]))
        rows = torch.cat([r for r, _ in kept])
        order = torch.argsort(rows)
        return rows[order], torch.cat([v for _, v in kept])[order]

    def reset(self) -> None:
        for bm in self.bitmaps.values():
            bm.zero_()
        for kept in self.first.values():
            kept.clear()
        self.complete = True

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _recorder(feature_table_map: list[int], maps: list[Tensor], weights: list[Tensor], first: dict[int, list[tuple[Tensor, Tensor]]]):
    pointers = [w.data_ptr() for w in weights]

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        features = args[0]
        values = features.values()
        if values.numel() == 0:
            return
        offsets = features.offset_per_key()
        for f, t in enumerate(feature_table_map):
            lo, hi = offsets[f], offsets[f + 1]
            if hi > lo:
                ids = values[lo:hi].long()
                kept = first.get(pointers[t])
                if kept is not None:  # rows seen for the first time since the last merge: their values now
                    new = torch.unique(ids[~maps[t][ids]])
                    if new.numel():
                        kept.append((new, weights[t].index_select(0, new)))
                maps[t][ids] = True

    return hook


@dataclass
class Union:
    """The union of touched rows over a replica group: ``rows[i]``, the sorted local rows of
    bitmap i; ``exchange_bytes``: what this rank sent to agree on it; ``mode``: ``ids`` or
    ``bitmap``."""

    rows: list[Tensor]
    exchange_bytes: int
    mode: str


def union(bitmaps: list[Tensor], pg: dist.ProcessGroup | None) -> Union:
    """The OR of every replica's bitmaps (the same list of lengths everywhere) in one all-gather
    of row lists or of packed bitmaps, whichever is smaller for the largest list in the group.
    In the list case the work after the one pass that finds this rank's rows is proportional to
    the rows touched, not to the table sizes."""
    local = [bm.nonzero().flatten() for bm in bitmaps]
    world = dist.get_world_size(pg) if pg is not None else 1
    if world == 1:
        return Union(local, 0, "none")
    sizes = [bm.numel() for bm in bitmaps]
    starts = [0]
    for n_i in sizes:
        starts.append(starts[-1] + n_i)
    n = starts[-1]
    device = bitmaps[0].device
    count = sum(x.numel() for x in local)
    most = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=pg)
    most_ids = int(most.item())
    if most_ids * 4 < (n + 7) // 8 and n < 2**31:
        mine = torch.full((most_ids,), -1, dtype=torch.int32, device=device)
        if count:
            mine[:count] = torch.cat([x + s for x, s in zip(local, starts)]).to(torch.int32)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=pg)
        every = torch.cat(parts)
        every = torch.unique(every[every >= 0].long())  # sorted
        bounds = torch.searchsorted(every, torch.tensor(starts, dtype=torch.long, device=device)).tolist()
        rows = [every[bounds[i] : bounds[i + 1]] - starts[i] for i in range(len(bitmaps))]
        return Union(rows, (world - 1) * mine.numel() * 4 + 8, "ids")
    packed = _pack(torch.cat(bitmaps))
    parts = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(parts, packed, group=pg)
    merged = parts[0]
    for p in parts[1:]:
        merged = merged | p
    mask = _unpack(merged, n)
    rows = [mask[starts[i] : starts[i + 1]].nonzero().flatten() for i in range(len(bitmaps))]
    return Union(rows, (world - 1) * packed.numel() + 8, "bitmap")


# a shard whose union of touched rows holds more than this share of its rows is merged whole
WHOLE_SHARD_FRACTION = 0.75


@dataclass
class RowsToMerge:
    """What a merge averages of the tracked shards: ``rows``, shard (storage pointer) -> its local
    rows (shards absent: merged whole); ``exchange_bytes`` sent to agree on them; rows averaged
    (``merged``, whole shards counted whole) and held (``tracked``) in tracked shards."""

    rows: dict[int, Tensor]
    exchange_bytes: int = 0
    merged: int = 0
    tracked: int = 0


def rows_to_merge(
    touched: TouchedRows, owners: list[Tensor], pg: dist.ProcessGroup | None, merge_moments: bool, whole_fraction: float | None
) -> RowsToMerge:
    """The union over the hosts of the rows looked up since the last merge, per embedding shard in
    ``owners``. Shards without a bitmap are left out (merged whole), as are tables whose absent
    rows move (``moves_when_absent``) unless the moments are merged (each host's own moments move
    them: not equal), and shards whose union holds more than ``whole_fraction`` of their rows
    (None: never). Collective over ``pg``; every replica lists the same shards in the same order
    (the same plan)."""
    shards, seen = [], set()
    for owner in owners:
        bm = touched.bitmap_of(owner)
        if not merge_moments and owner.data_ptr() in touched.moves_when_absent:
            bm = None
        if bm is not None and owner.data_ptr() not in seen:
            seen.add(owner.data_ptr())
            shards.append((owner.data_ptr(), bm))
    if not shards:
        return RowsToMerge({})
    u = union([bm for _, bm in shards], pg)
    out = RowsToMerge({}, u.exchange_bytes)
    for (ptr, bm), idx in zip(shards, u.rows):
        n = bm.numel()
        out.tracked += n
        if whole_fraction is not None and idx.numel() > whole_fraction * n:  # gathering most rows costs more than it saves
            out.merged += n
            continue
        out.merged += idx.numel()
        out.rows[ptr] = idx
    return out


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack(mask: Tensor) -> Tensor:
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    return (padded.view(-1, 8) * _BITS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: Tensor, n: int) -> Tensor:
    bits = (packed.view(-1, 1) & _BITS.to(packed.device)).ne(0)
    return bits.view(-1)[:n]
