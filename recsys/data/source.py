"""One interface over the three data sources: generated Criteo-like rows, preprocessed Criteo
and preprocessed Avazu shards. A source hands out row ranges of a split; batching is elsewhere."""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

from recsys.config import ConfigError, ExperimentConfig, cardinalities
from recsys.data.identity import shard_identity, synthetic_identity
from recsys.data.order import EpochOrder
from recsys.data.synthetic import EVAL, NUM_DENSE, TRAIN, CriteoLikeGenerator, RowBlock

__all__ = [
    "DataSource",
    "SyntheticSource",
    "ShardSource",
    "build_source",
    "epoch_order",
    "prepare_data",
    "preprocess_task",
    "preprocess_tasks",
    "check_row_counts",
    "TRAIN",
    "EVAL",
]

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

    @abstractmethod
    def identity(self) -> dict:
        """What rows this source serves, as checkpoints record it (recsys/data/identity.py)."""


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
        self._identity = synthetic_identity(d)

    def identity(self) -> dict:
        return self._identity

    def num_rows(self, split: int) -> int:
        return self._rows[split]

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        return self.gen.rows(split, start, stop)


class ShardSource(DataSource):
    """Preprocessed, memory-mapped shards; the eval split is the last `eval_fraction` of rows
    (Criteo and Avazu are time-ordered, so this is the usual 'train on the past' split)."""

    def __init__(self, cfg: ExperimentConfig, shard_dir: Path) -> None:
        from recsys.data.shard_reader import ShardedDataset

        self.ds = ShardedDataset.open(shard_dir)
        self.dense_names = list(self.ds.dense_names)
        self.sparse_names = list(self.ds.sparse_names)
        self.cardinalities = cardinalities(cfg.data)
        if len(self.cardinalities) != len(self.sparse_names):
            raise ConfigError(
                f"key 'data.cardinalities': {len(self.cardinalities)} sizes for {len(self.sparse_names)} fields in {shard_dir}"
            )
        n = self.ds.num_rows
        self._eval_start, _ = split_sizes(n, cfg.data.eval_fraction)
        self._rows = {TRAIN: self._eval_start, EVAL: n - self._eval_start}
        self._identity = shard_identity(self.ds.manifest, cfg.data.eval_fraction)

    def identity(self) -> dict:
        return self._identity

    def num_rows(self, split: int) -> int:
        return self._rows[split]

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        offset = 0 if split == TRAIN else self._eval_start
        dense, sparse, labels = self.ds.read(offset + start, offset + stop)
        return RowBlock(dense, sparse, labels, None)


def raw_files(cfg: ExperimentConfig) -> list[Path]:
    """The raw files named by data.path (a file, a directory or a glob), sorted.

    Hidden files and subdirectories of a directory are skipped; a glob match or a path that is a
    directory where a file is expected is an error (it would otherwise vanish from the inputs).
    """
    p = cfg.data.path
    if os.path.isdir(p):
        files = sorted(f for f in Path(p).iterdir() if f.is_file() and not f.name.startswith("."))
        if not files:
            raise ConfigError(f"key 'data.path': directory {p} holds no data files")
        return files
    if any(ch in p for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(p))
        if not files:
            raise ConfigError(f"key 'data.path': no file matches {p}")
    else:
        files = [Path(p)]
    for f in files:
        if f.is_dir():
            raise ConfigError(f"key 'data.path': {f} is a directory, not a data file")
        if not f.is_file():
            raise ConfigError(f"key 'data.path': no such file {f}")
    return files


def shard_dir(cfg: ExperimentConfig) -> Path:
    """data.cache_dir, or data_cache/<source>-<name of data.path>-<hash of its absolute path>.

    The path hash keeps two inputs with the same name in different directories from sharing
    (and rebuilding each other's) cache; the content key in the manifest is what guarantees
    that a cache is never used for inputs it was not built from.
    """
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir)
    name = Path(cfg.data.path.rstrip("/")).name.replace("*", "_") or "data"
    where = hashlib.sha256(os.path.abspath(cfg.data.path).encode()).hexdigest()[:10]
    return Path("data_cache") / f"{cfg.data.source}-{name}-{where}"


def _world_size(cfg: ExperimentConfig) -> int:
    return int(os.environ.get("WORLD_SIZE", cfg.train.nproc_per_node))


def _file_counts(manifest: dict) -> str:
    sources = manifest.get("sources", [])
    shown = ", ".join(f"{s.get('path')} ({s.get('good_rows')} rows)" for s in sources[:3])
    return shown + (f" and {len(sources) - 3} more files" if len(sources) > 3 else "")


def _has(manifest: dict) -> str:
    return "has" if len(manifest.get("sources", [])) == 1 else "have"


