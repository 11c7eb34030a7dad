"""Turning rows into torchrec `Batch`es: per-rank slices of global batches, at any step.

The mapping step -> rows is fixed (global batch b of an epoch is positions [b*B, (b+1)*B) of
the epoch's order, `order.EpochOrder`: file order or a seeded shuffle; rank r of W takes the
r-th of W equal slices), so a run resumed at step s reads exactly the rows an uninterrupted run
would, and 1-process and N-process runs see the same global batch.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.data.order import EpochOrder, WindowReader
from recsys.data.source import EVAL, TRAIN, DataSource
from recsys.data.synthetic import RowBlock


def to_batch(block: RowBlock, keys: list[str], cardinalities: np.ndarray) -> Batch:
    """Rows -> Batch. Raw ids are hashed into the tables (id mod size); -1 (missing) gives an
    empty bag, so a missing field contributes a zero embedding, not a shared 'missing' row."""
    ids = block.sparse
    valid_t = (ids >= 0).T  # KJT values are key-major: all of feature 0, then feature 1, ...
    rows_t = np.where(valid_t, ids.T % cardinalities[:, None], 0)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.from_numpy(np.ascontiguousarray(rows_t[valid_t])),
        lengths=torch.from_numpy(valid_t.reshape(-1).astype(np.int32)),
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(block.dense, dtype=np.float32)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(block.labels, dtype=np.float32)),
    )


def rank_rows(step_in_epoch: int, global_batch: int, rank: int, world: int) -> tuple[int, int]:
    """Row range of `rank`'s slice of global batch `step_in_epoch`."""
    local = global_batch // world
    start = step_in_epoch * global_batch + rank * local
    return start, start + local


def steps_per_epoch(source: DataSource, split: int, global_batch: int) -> int:
    """Full global batches per epoch (the last partial batch is dropped); at least 1, so that
    a split smaller than one batch fails here with its counts, not as a division by zero."""
    steps = source.num_rows(split) // global_batch
    if steps < 1:
        raise ValueError(
            f"the {'training' if split == TRAIN else 'eval'} split has {source.num_rows(split)} rows, "
            f"fewer than one global batch of {global_batch}"
        )
    return steps


def train_batches(
    source: DataSource,
    global_batch: int,
    rank: int,
    world: int,
    start_step: int,
    stop_step: int,
    order: EpochOrder | None = None,
) -> Iterator[Batch]:
    """Training batches for steps [start_step, stop_step), wrapping over epochs, in `order`
    (default: file order)."""
    per_epoch = steps_per_epoch(source, TRAIN, global_batch)
    cards = np.asarray(source.cardinalities, dtype=np.int64)
    order = order or EpochOrder(source.num_rows(TRAIN), shuffle=False)
    if order.num_rows != source.num_rows(TRAIN):
        raise ValueError(f"the epoch order covers {order.num_rows} rows, the training split has {source.num_rows(TRAIN)}")
    reader = WindowReader(order, lambda lo, hi: source.read(TRAIN, lo, hi))
    for step in range(start_step, stop_step):
        lo, hi = rank_rows(step % per_epoch, global_batch, rank, world)
        yield to_batch(reader.read(step // per_epoch, lo, hi), source.sparse_names, cards)


def eval_blocks(source: DataSource, global_batch: int, rank: int, world: int) -> Iterator[RowBlock]:
    """This rank's slices of the eval split. Every row is evaluated once, except that the last,
    smaller global batch is cut to a multiple of the world size (ranks need equal slices)."""
    n = source.num_rows(EVAL)
    for start in range(0, n, global_batch):
        size = min(global_batch, n - start)
        local = size // world
        if local == 0:
            break
        lo = start + rank * local
        yield source.read(EVAL, lo, lo + local)
