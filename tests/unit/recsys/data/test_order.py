"""Shuffled epochs (recsys/data/order.py): each row once per epoch, a new order each epoch, the
same global batches on any world size, exact resume at any step, eval in order, and the order
recorded so that a resume under another order is refused."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.config import ConfigError, ExperimentConfig, load_config
from recsys.data.batching import eval_blocks, train_batches
from recsys.data.order import EpochOrder, WindowReader
from recsys.data.source import EVAL, TRAIN, DataSource, epoch_order
from recsys.data.synthetic import RowBlock
from recsys.training.run_dir import state_shape

SMOKE = Path(__file__).resolve().parents[4] / "configs" / "experiments" / "smoke.yaml"


class IndexSource(DataSource):
    """Row i of a split carries i in its dense feature and label slot (exact in float32), so a
    batch says which rows it holds; reads are counted to see what a window costs."""

    def __init__(self, train: int, eval_: int) -> None:
        self.dense_names, self.sparse_names, self.cardinalities = ["i"], ["c"], [7]
        self._rows = {TRAIN: train, EVAL: eval_}
        self.reads: list[tuple[int, int]] = []

    def num_rows(self, split: int) -> int:
        return self._rows[split]

    def identity(self) -> dict:
        return {"source": "index", "rows": dict(self._rows)}

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        assert 0 <= start <= stop <= self._rows[split]
        if split == TRAIN:
            self.reads.append((start, stop))
        i = np.arange(start, stop) + (0 if split == TRAIN else 10**6)
        return RowBlock(i[:, None].astype(np.float32), i[:, None] % 7, i.astype(np.float32))


def _rows(batch) -> list[int]:
    return batch.dense_features[:, 0].to(torch.int64).tolist()


def test_each_epoch_is_a_new_permutation_of_every_row():
    n = 10_000  # 39 full blocks of 256 and a short one of 16
    order = EpochOrder(n, True, seed=3, block_rows=256, buffer_rows=2048)
    e0, e1 = order.rows(0, 0, n), order.rows(1, 0, n)
    assert sorted(e0.tolist()) == list(range(n)) and sorted(e1.tolist()) == list(range(n))
    assert (e0 != e1).mean() > 0.99
    # a pure function of (seed, epoch): another instance, any cut of the range
    again = EpochOrder(n, True, seed=3, block_rows=256, buffer_rows=2048)
    assert np.array_equal(np.concatenate([again.rows(0, a, min(a + 333, n)) for a in range(0, n, 333)]), e0)
    assert not np.array_equal(EpochOrder(n, True, seed=4, block_rows=256, buffer_rows=2048).rows(0, 0, n), e0)
    # file order when off
    assert np.array_equal(EpochOrder(n, shuffle=False).rows(5, 100, 200), np.arange(100, 200))


def test_a_batch_mixes_rows_from_its_whole_window():
    n = 1 << 16
    first = EpochOrder(n, True, block_rows=256, buffer_rows=8192).rows(0, 0, 512)
    blocks = set((first // 256).tolist())
    assert len(blocks) >= 25  # 512 rows out of 32 blocks of the window: nearly all of them
    # blocks only (buffer 0): whole blocks, rows of a block in file order, blocks from all over
    only = EpochOrder(n, True, block_rows=256, buffer_rows=0).rows(0, 0, 1024).reshape(4, 256)
    assert (np.diff(only, axis=1) == 1).all() and (only[:, 0] % 256 == 0).all()
    assert np.ptp(only[:, 0]) > 4 * 256


def test_batches_on_any_world_size_resume_exactly_and_read_each_row_once_per_epoch():
    src = IndexSource(train=4096, eval_=300)
    order = EpochOrder(4096, True, seed=1, block_rows=64, buffer_rows=1024)
    steps = 3 * 16  # 16 steps of 256 per epoch, three epochs
    one = [_rows(b) for b in train_batches(src, 256, 0, 1, 0, steps, order)]
    for world in (2, 4):
        ranks = [[_rows(b) for b in train_batches(src, 256, r, world, 0, steps, order)] for r in range(world)]
        assert [sum((ranks[r][s] for r in range(world)), []) for s in range(steps)] == one
    for epoch in range(3):
        seen = sum(one[16 * epoch : 16 * (epoch + 1)], [])
        assert sorted(seen) == list(range(4096)), epoch  # every row exactly once
    assert one[:16] != one[16:32]  # and another order next epoch
    # killed after step 21 (in epoch 2) and resumed there: the same rows, step by step
    killed = [_rows(b) for b in train_batches(src, 256, 0, 1, 0, 21, order)]
    resumed = [_rows(b) for b in train_batches(src, 256, 0, 1, 21, steps, order)]
    assert killed + resumed == one
    # eval stays in order and never sees a training row
    assert sum((b.dense[:, 0].astype(int).tolist() for b in eval_blocks(src, 128, 0, 1)), []) == list(range(10**6, 10**6 + 300))


def test_rows_past_the_last_full_batch_rotate_between_epochs():
    src = IndexSource(train=1000, eval_=10)  # 3 steps of 300: 100 rows left out each epoch
    order = EpochOrder(1000, True, block_rows=32, buffer_rows=256)
    epochs = [sum((_rows(b) for b in train_batches(src, 300, 0, 1, 3 * e, 3 * e + 3, order)), []) for e in range(4)]
    for rows in epochs:
        assert len(rows) == len(set(rows)) == 900  # never twice in an epoch
    assert len(set().union(*map(set, epochs))) == 1000  # the left-out rows differ between epochs


def test_a_window_is_read_once_block_by_block():
    src = IndexSource(train=8192, eval_=10)
    order = EpochOrder(8192, True, block_rows=128, buffer_rows=2048)
    list(train_batches(src, 256, 0, 2, 0, 32, order))  # one epoch on rank 0 of 2
    assert all(stop - start == 128 and start % 128 == 0 for start, stop in src.reads)
    assert sorted(src.reads) == [(s, s + 128) for s in range(0, 8192, 128)]  # each block once


def test_window_reader_keeps_every_field():
    n = 600
    order = EpochOrder(n, True, block_rows=50, buffer_rows=200)
    probs = np.arange(n, dtype=np.float32) / n
    reader = WindowReader(
        order,
        lambda lo, hi: RowBlock(
            np.arange(lo, hi, dtype=np.float32)[:, None], np.arange(lo, hi)[:, None], np.arange(lo, hi, dtype=np.float32), probs[lo:hi]
        ),
    )
    block = reader.read(2, 150, 450)  # spans two windows
    rows = order.rows(2, 150, 450)
    assert block.sparse[:, 0].tolist() == rows.tolist() and block.labels.tolist() == rows.tolist()
    np.testing.assert_array_equal(block.probs, probs[rows])


def test_config_default_shuffles_and_checkpoints_record_the_order():
    cfg = load_config(SMOKE)
    assert cfg.data.shuffle and epoch_order(cfg, IndexSource(5000, 10)).describe() == "shuffle seed=0 block=256 buffer=65536"
    shape = state_shape(cfg, ["c"], [7], 2)
    assert shape["data.order"] == "shuffle seed=0 block=256 buffer=65536"
    off = load_config(SMOKE, ["data.shuffle=false"])
    assert "data.order" not in state_shape(off, ["c"], [7], 2)  # as in checkpoints from before shuffling
    assert not epoch_order(off, IndexSource(5000, 10)).shuffle
    for override, why in [
        ("data.shuffle_block_rows=0", "must be positive"),
        ("data.shuffle_buffer_rows=-1", "must be >= 0 (0: shuffle blocks only)"),
        ("data.shuffle_seed=-2", "must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(why)) as e:
            load_config(SMOKE, [override])
        assert str(e.value) == f"{SMOKE}: key '{override.split('=')[0]}': {why}"
    assert ExperimentConfig().data.shuffle


def test_the_order_label_and_bad_orders():
    order = EpochOrder(1000, True, seed=7, block_rows=100, buffer_rows=250)
    assert order.describe() == "shuffle seed=7 block=100 buffer=250" and order.blocks_per_window == 2
    assert EpochOrder(1000, shuffle=False).describe() is None  # file order: what checkpoints without an order hold
    assert EpochOrder(1000, True, block_rows=100, buffer_rows=0).blocks_per_window == 1
    for args, msg in [
        ((0,), "bad epoch order: 0 rows, blocks of 256, buffer 65536"),
        ((10, True, 0, 0), "bad epoch order: 10 rows, blocks of 0, buffer 65536"),
    ]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            EpochOrder(*args)


def test_windows_split_a_position_range_at_window_ends():
    order = EpochOrder(1000, True, seed=1, block_rows=100, buffer_rows=300)  # windows of 300, 300, 300, 100 rows
    assert order.windows(0, 250, 700) == [(0, 250, 300), (1, 0, 300), (2, 0, 100)]
    rows = order.rows(0, 0, 1000)
    for w in range(4):  # a window holds whole blocks: the rows of its blocks, permuted
        mine = rows[300 * w : 300 * (w + 1)]
        blocks = sorted(set((mine // 100).tolist()))
        assert sorted(mine.tolist()) == [r for b in blocks for r in range(100 * b, 100 * b + 100)]