def check_row_counts(cfg: ExperimentConfig, manifest: dict) -> None:
    """Stops before any worker starts when the data cannot fill one global training batch, or
    the eval split cannot give every rank a row: workers would otherwise divide by zero."""
    n = int(manifest["num_rows"])
    train, evaluation = split_sizes(n, cfg.data.eval_fraction)
    batch, world = cfg.train.batch_size, _world_size(cfg)
    if train < batch:
        raise ConfigError(
            f"key 'data.path': {_file_counts(manifest)} {_has(manifest)} {n} valid rows, {train} for training after "
            f"data.eval_fraction={cfg.data.eval_fraction}: fewer than one global batch (train.batch_size={batch})"
        )
    if evaluation < world:
        raise ConfigError(
            f"key 'data.path': {_file_counts(manifest)} {_has(manifest)} {n} valid rows, {evaluation} for evaluation "
            f"(data.eval_fraction={cfg.data.eval_fraction}): fewer than one per rank ({world} ranks)"
        )


def split_sizes(num_rows: int, eval_fraction: float) -> tuple[int, int]:
    """(train rows, eval rows): the eval split is the last round(num_rows * eval_fraction) rows."""
    train = num_rows - int(round(num_rows * eval_fraction))
    return train, num_rows - train


def prepare_data(cfg: ExperimentConfig) -> dict | None:
    """Preprocesses raw files into shards (a no-op for generated data or an up-to-date cache)
    and checks that they hold enough rows; returns the cache's manifest (None: synthetic)."""
    if cfg.data.source == "synthetic":
        return None
    preprocess_files, _ = _preprocessing(cfg)
    manifest = preprocess_files(raw_files(cfg), shard_dir(cfg))
    check_row_counts(cfg, manifest)
    return manifest


def _preprocessing(cfg: ExperimentConfig) -> tuple[Callable[[list[Path], Path], dict], Callable[[list[Path]], dict]]:
    """(files, out -> manifest, files -> cache key): the config's preprocessing of some files
    into one directory, and the cache key that writes for them."""
    from recsys.data.preprocess import raw_formats

    d = cfg.data
    if d.source == "criteo":
        return (
            lambda files, out: raw_formats.preprocess_criteo(
                files, out, fmt=d.format, max_bad_fraction=d.max_bad_fraction, verify=d.verify
            ),
            lambda files: raw_formats.criteo_key(files, d.format, max_bad_fraction=d.max_bad_fraction),
        )
    return (
        lambda files, out: raw_formats.preprocess_avazu(files, out, max_bad_fraction=d.max_bad_fraction, verify=d.verify),
        lambda files: raw_formats.avazu_key(files, max_bad_fraction=d.max_bad_fraction),
    )


def preprocess_task(cfg: ExperimentConfig, task: int, tasks: int) -> dict | None:
    """Task `task` of `tasks` of a fanned-out preprocessing of the config's raw files into its
    shard cache (recsys/data/preprocess/fanout.py); the last task to finish joins the parts. Returns the
    joined manifest (checked like `prepare_data`'s), or None while other parts are missing."""
    from recsys.data.preprocess import fanout

    if cfg.data.source == "synthetic":
        raise ConfigError("key 'data.source': generated data (synthetic) has nothing to preprocess")
    preprocess_files, key_of = _preprocessing(cfg)
    manifest = fanout.run_task(raw_files(cfg), shard_dir(cfg), task, tasks, preprocess_files, key_of)
    if manifest is not None:
        check_row_counts(cfg, manifest)
    return manifest


def preprocess_tasks(cfg: ExperimentConfig, tasks: list[int], total: int) -> dict | None:
    """Several tasks of a fan-out on this machine, one process each (forked, as for many files in
    recsys/data/preprocess/pipeline.py): what one TorchX replica or Slurm task runs when a node takes more
    than one part. Returns the joined manifest if one of them joined (None otherwise); the first
    failure is raised as it was raised in its process."""
    if len(tasks) == 1:
        return preprocess_task(cfg, tasks[0], total)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(len(tasks), mp_context=multiprocessing.get_context(method)) as pool:
        results = [f.result() for f in [pool.submit(preprocess_task, cfg, t, total) for t in tasks]]
    return next((m for m in results if m is not None), None)


def epoch_order(cfg: ExperimentConfig, source: DataSource) -> EpochOrder:
    """The training split's epoch order from `data.shuffle*` (eval is always in order)."""
    d = cfg.data
    return EpochOrder(source.num_rows(TRAIN), d.shuffle, d.shuffle_seed, d.shuffle_block_rows, d.shuffle_buffer_rows)


def build_source(cfg: ExperimentConfig) -> DataSource:
    if cfg.data.source == "synthetic":
        return SyntheticSource(cfg)
    return ShardSource(cfg, shard_dir(cfg))
