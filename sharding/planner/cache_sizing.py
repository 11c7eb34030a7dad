"""Cache sizing from data: per-table id frequencies -> hit rate of a UVM cache -> load factor.

A ``fused_uvm_caching`` table keeps ``load_factor x rows`` rows in HBM and the rest in host
memory. How many lookups the cache serves depends on the id distribution, not on the load factor
alone (torchrec's estimator takes the load factor *as* the hit rate, which is right only for
uniformly popular ids). From a sample of the data we get each table's id frequencies and so the
hit rate of an **ideal frequency-ordered cache** (LFU with perfect knowledge, no warm-up) that
holds the ``c x rows`` most frequent ids:

    hit(c) = (lookups of the ceil(c x rows) most frequent ids) / (all lookups)

This is an **upper bound** for the LRU/LFU caches FBGEMM runs: a real cache also misses on
first touches, on ids whose popularity drifts, and LRU evicts hot rows after bursts of cold ones.
A small sample also flatters the curve (ids seen once in the sample look as "hot" as they are
rare); sample at least ~10x more lookups than the cache has rows for the estimate to mean much.

Inputs: id counts per table or feature (``stats_from_counts``), or a JSON histogram file
(``load_histogram``, the format below). This package reads no training data itself: the
trainer's adapter (``recsys/data/id_histogram.py``: ``synthetic:N``, ``data:N``, a shard
directory) turns its data sources into counts and calls ``stats_from_counts``.

JSON histogram format (keys are table names, or feature names, which count for every table that
reads the feature)::

    {"format": "recsys-id-histogram", "version": 1,      # both optional
     "tables": {
        "t_C3": {"counts": [120, 7, 7, 3, 1, ...]},     # lookups per distinct id, any order;
                                                        # ids not listed were not seen
        "t_C4": {"counts": [...], "num_embeddings": 2202608}}}   # optional check

``{"t_C3": {"counts": [...]}, ...}`` (without the ``tables`` wrapper) is accepted too.

In the planner (``TopologyAwarePlanner(cache_stats=...)``): each sampled table's
``ParameterConstraints.cache_params`` becomes ``CacheParams(load_factor=L, stats=IdFrequencyStats)``
with ``L`` the smallest load factor whose hit rate reaches ``target_hit_rate`` (default 0.95;
at most ``MAX_CACHE_LOAD_FACTOR``); the cost model charges host memory traffic for the measured
miss rate ``stats.expected_miss_rate(L)`` instead of ``1 - L``; after the search, HBM left free is
given to the caching tables whose modeled miss traffic drops most per byte, and no table's cache
grows past the point where its curve stops rising.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
from torchrec.distributed.types import CacheStatistics

from sharding.constants import MAX_CACHE_LOAD_FACTOR

FORMAT = "recsys-id-histogram"
DEFAULT_TARGET_HIT_RATE = 0.95
LF_STEP = 0.01  # load factors are chosen on this grid
MIN_LOAD_FACTOR = 0.01


class SampleError(ValueError):
    """A bad sample: one line naming the file (or spec) and the key."""


class IdFrequencyStats(CacheStatistics):
    """Hit-rate curve of an ideal frequency-ordered cache for one table (torchrec
    ``CacheStatistics``; immutable, so deep copies share it).

    ``counts``: lookups per distinct id seen (any order, zeros allowed); ``rows``: the table's
    ``num_embeddings``; ``batch``: global batch size, for ``expected_lookups``.

    When every row was seen, or no id was seen exactly once (e.g. the counts are a known
    distribution, not a sample), the curve is the histogram's own: ``hit(c)`` = share of the
    counted lookups on the ``ceil(c x rows)`` largest counts. Otherwise the sample missed part of
    the distribution, and the in-sample curve would reach 1.0 as soon as the cache holds every id
    the sample happened to see. Then (Good-Turing) the ids not seen get the missing mass
    ``p0 = N1 / N`` (N1: ids seen once, N: lookups), the ids seen once ``2 N2 / N`` together (N2:
    ids seen twice), the others their counted shares, all scaled to sum to 1; the unseen ids (ranks
    ``d+1 .. rows``) follow the power law ``rank^-alpha``
    fitted to the seen counts (least squares of log count on log rank over counts >= 3; uniform
    when the fit has too few points)."""

    def __init__(self, counts: Iterable[int] | np.ndarray, rows: int, batch: int = 0) -> None:
        c = np.asarray(counts, dtype=np.float64).reshape(-1)
        if rows <= 0:
            raise ValueError(f"rows must be positive, got {rows}")
        if c.size and (not np.all(np.isfinite(c)) or c.min() < 0):
            raise ValueError("counts must be finite and non-negative")
        c = np.sort(c[c > 0])[::-1]
        if c.size > rows:
            raise ValueError(f"{c.size} distinct ids seen, the table has {rows} rows")
        self.rows = int(rows)
        self.total = float(c.sum())
        self.distinct = d = int(c.size)
        self._batch = int(batch)
        singles = int(np.count_nonzero(c == 1.0))
        doubles = int(np.count_nonzero(c == 2.0))
        self.missing_mass = singles / self.total if (self.total and d < rows) else 0.0
        mass = c.copy()
        if self.missing_mass:  # Good-Turing: ids seen once carry 2 N2 / N in all, not N1 / N
            mass[c == 1.0] = min(2.0 * doubles, singles) / max(singles, 1)
            if mass.sum() > 0 and self.missing_mass < 1.0:
                mass *= (1.0 - self.missing_mass) / mass.sum()
            else:  # every id seen once: the sample says nothing about popularity (uniform)
                self.missing_mass, d, mass = 1.0, 0, mass[:0]
                self.distinct = 0
        else:
            mass /= self.total or 1.0
        self._cum = np.concatenate([[0.0], np.cumsum(mass)])  # _cum[k]: share of the top k seen ids
        self._probs = mass
        self.alpha = 0.0
        fit = c >= 3
        if self.missing_mass and np.count_nonzero(fit) >= 10:
            x = np.log(np.arange(1, d + 1, dtype=np.float64)[fit])
            y = np.log(c[fit])
            slope = np.polyfit(x, y, 1)[0]
            self.alpha = float(np.clip(-slope, 0.0, 3.0))

    # the curve ----------------------------------------------------------------------------------

    def _tail(self, k: np.ndarray) -> np.ndarray:
        """Share of the missing mass on unseen ranks d+1..k (k > d), power law rank^-alpha."""
        d, n, a = float(self.distinct), float(self.rows), self.alpha
        lo = max(d, 1.0)  # integral of r^-a over [d, k] / over [d, rows]
        if abs(a) < 1e-9:
            f = (k - d) / (n - d)
        elif abs(a - 1.0) < 1e-9:
            f = np.log(k / lo) / np.log(n / lo)
        else:
            b = 1.0 - a
            f = (np.power(k, b) - lo**b) / (n**b - lo**b)
        return np.clip(f, 0.0, 1.0)

    def hit_rate(self, load_factor: float | np.ndarray) -> float | np.ndarray:
        """Expected share of lookups served by a cache of the ``ceil(load_factor x rows)`` most
        frequent ids (see the class docstring)."""
        lf = np.clip(np.asarray(load_factor, dtype=np.float64), 0.0, 1.0)
        k = np.ceil(lf * self.rows - 1e-9).astype(np.int64)
        if not self.total:
            out = np.where(lf > 0, lf, 0.0)  # nothing seen: as uniform
        else:
            out = self._cum[np.minimum(k, self.distinct)]
            if self.missing_mass:
                over = k > self.distinct
                out = out + self.missing_mass * np.where(over, self._tail(np.maximum(k, self.distinct + 1).astype(np.float64)), 0.0)
            out = np.clip(out, 0.0, 1.0)
        return float(out) if out.ndim == 0 else out

    def saturation_load_factor(self, tol: float = 1e-3) -> float:
        """Smallest load factor (on the LF_STEP grid) within ``tol`` of the full hit rate."""
        return self.min_load_factor(1.0 - tol)

    def min_load_factor(self, target: float) -> float:
        """Smallest load factor on the LF_STEP grid whose hit rate reaches ``target`` (1.0 if none)."""
        grid = np.round(np.arange(1, int(round(1 / LF_STEP)) + 1) * LF_STEP, 6)
        ok = np.flatnonzero(self.hit_rate(grid) >= target - 1e-12)
        return float(grid[ok[0]]) if ok.size else 1.0

    # torchrec CacheStatistics -------------------------------------------------------------------

    def expected_miss_rate(self, clf: float) -> float:
        return float(1.0 - self.hit_rate(clf))

    @property
    def expected_lookups(self) -> float:
        """Expected distinct ids in a global batch of ``batch`` lookups (sum of 1 - (1-p)^B)."""
        if not self._batch or not self.total:
            return 0.0
        return float(np.sum(-np.expm1(self._batch * np.log1p(-np.minimum(self._probs, 1 - 1e-15)))))

    @property
    def cacheability(self) -> float:
        """Area under the miss-ratio curve (0: very cacheable, 1: uniform ids)."""
        miss = 1.0 - self.hit_rate(np.linspace(0.0, 1.0, 101))
        return float((miss[:-1] + miss[1:]).sum() / 200.0)  # trapezoid rule

    def __deepcopy__(self, memo) -> "IdFrequencyStats":
        return self  # immutable; torchrec's enumerator deep-copies cache_params per option

    def __repr__(self) -> str:
        return (
            f"IdFrequencyStats(rows={self.rows}, lookups={int(self.total)}, distinct={self.distinct}, "
            f"missing_mass={self.missing_mass:.3f}, alpha={self.alpha:.2f}, hit@0.1={self.hit_rate(0.1):.3f})"
        )


# --- loading samples ------------------------------------------------------------------------------


def table_features(module) -> dict[str, tuple[list[str], int]]:
    """Table -> (feature names, num_embeddings) of every EmbeddingBagCollection in ``module``."""
    from sharding.tables import table_configs

    out: dict[str, tuple[list[str], int]] = {}
    for c in table_configs(module):
        out[c.name] = (list(c.feature_names), int(c.num_embeddings))
    return out


def stats_from_counts(
    counts: Mapping[str, np.ndarray], tables: Mapping[str, tuple[list[str], int]], batch: int = 0, source: str = "sample"
) -> dict[str, IdFrequencyStats]:
    """Per-table stats from counts keyed by table or feature name (a feature's counts go to
    every table reading it). Unknown keys raise :class:`SampleError`."""
    by_feature: dict[str, list[str]] = {}
    for t, (feats, _) in tables.items():
        for f in feats:
            by_feature.setdefault(f, []).append(t)
    per_table: dict[str, list[np.ndarray]] = {}
    for key, c in counts.items():
        targets = [key] if key in tables else by_feature.get(key)
        if not targets:
            known = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
            raise SampleError(f"{source}: key '{key}': no such table or feature in the model (tables: {known})")
        for t in targets:
            per_table.setdefault(t, []).append(np.asarray(c))
    out = {}
    for t, parts in per_table.items():
        c = parts[0] if len(parts) == 1 else np.concatenate(parts)
        try:
            out[t] = IdFrequencyStats(c, tables[t][1], batch)
        except ValueError as e:
            raise SampleError(f"{source}: key '{t}': {e}") from None
    return out


def counts_from_rows(sparse: np.ndarray, cardinalities: list[int] | np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """Per-feature lookups per distinct id of a block of rows (ids hashed mod the table size,
    -1 = missing, as ``recsys/data/batching.py`` does)."""
    cards = np.asarray(cardinalities, dtype=np.int64)
    out = {}
    for f, name in enumerate(names):
        col = sparse[:, f]
        col = col[col >= 0] % cards[f]
        _, c = np.unique(col, return_counts=True)
        out[name] = c
    return out


def _read_json(path: Path) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """(counts by table or feature name, num_embeddings given in the file)."""
    src = str(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SampleError(f"{src}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SampleError(f"{src}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise SampleError(f"{src}: not JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if not isinstance(doc, dict):
        raise SampleError(f"{src}: expected a JSON object of tables, got {type(doc).__name__}")
    prefix = ""
    if "tables" in doc:
        if doc.get("format", FORMAT) != FORMAT:
            raise SampleError(f"{src}: key 'format': expected '{FORMAT}', got {doc.get('format')!r}")
        if doc.get("version", 1) != 1:
            raise SampleError(f"{src}: key 'version': unsupported version {doc.get('version')!r} (this reader knows 1)")
        extra = sorted(set(doc) - {"format", "version", "tables", "description"})
        if extra:
            raise SampleError(f"{src}: key '{extra[0]}': unknown key (expected format, version, tables, description)")
        doc, prefix = doc["tables"], "tables."
        if not isinstance(doc, dict):
            raise SampleError(f"{src}: key 'tables': expected an object of tables, got {type(doc).__name__}")
    if not doc:
        raise SampleError(f"{src}: no tables in the sample")
    out, sizes = {}, {}
    for name, entry in doc.items():
        key = f"{prefix}{name}"
        if not isinstance(entry, dict):
            raise SampleError(f"{src}: key '{key}': expected an object with 'counts', got {type(entry).__name__}")
        unknown = sorted(set(entry) - {"counts", "num_embeddings"})
        if unknown:
            raise SampleError(f"{src}: key '{key}.{unknown[0]}': unknown key (expected counts, num_embeddings)")
        if "counts" not in entry:
            raise SampleError(f"{src}: key '{key}.counts': missing")
        c = entry["counts"]
        if not isinstance(c, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in c):
            raise SampleError(f"{src}: key '{key}.counts': expected a list of numbers")
        arr = np.asarray(c, dtype=np.float64)
        if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
            bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0))[0])
            raise SampleError(f"{src}: key '{key}.counts[{bad}]': expected a non-negative count, got {c[bad]!r}")
        if "num_embeddings" in entry:
            n = entry["num_embeddings"]
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise SampleError(f"{src}: key '{key}.num_embeddings': expected a positive integer, got {n!r}")
            sizes[name] = n
        out[name] = arr
    return out, sizes


def _check_sizes(path: str, doc_sizes: dict[str, int], tables: Mapping[str, tuple[list[str], int]]) -> None:
    for name, n in doc_sizes.items():
        if name in tables and tables[name][1] != n:
            raise SampleError(f"{path}: key 'tables.{name}.num_embeddings': {n}, the model's table has {tables[name][1]} rows")


def load_histogram(path: str | Path, module_or_tables, batch: int = 0) -> dict[str, IdFrequencyStats]:
    """Per-table :class:`IdFrequencyStats` from a JSON id histogram file (the format in the module
    docstring). ``module_or_tables``: a module with embedding tables, or ``table_features(module)``.
    Data sources (generated rows, shard directories) are turned into counts on the trainer's side
    (``recsys/data/id_histogram.py``), which calls :func:`stats_from_counts`."""
    tables = module_or_tables if isinstance(module_or_tables, Mapping) else table_features(module_or_tables)
    p = Path(path)
    if not p.exists():
        raise SampleError(f"{path}: no such file (expected a JSON id histogram)")
    counts, sizes = _read_json(p)
    _check_sizes(str(path), sizes, tables)
    return stats_from_counts(counts, tables, batch, str(path))


def histogram_json(stats_counts: Mapping[str, np.ndarray], description: str = "") -> str:
    """The JSON histogram format for per-table (or per-feature) counts."""
    doc = {"format": FORMAT, "version": 1}
    if description:
        doc["description"] = description
    doc["tables"] = {k: {"counts": [int(x) for x in np.asarray(v).tolist()]} for k, v in stats_counts.items()}
    return json.dumps(doc)


def choose_load_factor(stats: CacheStatistics, target_hit_rate: float, max_load_factor: float) -> float:
    """Smallest load factor on the LF_STEP grid whose expected hit rate reaches the target,
    capped at ``max_load_factor`` (and at least ``MIN_LOAD_FACTOR``)."""
    if isinstance(stats, IdFrequencyStats):
        lf = stats.min_load_factor(target_hit_rate)
    else:
        lf = 1.0
        for k in range(1, int(round(1 / LF_STEP)) + 1):
            if 1.0 - stats.expected_miss_rate(k * LF_STEP) >= target_hit_rate - 1e-12:
                lf = k * LF_STEP
                break
    return round(min(max(lf, MIN_LOAD_FACTOR), max_load_factor), 6)


def saturation_load_factor(stats: CacheStatistics, tol: float = 1e-3) -> float:
    """Smallest load factor on the LF_STEP grid within ``tol`` of a full cache's hit rate."""
    if isinstance(stats, IdFrequencyStats):
        return stats.saturation_load_factor(tol)
    full = 1.0 - stats.expected_miss_rate(1.0)
    for k in range(1, int(round(1 / LF_STEP)) + 1):
        if 1.0 - stats.expected_miss_rate(k * LF_STEP) >= full - tol:
            return k * LF_STEP
    return 1.0


