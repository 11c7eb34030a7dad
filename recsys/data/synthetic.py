"""The embedded default data: a streamed generator of Criteo-like rows labelled by a hidden teacher.

Why generated data: the real Criteo/Avazu samples that ship for tests are far too small to
measure accuracy, and the full sets cannot be downloaded here. The generator reproduces what
matters for CTR training systems: 13 dense + 26 categorical fields, Criteo's table sizes, a
power-law (Zipf) id popularity, ~25% positives; the labels come from a teacher model, so the
best achievable AUC (the "oracle" AUC of the teacher's own probabilities) is known.

Rows are a pure function of (seed, split, row index): any rank can produce any slice of any
global batch without holding the data set in memory, and a 1-process and a 2-process run see
exactly the same global batches.

The teacher (logit = bias + first-order + FM + dense terms) gives signal only to the
`teacher_head` most popular ids of each field; rarer ids are noise to the model, as in real
data where most ids are seen a handful of times (79-87% of distinct values of the big Criteo
fields occur once in a sample). This keeps the oracle reachable by a model trained on a few
million rows while keeping the skew that makes large-batch training hard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CHUNK_ROWS = 256  # generation unit; rows of a chunk come from one RNG stream
NUM_DENSE = 13
TRAIN, EVAL = 0, 1
# Per-component weight scales of the teacher (before `scale`). Calibrated (docs/data.md) so
# that with the defaults the oracle AUC is ~0.80, near Criteo's best published AUC, and the
# demo's DeepFM gets within 0.01 of it: first-order 0.79 AUC alone, FM adds ~0.005.
_FIRST_ORDER_STD = 0.26
_FM_STD = 0.09
_DENSE_STD = 0.2


@dataclass
class RowBlock:
    """Rows of a split: dense float32 [n, 13], sparse int64 ids [n, 26] (-1 = missing),
    labels float32 [n], teacher probabilities float32 [n] (None for real data)."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    probs: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, index: slice | np.ndarray) -> "RowBlock":
        """The rows at ``index`` (a slice or an index array), every field."""
        return RowBlock(self.dense[index], self.sparse[index], self.labels[index], None if self.probs is None else self.probs[index])

    @staticmethod
    def concat(blocks: "list[RowBlock]") -> "RowBlock":
        """The rows of ``blocks`` one after the other (one block: itself, no copy)."""
        if len(blocks) == 1:
            return blocks[0]
        field = lambda name: None if getattr(blocks[0], name) is None else np.concatenate([getattr(b, name) for b in blocks])  # noqa: E731
        return RowBlock(field("dense"), field("sparse"), field("labels"), field("probs"))


def zipf_ranks(u: np.ndarray, n: np.ndarray, a: float) -> np.ndarray:
    """Inverse CDF of a continuous power law p(x) ~ x^-a on [1, n+1), floored to ranks 0..n-1."""
    n = n.astype(np.float64)
    if abs(a - 1.0) < 1e-9:
        x = np.power(n + 1.0, u)
    else:
        b = 1.0 - a
        x = np.power(1.0 + u * (np.power(n + 1.0, b) - 1.0), 1.0 / b)
    k = np.floor(x).astype(np.int64) - 1
    return np.clip(k, 0, n.astype(np.int64) - 1)


