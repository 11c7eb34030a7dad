"""Per-row outer state of an embedding shard, kept only for the rows that merges have merged.

A touched-row merge steps lazily (``recsys.training.kstep.outer``): a row's outer momentum and
bf16 residual change only at the merges that merge the row, and a row never merged has both at
zero. Kept as full fp32 copies of the shard they cost two copies of every embedding table per
rank, which at Criteo's raw sizes did not fit four ranks in 23.5 GB; here they cost 4 bytes per
shard row (a position) plus the state of the rows merged so far.
"""

from __future__ import annotations

import torch
from torch import Tensor

Saved = dict[str, Tensor]  # {"rows": the rows merged so far, "values": their state}


class MergedRows:
    """Named per-row state (``momentum``, ``residual``) of a shard shaped ``shape``: a position per
    shard row into packed values that grow as new rows are merged. Position 0 is a row of zeros,
    where every row never merged points, so reading any rows is one gather. Capacity doubles up
    to the shard's rows: adding rows costs amortised O(rows added), and the whole never holds
    more than the shard's rows (and the zero row)."""

    def __init__(self, shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu") -> None:
        self.shape = torch.Size(shape)
        index = torch.int32 if self.shape[0] < 2**31 - 1 else torch.int64
        self.position = torch.zeros((self.shape[0],), dtype=index, device=device)
        self.rows = torch.full((1,), -1, dtype=torch.long, device=device)  # the shard row at each position
        self.values: dict[str, Tensor] = {}
        self.count = 0  # rows stored (positions 1 .. count)

    def stored_rows(self) -> Tensor:
        return self.rows[1 : self.count + 1]

    def get(self, name: str, rows: Tensor) -> Tensor:
        """The state ``name`` of ``rows`` (fp32, zero for rows never stored)."""
        values = self.values.get(name)
        if values is None:
            return torch.zeros((rows.numel(), *self.shape[1:]), dtype=torch.float32, device=self.position.device)
        return values.index_select(0, self.position.index_select(0, rows).long())

    def put(self, name: str, rows: Tensor, values: Tensor) -> None:
        """Stores ``values`` (one per row of ``rows``, rows distinct) as the state ``name`` of ``rows``."""
        if rows.numel() == 0:
            return
        pos = self.position.index_select(0, rows).long()
        new = pos == 0
        if bool(new.any()):
            added = rows[new]
            self._reserve(self.count + 1 + added.numel())
            at = torch.arange(self.count + 1, self.count + 1 + added.numel(), device=pos.device)
            self.position[added] = at.to(self.position.dtype)
            self.rows[at] = added
            self.count += added.numel()
            pos[new] = at
        if name not in self.values:
            self.values[name] = torch.zeros((self.rows.numel(), *self.shape[1:]), dtype=torch.float32, device=pos.device)
        self.values[name].index_copy_(0, pos, values.reshape(rows.numel(), *self.shape[1:]).to(torch.float32))

    def _reserve(self, n: int) -> None:
        capacity = self.rows.numel()
        if n <= capacity:
            return
        capacity = min(max(n, 2 * capacity, 64), self.shape[0] + 1)
        self.rows = _grown(self.rows, capacity, self.count + 1)
        self.values = {name: _grown(v, capacity, self.count + 1) for name, v in self.values.items()}

    def nbytes(self) -> int:
        """Bytes held: the positions, and the rows and values at their capacity."""
        held = [self.position, self.rows, *self.values.values()]
        return sum(t.numel() * t.element_size() for t in held)

    def saved(self, name: str) -> Saved | None:
        """``name``'s rows and values, for a checkpoint; None when nothing was stored."""
        if name not in self.values:
            return None
        return {"rows": self.stored_rows().clone(), "values": self.values[name][1 : self.count + 1].clone()}

    def load(self, name: str, saved: Tensor | Saved) -> None:
        """Stores a checkpoint's state (``fits`` this shard): a dense tensor's non-zero rows, or saved rows."""
        if isinstance(saved, Tensor):
            flat = saved.reshape(saved.shape[0], -1)
            rows = flat.ne(0).any(dim=1).nonzero().flatten()
            self.put(name, rows.to(self.position.device), saved[rows].to(self.position.device))
        else:
            self.put(name, saved["rows"].to(self.position.device, torch.long), saved["values"].to(self.position.device))


def fits(shape: torch.Size | tuple[int, ...], saved: object) -> bool:
    """Whether a checkpoint's state (a dense tensor, or saved rows and values) is of a shard shaped
    ``shape``; anything else a checkpoint may hold there does not fit."""
    if isinstance(saved, Tensor):
        return tuple(saved.shape) == tuple(shape)
    if not isinstance(saved, dict):
        return False
    rows, values = saved.get("rows"), saved.get("values")
    return (
        isinstance(rows, Tensor)
        and isinstance(values, Tensor)
        and rows.dim() == 1
        and tuple(values.shape) == (rows.numel(), *shape[1:])
        and (rows.numel() == 0 or (int(rows.min()) >= 0 and int(rows.max()) < shape[0]))
    )


def _grown(t: Tensor, capacity: int, used: int) -> Tensor:
    out = torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:used] = t[:used]
    return out
