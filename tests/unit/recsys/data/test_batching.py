"""Rows -> torchrec Batch: KJT layout, hashing, missing ids, and the step -> rows mapping that
makes resumed and differently-sized runs see the same data."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from recsys.config import ExperimentConfig
from recsys.data.batching import eval_blocks, rank_rows, steps_per_epoch, to_batch, train_batches
from recsys.data.order import EpochOrder
from recsys.data.source import EVAL, TRAIN, SyntheticSource
from recsys.data.synthetic import RowBlock


def test_to_batch_builds_key_major_kjt_with_hashing_and_empty_bags():
    sparse = np.array([[5, -1, 12], [-1, 7, 3], [9, 10, -1]], dtype=np.int64)
    block = RowBlock(np.zeros((3, 2), np.float32), sparse, np.array([1, 0, 1], np.float32))
    b = to_batch(block, ["a", "b", "c"], np.array([10, 10, 4]))
    kjt = b.sparse_features
    assert kjt.keys() == ["a", "b", "c"]
    d = kjt.to_dict()
    # feature a: rows 0 and 2 (5, 9); row 1 missing -> empty bag
    assert d["a"].lengths().tolist() == [1, 0, 1] and d["a"].values().tolist() == [5, 9]
    assert d["b"].lengths().tolist() == [0, 1, 1] and d["b"].values().tolist() == [7, 0]  # 10 mod 10
    assert d["c"].lengths().tolist() == [1, 1, 0] and d["c"].values().tolist() == [0, 3]  # 12 mod 4
    assert b.labels.tolist() == [1.0, 0.0, 1.0] and b.dense_features.shape == (3, 2)


def test_rank_slices_tile_the_global_batch():
    for world in (1, 2, 4):
        spans = [rank_rows(3, 64, r, world) for r in range(world)]
        assert spans[0][0] == 3 * 64 and spans[-1][1] == 4 * 64
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _source(**data) -> SyntheticSource:
    cfg = ExperimentConfig()
    cfg.data.train_rows, cfg.data.eval_rows = 1000, 301
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return SyntheticSource(cfg)


def test_two_ranks_see_the_one_rank_global_batch_and_resume_sees_the_same_rows():
    src = _source()
    one = list(train_batches(src, 128, 0, 1, 0, 9))  # 7 steps per epoch: wraps into epoch 2
    r0 = list(train_batches(src, 128, 0, 2, 0, 9))
    r1 = list(train_batches(src, 128, 1, 2, 0, 9))
    for full, a, b in zip(one, r0, r1):
        torch.testing.assert_close(full.labels, torch.cat([a.labels, b.labels]))
        torch.testing.assert_close(full.dense_features, torch.cat([a.dense_features, b.dense_features]))
    torch.testing.assert_close(one[7].labels, one[0].labels)  # epoch 2 starts over
    resumed = list(train_batches(src, 128, 0, 1, 5, 9))
    for x, y in zip(resumed, one[5:]):
        torch.testing.assert_close(x.sparse_features.values(), y.sparse_features.values())


def test_eval_covers_every_row_once():
    src = _source()
    for world in (1, 2, 4):
        blocks = [b for r in range(world) for b in eval_blocks(src, 128, r, world)]
        # 301 rows = 128 + 128 + 45; the last block is cut to a multiple of the world size
        assert sum(len(b) for b in blocks) == 301 - 45 % world


def test_a_split_smaller_than_one_batch_is_refused_with_its_counts():
    src = _source()
    assert steps_per_epoch(src, TRAIN, 128) == 7 and steps_per_epoch(src, EVAL, 100) == 3
    with pytest.raises(ValueError, match=re.escape("the eval split has 301 rows, fewer than one global batch of 512")):
        steps_per_epoch(src, EVAL, 512)
    order = EpochOrder(999, shuffle=False)
    with pytest.raises(ValueError, match=re.escape("the epoch order covers 999 rows, the training split has 1000")):
        next(train_batches(src, 128, 0, 1, 0, 1, order))
