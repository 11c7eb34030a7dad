"""The trainer's side of cache sizing: its data sources turned into per-table id counts.

``sharding/planner/cache_sizing.py`` (a library that never imports ``recsys``) takes counts or a JSON
histogram file; this adapter reads the samples that only the trainer knows how to read:

- ``synthetic:N`` -- N rows drawn from the configured Criteo-like generator
  (``recsys/data/synthetic.py``), ``data:N`` -- the first N training rows of the configured data
  source (generated, or preprocessed Criteo/Avazu shards);
- a preprocessed shard directory (``recsys/data/shard_format.py``), optionally ``DIR:N`` for the first
  N rows;
- anything else is a JSON histogram file (``sharding.planner.cache_sizing.load_histogram``).
"""

from __future__ import annotations

from pathlib import Path

from sharding.planner.cache_sizing import (
    IdFrequencyStats,
    SampleError,
    counts_from_rows,
    load_histogram,
    stats_from_counts,
    table_features,
)


def _parse_rows(spec: str, text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise SampleError(f"--data-sample {spec}: expected a positive row count after ':', got {text!r}")
    return n


def load_sample(spec: str, module, cfg=None, batch: int = 0) -> dict[str, IdFrequencyStats]:
    """Per-table :class:`IdFrequencyStats` of ``module``'s tables from a sample ``spec`` (see the
    module docstring). ``cfg`` (an ``ExperimentConfig``) is needed for ``synthetic:N``/``data:N``."""
    tables = table_features(module)
    if spec.startswith(("synthetic:", "data:")):
        kind, _, n_text = spec.partition(":")
        n = _parse_rows(spec, n_text)
        if cfg is None:
            raise SampleError(f"--data-sample {spec}: needs the experiment config")
        from recsys.data.source import TRAIN, SyntheticSource, build_source

        src = SyntheticSource(cfg) if kind == "synthetic" else build_source(cfg)
        n = min(n, src.num_rows(TRAIN)) if kind == "data" else n
        block = src.read(TRAIN, 0, n)
        return stats_from_counts(counts_from_rows(block.sparse, src.cardinalities, src.sparse_names), tables, batch, spec)
    path_text, n = spec, None
    p = Path(spec)
    if not p.exists() and ":" in spec:
        head, _, tail = spec.rpartition(":")
        if Path(head).is_dir():
            path_text, n = head, _parse_rows(spec, tail)
            p = Path(head)
    if p.is_dir():
        from recsys.data.shard_reader import ShardedDataset

        try:
            ds = ShardedDataset.open(p)
        except ValueError as e:
            raise SampleError(f"{path_text}: not a preprocessed shard directory: {str(e).splitlines()[0]}") from None
        stop = ds.num_rows if n is None else min(n, ds.num_rows)
        _, sparse, _ = ds.read(0, stop)
        names = list(ds.sparse_names)
        cards = []
        for f in names:
            owners = [t for t, (feats, _) in tables.items() if f in feats]
            if not owners:
                raise SampleError(f"{path_text}: key '{f}': feature read by no table of the model")
            cards.append(tables[owners[0]][1])
        return stats_from_counts(counts_from_rows(sparse, cards, names), tables, batch, path_text)
    if not p.exists():
        raise SampleError(f"{spec}: no such file (expected a JSON id histogram, a shard directory, synthetic:N or data:N)")
    return load_histogram(p, tables, batch)