class CriteoLikeGenerator:
    def __init__(
        self,
        cardinalities: list[int],
        seed: int = 0,
        zipf_exponent: float = 1.05,
        teacher_head: int = 200,
        teacher_dim: int = 4,
        teacher_scale: float = 1.0,
        positive_rate: float = 0.25,
    ) -> None:
        self.cards = np.asarray(cardinalities, dtype=np.int64)
        self.num_sparse = len(cardinalities)
        self.seed = seed
        self.a = zipf_exponent
        rng = np.random.default_rng([seed, 0x7EAC4E5])
        # A bijection rank -> id per field (k * mult + offset mod n, mult coprime with n), so
        # that popular ids are scattered over the table instead of being rows 0, 1, 2, ...
        self.mult = np.empty(self.num_sparse, dtype=np.int64)
        self.offset = np.empty(self.num_sparse, dtype=np.int64)
        for f, n in enumerate(self.cards.tolist()):
            m = int(rng.integers(1, max(2, n))) | 1
            while math.gcd(m, n) != 1:
                m += 1
            self.mult[f] = m % n if n > 1 else 0
            self.offset[f] = int(rng.integers(0, n))
        self.head = np.minimum(self.cards, teacher_head)
        h = int(self.head.max())
        w1 = rng.standard_normal((self.num_sparse, h)) * _FIRST_ORDER_STD * teacher_scale
        v = rng.standard_normal((self.num_sparse, h, teacher_dim)) * _FM_STD * math.sqrt(teacher_scale)
        # Flat tables with one zero row per field at index h: min(rank, h) sends every id
        # outside the head there (a field smaller than h never reaches it), so the teacher is
        # two gathers instead of masked arithmetic.
        self._h = h
        self._field_base = (np.arange(self.num_sparse, dtype=np.int64) * (h + 1))[None, :]
        self.w1 = np.concatenate([w1, np.zeros((self.num_sparse, 1))], axis=1).astype(np.float32).reshape(-1)
        self.v = np.concatenate([v, np.zeros((self.num_sparse, 1, teacher_dim))], axis=1).astype(np.float32)
        self.v = self.v.reshape(-1, teacher_dim)
        # Dense counts: log-normal with per-feature location/spread, like Criteo's I1..I13.
        self.dense_mu = rng.uniform(0.0, 4.0, NUM_DENSE)
        self.dense_sigma = rng.uniform(0.5, 2.0, NUM_DENSE)
        self.wd = (rng.standard_normal(NUM_DENSE) * _DENSE_STD * teacher_scale).astype(np.float32)
        self.wd_cross = float(rng.standard_normal() * _DENSE_STD * teacher_scale)
        self.bias = 0.0
        self.bias = self._calibrate_bias(positive_rate)

    # -- teacher -------------------------------------------------------------------------------
    def _logits(self, ranks: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x: the dense features as the model sees them (log1p of the counts), so the dense
        term is learnable; a teacher using the pre-rounding values would add noise no model
        can remove."""
        idx = self._field_base + np.minimum(ranks, self._h)
        first = self.w1[idx].sum(axis=1, dtype=np.float64)
        v = self.v[idx]  # [n, F, d]
        s = v.sum(axis=1)
        fm = 0.5 * ((s * s).sum(axis=1) - (v * v).sum(axis=(1, 2))).astype(np.float64)
        zs = (x - self.dense_mu) / self.dense_sigma  # roughly standardised log-counts
        dense = zs @ self.wd + self.wd_cross * np.tanh(zs[:, 0] * zs[:, 1])
        return self.bias + first + fm + dense

    def _calibrate_bias(self, positive_rate: float) -> float:
        ranks, x = self._features(np.random.default_rng([self.seed, 0xB1A5]), 50_000)
        base = self._logits(ranks, x)
        lo, hi = -20.0, 20.0
        for _ in range(60):  # bisection on the mean predicted rate
            mid = 0.5 * (lo + hi)
            rate = float(np.mean(1.0 / (1.0 + np.exp(-(base + mid)))))
            lo, hi = (mid, hi) if rate < positive_rate else (lo, mid)
        return 0.5 * (lo + hi)

    # -- rows ----------------------------------------------------------------------------------
    def _features(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Popularity ranks [n, F] and dense features [n, 13]: integer counts (log-normal,
        like Criteo's I1..I13) after the usual log1p transform."""
        ranks = zipf_ranks(rng.random((n, self.num_sparse)), self.cards[None, :], self.a)
        z = self.dense_mu + self.dense_sigma * rng.standard_normal((n, NUM_DENSE))
        counts = np.maximum(np.floor(np.exp(z)) - 1.0, 0.0)
        return ranks, np.log1p(counts)

    def _chunk(self, split: int, index: int) -> RowBlock:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, split, index])))
        ranks, x = self._features(rng, CHUNK_ROWS)
        probs = 1.0 / (1.0 + np.exp(-self._logits(ranks, x)))
        labels = (rng.random(CHUNK_ROWS) < probs).astype(np.float32)
        ids = (ranks * self.mult[None, :] + self.offset[None, :]) % self.cards[None, :]
        return RowBlock(x.astype(np.float32), ids, labels, probs.astype(np.float32))

    def rows(self, split: int, start: int, stop: int) -> RowBlock:
        """Rows [start, stop) of a split; a pure function of (seed, split, start, stop)."""
        first, last = start // CHUNK_ROWS, (stop - 1) // CHUNK_ROWS
        parts = [self._chunk(split, i) for i in range(first, last + 1)]
        lo = start - first * CHUNK_ROWS
        return RowBlock.concat(parts).take(slice(lo, lo + (stop - start)))
