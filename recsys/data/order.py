"""The order in which an epoch reads the training split: in file order, or shuffled.

A shuffled epoch is a pure function of (seed, epoch): the split is cut into blocks of
``block_rows`` consecutive rows; the blocks are permuted per epoch; consecutive blocks of that
order are grouped into windows of ``buffer_rows`` rows (the shuffle buffer), and the rows of a
window are permuted again. Position ``p`` of epoch ``e`` therefore names one row, whatever the
world size, the rank or the step a run was resumed at: the position *is* the step (global batch
``b`` is positions ``[b*B, (b+1)*B)``), so a checkpoint's step restores the order exactly and a
killed, resumed run reads each row once per epoch, like an uninterrupted one.

Why blocks and a window instead of one permutation of the whole split: a reader then touches
whole runs of consecutive rows (memory-mapped shards page in sequentially; the synthetic
generator makes rows in chunks of 256), and a rank holds one window in memory at a time.
The cost: every rank reads every window it takes rows from, i.e. all of them (the rows of a
global batch are spread over its window), so reading work grows with the world size; see
docs/data.md for the figures. Rows never cross from the training split into the eval split:
only training positions are ordered here, and eval reads its split in order.

No torchrec or torch.utils.data piece fits: torchrec's datasets shuffle nothing across files,
and a DataLoader sampler's order is not a function of the step, which exact resume needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from recsys.data.synthetic import RowBlock

__all__ = ["EpochOrder", "WindowReader", "order_label"]


def order_label(seed: int, block_rows: int, buffer_rows: int) -> str:
    """A shuffled order in one short string: what checkpoints record, so that a resume with
    another order (which would re-read rows) is refused by name."""
    return f"shuffle seed={seed} block={block_rows} buffer={buffer_rows}"


@dataclass(frozen=True)
class EpochOrder:
    """Maps (epoch, position) to a row of the training split.

    ``shuffle=False`` is file order (position p is row p). With ``buffer_rows == 0`` only the
    blocks are permuted; otherwise the window is ``max(1, buffer_rows // block_rows)`` blocks.
    """

    num_rows: int
    shuffle: bool = True
    seed: int = 0
    block_rows: int = 256
    buffer_rows: int = 65536
    _cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.block_rows < 1 or self.buffer_rows < 0:
            raise ValueError(f"bad epoch order: {self.num_rows} rows, blocks of {self.block_rows}, buffer {self.buffer_rows}")

    @property
    def blocks_per_window(self) -> int:
        return max(1, self.buffer_rows // self.block_rows)

    def describe(self) -> str | None:
        """What a checkpoint records (None: file order, as before shuffling existed)."""
        return order_label(self.seed, self.block_rows, self.buffer_rows) if self.shuffle else None

    # -- the permutations -------------------------------------------------------------------
    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's block order and the first position of each window (plus the end)."""
        key = ("epoch", epoch)
        if key not in self._cache:
            n_blocks = -(-self.num_rows // self.block_rows)
            blocks = np.random.default_rng([self.seed, epoch]).permutation(n_blocks)
            sizes = np.minimum(self.block_rows, self.num_rows - blocks * self.block_rows)
            k = self.blocks_per_window
            window_sizes = np.add.reduceat(sizes, np.arange(0, n_blocks, k))
            starts = np.concatenate([[0], np.cumsum(window_sizes)])
            self._cache.clear()  # one epoch at a time (its windows too)
            self._cache[key] = (blocks, starts)
        return self._cache[key]

    def window_rows(self, epoch: int, window: int) -> np.ndarray:
        """Row indices of one window, in the order its positions read them."""
        blocks, _ = self._epoch(epoch)
        k = self.blocks_per_window
        mine = blocks[window * k : (window + 1) * k]
        rows = np.concatenate([np.arange(b * self.block_rows, min((b + 1) * self.block_rows, self.num_rows)) for b in mine])
        if self.buffer_rows > 0:
            rows = rows[np.random.default_rng([self.seed, epoch, window]).permutation(rows.size)]
        return rows

    def windows(self, epoch: int, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(window, first, last) position ranges inside the windows that [start, stop) covers,
        positions counted from the window's start."""
        _, starts = self._epoch(epoch)
        out = []
        w = int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(starts[w + 1]))
            out.append((w, start - int(starts[w]), end - int(starts[w])))
            start, w = end, w + 1
        return out

    def rows(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Row indices read at positions [start, stop) of an epoch."""
        if not self.shuffle:
            return np.arange(start, stop)
        return np.concatenate([self.window_rows(epoch, w)[a:b] for w, a, b in self.windows(epoch, start, stop)])


class WindowReader:
    """Reads positions of a shuffled epoch through ``read(start, stop) -> RowBlock`` (contiguous
    rows of the training split), holding the current window's rows in memory: a window is read
    once per rank, block by block, and then served to every step that takes rows from it."""

    def __init__(self, order: EpochOrder, read: Callable[[int, int], RowBlock]) -> None:
        self.order = order
        self._read = read
        self._held: dict[tuple[int, int], RowBlock] = {}

    def _window(self, epoch: int, window: int) -> RowBlock:
        key = (epoch, window)
        if key not in self._held:
            rows = self.order.window_rows(epoch, window)
            b = self.order.block_rows
            # blocks of the window, each one contiguous read, in the window's block order
            firsts = np.unique(rows // b) * b
            parts = [self._read(int(f), int(min(f + b, self.order.num_rows))) for f in firsts]
            where = np.searchsorted(firsts, rows // b * b)
            offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])[where] + rows % b
            if len(self._held) >= 2:  # a step spans at most two windows; older ones are done
                self._held.pop(next(iter(self._held)))
            self._held[key] = RowBlock.concat(parts).take(offsets)
        return self._held[key]

    def read(self, epoch: int, start: int, stop: int) -> RowBlock:
        """Rows at positions [start, stop) of an epoch, in that order."""
        if not self.order.shuffle:
            return self._read(start, stop)
        return RowBlock.concat([self._window(epoch, w).take(slice(a, b)) for w, a, b in self.order.windows(epoch, start, stop)])
