"""The generated Criteo-like data: determinism, slicing, skew, positive rate, oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys.config import CARDINALITY_PRESETS
from recsys.data.synthetic import EVAL, TRAIN, CriteoLikeGenerator, RowBlock, zipf_ranks
from recsys.training.metrics import auc

CARDS = CARDINALITY_PRESETS["criteo_kaggle_filtered"]


@pytest.fixture(scope="module")
def gen():
    return CriteoLikeGenerator(CARDS, seed=3)


def test_rows_are_a_pure_function_of_index(gen):
    whole = gen.rows(TRAIN, 0, 3000)
    other = CriteoLikeGenerator(CARDS, seed=3)
    for lo, hi in [(0, 1), (255, 257), (100, 2900), (2999, 3000)]:
        part = other.rows(TRAIN, lo, hi)
        np.testing.assert_array_equal(part.sparse, whole.sparse[lo:hi])
        np.testing.assert_array_equal(part.labels, whole.labels[lo:hi])
        np.testing.assert_array_equal(part.dense, whole.dense[lo:hi])
    assert not np.array_equal(gen.rows(EVAL, 0, 3000).sparse, whole.sparse), "splits must differ"
    assert not np.array_equal(CriteoLikeGenerator(CARDS, seed=4).rows(TRAIN, 0, 3000).sparse, whole.sparse)


def test_shapes_ranges_and_positive_rate(gen):
    b = gen.rows(EVAL, 0, 40_000)
    assert b.dense.shape == (40_000, 13) and b.dense.dtype == np.float32 and (b.dense >= 0).all()
    assert b.sparse.shape == (40_000, 26)
    assert (b.sparse >= 0).all() and (b.sparse < np.asarray(CARDS)).all()
    assert abs(b.labels.mean() - 0.25) < 0.015
    assert abs(b.probs.mean() - 0.25) < 0.01


def test_id_skew_like_criteo(gen):
    """On 8,000 rows, 79-87% of the distinct values of Criteo's big fields occur once."""
    s = gen.rows(TRAIN, 0, 8000).sparse
    for f in (2, 3, 11, 15, 20):
        _, counts = np.unique(s[:, f], return_counts=True)
        assert 0.7 < (counts == 1).mean() < 0.9


def test_zipf_ranks_follow_power_law():
    rng = np.random.default_rng(0)
    n, a = 1000, 1.2
    k = zipf_ranks(rng.random(400_000), np.full(400_000, n), a)
    freq = np.bincount(k, minlength=n)
    # P(rank r) is the power-law mass on [r+1, r+2), normalised over [1, n+1)
    mass = lambda lo, hi: (lo ** (1 - a) - hi ** (1 - a)) / (a - 1)  # noqa: E731
    expected = np.array([mass(r + 1, r + 2) for r in range(n)]) / mass(1, n + 1)
    np.testing.assert_allclose(freq[:20] / freq.sum(), expected[:20], rtol=0.05)
    assert abs(freq[500:].sum() / freq.sum() - expected[500:].sum()) < 0.005
    assert k.min() == 0 and k.max() <= n - 1


def test_oracle_auc_is_criteo_like_and_beats_noise(gen):
    b = gen.rows(EVAL, 0, 50_000)
    labels = torch.from_numpy(b.labels)
    oracle = auc(torch.from_numpy(b.probs), labels)
    assert 0.78 < oracle < 0.83
    noisy = auc(torch.from_numpy(b.probs) + torch.randn(50_000) * 0.3, labels)
    assert noisy < oracle


def test_row_blocks_take_and_concatenate_every_field():
    a = RowBlock(
        np.arange(6, dtype=np.float32).reshape(3, 2),
        np.arange(3)[:, None],
        np.array([0, 1, 0], np.float32),
        np.array([0.1, 0.2, 0.3], np.float32),
    )
    b = RowBlock(np.full((1, 2), 9, np.float32), np.array([[7]]), np.array([1], np.float32), np.array([0.9], np.float32))
    both = RowBlock.concat([a, b])
    assert len(both) == 4 and both.sparse[:, 0].tolist() == [0, 1, 2, 7] and both.probs.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.9])
    assert RowBlock.concat([a]) is a
    picked = both.take(np.array([3, 0]))
    assert (
        picked.dense.tolist() == [[9, 9], [0, 1]]
        and picked.labels.tolist() == [1, 0]
        and picked.probs.tolist() == pytest.approx([0.9, 0.1])
    )
    real = RowBlock(a.dense, a.sparse, a.labels)  # real data has no teacher probabilities
    assert RowBlock.concat([real, real]).probs is None and real.take(slice(1, 3)).sparse[:, 0].tolist() == [1, 2]
