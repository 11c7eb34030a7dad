"""One interface over the three data sources: generated Criteo-like rows, preprocessed Criteo
and preprocessed Avazu shards. A source hands out row ranges of a split; batching is elsewhere."""

from __future__ import annotations

import glob
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path

from recsys.config import ConfigError, ExperimentConfig, cardinalities
from recsys.data.synthetic import EVAL, NUM_DENSE, TRAIN, CriteoLikeGenerator, RowBlock

__all__ = ["DataSource", "SyntheticSource", "ShardSource", "build_source", "prepare_data", "TRAIN", "EVAL"]

log = logging.getLogger(__name__)


class DataSource(ABC):
    dense_names: list[str]
    sparse_names: list[str]
    cardinalities: list[int]
    has_oracle: bool = False

    @abstractmethod
    def num_rows(self, split: int) -> int: ...

    @abstractmethod
    def read(self, split: int, start: int, stop: int) -> RowBlock: ...


class SyntheticSource(DataSource):
    has_oracle = True

    def __init__(self, cfg: ExperimentConfig) -> None:
        d = cfg.data
        self.cardinalities = cardinalities(d)
        self.dense_names = [f"I{i + 1}" for i in range(NUM_DENSE)]
        self.sparse_names = [f"C{i + 1}" for i in range(len(self.cardinalities))]
        self.gen = CriteoLikeGenerator(
            self.cardinalities,
            seed=d.seed,
            zipf_exponent=d.zipf_exponent,
            teacher_head=d.teacher_head,
            teacher_dim=d.teacher_dim,
            teacher_scale=d.teacher_scale,
            positive_rate=d.positive_rate,
        )
        self._rows = {TRAIN: d.train_rows, EVAL: d.eval_rows}

    def num_rows(self, split: int) -> int:
        return self._rows[split]

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        return self.gen.rows(split, start, stop)


class ShardSource(DataSource):
    """Preprocessed, memory-mapped shards; the eval split is the last `eval_fraction` of rows
    (Criteo and Avazu are time-ordered, so this is the usual 'train on the past' split)."""

    def __init__(self, cfg: ExperimentConfig, shard_dir: Path) -> None:
        from recsys.data.shards import ShardedDataset

        self.ds = ShardedDataset.open(shard_dir)
        self.dense_names = list(self.ds.dense_names)
        self.sparse_names = list(self.ds.sparse_names)
        self.cardinalities = cardinalities(cfg.data)
        if len(self.cardinalities) != len(self.sparse_names):
            raise ConfigError(
                f"key 'data.cardinalities': {len(self.cardinalities)} sizes for {len(self.sparse_names)} fields in {shard_dir}"
            )
        n = self.ds.num_rows
        self._eval_start = n - int(round(n * cfg.data.eval_fraction))
        self._rows = {TRAIN: self._eval_start, EVAL: n - self._eval_start}

    def num_rows(self, split: int) -> int:
        return self._rows[split]

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        offset = 0 if split == TRAIN else self._eval_start
        dense, sparse, labels = self.ds.read(offset + start, offset + stop)
        return RowBlock(dense, sparse, labels, None)


def raw_files(cfg: ExperimentConfig) -> list[Path]:
    """The raw files named by data.path (a file, a directory or a glob), sorted."""
    p = cfg.data.path
    if os.path.isdir(p):
        files = sorted(f for f in Path(p).iterdir() if f.is_file() and not f.name.startswith("."))
    elif any(ch in p for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(p))
    else:
        files = [Path(p)]
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise ConfigError(f"key 'data.path': no such file {missing[0] if missing else p}")
    return files


def shard_dir(cfg: ExperimentConfig) -> Path:
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir)
    name = Path(cfg.data.path.rstrip("/")).name.replace("*", "_") or "data"
    return Path("data_cache") / f"{cfg.data.source}-{name}"


def prepare_data(cfg: ExperimentConfig) -> None:
    """Preprocesses raw files into shards once (a no-op for generated data or existing shards)."""
    if cfg.data.source == "synthetic":
        return
    from recsys.data import raw_formats

    files = raw_files(cfg)
    out = shard_dir(cfg)
    if cfg.data.source == "criteo":
        raw_formats.preprocess_criteo(files, out, fmt=cfg.data.format, max_bad_fraction=cfg.data.max_bad_fraction)
    else:
        raw_formats.preprocess_avazu(files, out, max_bad_fraction=cfg.data.max_bad_fraction)


def build_source(cfg: ExperimentConfig) -> DataSource:
    if cfg.data.source == "synthetic":
        return SyntheticSource(cfg)
    return ShardSource(cfg, shard_dir(cfg))