def apply_cache_stats(
    constraints: dict,
    stats: Mapping[str, CacheStatistics],
    target_hit_rate: float = DEFAULT_TARGET_HIT_RATE,
    max_load_factor: float | None = None,
) -> dict[str, float]:
    """Put each sampled table's stats and chosen load factor into its torchrec
    ``ParameterConstraints.cache_params`` (other CacheParams fields are kept; a table without
    constraints gets default ones). Returns table -> chosen load factor."""
    import dataclasses

    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams

    if max_load_factor is None:
        max_load_factor = MAX_CACHE_LOAD_FACTOR
    chosen = {}
    for name, st in stats.items():
        lf = choose_load_factor(st, target_hit_rate, max_load_factor)
        pc = constraints.get(name)
        if pc is None:
            pc = constraints[name] = ParameterConstraints()
        cp = pc.cache_params
        pc.cache_params = dataclasses.replace(cp, load_factor=lf, stats=st) if cp is not None else CacheParams(load_factor=lf, stats=st)
        chosen[name] = lf
    return chosen


def summary(
    stats: Mapping[str, IdFrequencyStats],
    load_factors: Mapping[str, float] | None = None,
    target_hit_rate: float | None = None,
    max_load_factor: float = 0.8,
) -> dict:
    """Per table: lookups, distinct ids, hit rate at a few load factors; with ``target_hit_rate``
    the load factor chosen for it (``target_load_factor``, its ``target_hit``); with
    ``load_factors`` (the plan's UVM-caching tables) the final ``load_factor`` and ``hit_rate``."""
    out = {}
    for t in sorted(stats):
        s = stats[t]
        d = {
            "lookups": int(s.total),
            "distinct_ids": s.distinct,
            "rows": s.rows,
            "hit_rate_at": {str(x): round(float(s.hit_rate(x)), 4) for x in (0.01, 0.05, 0.1, 0.2, 0.5)},
        }
        if target_hit_rate is not None:
            lf = choose_load_factor(s, target_hit_rate, max_load_factor)
            d["target_load_factor"] = lf
            d["target_hit"] = round(float(s.hit_rate(lf)), 4)
        if load_factors and t in load_factors:
            d["load_factor"] = load_factors[t]
            d["hit_rate"] = round(float(s.hit_rate(load_factors[t])), 4)
        out[t] = d
    return out
