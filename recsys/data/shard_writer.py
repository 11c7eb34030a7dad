"""Writing a shard directory: rows appended in chunks, cut into fixed-size shards, published atomically.

Everything is written into a hidden temp directory next to the destination, fsynced, and moved
into place with ``os.replace`` (:mod:`recsys.data.durable_writes`). A crash therefore never leaves
a destination that :meth:`recsys.data.shard_reader.ShardedDataset.open` accepts while being
incomplete. Why apart from the reader: the writer owns the temp directory, the background save
thread and the publish step, none of which a training rank that only reads shards needs.
"""

from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from recsys.data.durable_writes import OLD_TAG, TMP_TAG, clean_stale_temp_dirs, fsync_dir, save_npy, side_name, write_json
from recsys.data.errors import CacheWriteError, write_error
from recsys.data.shard_format import (
    DENSE_DTYPE,
    DENSE_TRANSFORM,
    FORMAT_VERSION,
    KINDS,
    LABEL_DTYPE,
    MANIFEST_NAME,
    MISSING_ID,
    SPARSE_DTYPE,
    shard_name,
    shard_paths,
)

__all__ = ["ShardWriter"]


class ShardWriter:
    """Accumulates rows into fixed-size shards in a temp dir; :meth:`commit` publishes atomically.

    Use as a context manager: leaving the block with an exception (or without calling
    :meth:`commit`) deletes the temp dir, so nothing partial is ever visible at ``out_dir``.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        kind: str,
        dense_names: Sequence[str],
        sparse_names: Sequence[str],
        rows_per_shard: int = 1 << 20,
        overwrite: bool = False,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
        if int(rows_per_shard) < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        self.dest = Path(out_dir).absolute()
        self.kind = kind
        self.dense_names = list(dense_names)
        self.sparse_names = list(sparse_names)
        self.rows_per_shard = int(rows_per_shard)
        self.overwrite = overwrite
        self.tmp = self.dest.parent / side_name(self.dest, TMP_TAG)
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            clean_stale_temp_dirs(self.dest)
            self.tmp.mkdir()
        except OSError as e:
            raise write_error(self.dest, self.tmp, e) from None
        self._shards: list[dict[str, Any]] = []
        self._num_rows = 0
        self._fill = 0
        self._closed = False
        # np.empty does not touch pages, so a large rows_per_shard costs nothing for small inputs.
        self._dense, self._sparse, self._labels = self._buffers()
        # A full shard is written (np.save + fsync) on a background thread while the next one
        # fills the spare buffers: the disk and the parser work at the same time.
        self._spare: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="shard-save")
        self._saving: Future[None] | None = None

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._closed:
            self.abort()

    @property
    def num_rows(self) -> int:
        """Rows appended so far (flushed or buffered)."""
        return self._num_rows

    def append(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
        """Append a chunk of already-transformed rows; full shards are flushed to disk."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        n = int(labels.shape[0])
        if dense.shape != (n, len(self.dense_names)) or sparse.shape != (n, len(self.sparse_names)):
            raise ValueError(
                f"chunk shapes dense={dense.shape} sparse={sparse.shape} labels={labels.shape} do not "
                f"match {len(self.dense_names)} dense / {len(self.sparse_names)} sparse columns"
            )
        pos = 0
        while pos < n:
            take = min(n - pos, self.rows_per_shard - self._fill)
            sl = slice(self._fill, self._fill + take)
            self._dense[sl] = dense[pos : pos + take]
            self._sparse[sl] = sparse[pos : pos + take]
            self._labels[sl] = labels[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == self.rows_per_shard:
                self._flush()
        self._num_rows += n

    def _buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.empty((self.rows_per_shard, len(self.dense_names)), DENSE_DTYPE),
            np.empty((self.rows_per_shard, len(self.sparse_names)), SPARSE_DTYPE),
            np.empty((self.rows_per_shard,), LABEL_DTYPE),
        )

    def _save_shard(self, name: str, arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        for path, array in zip(shard_paths(self.tmp, name), arrays):
            try:
                save_npy(path, array)
            except OSError as e:  # e.g. a full disk: numpy says only "N requested and M written"
                raise write_error(self.dest, path, e) from None  # now, so it reports the free space seen

    def _wait_saved(self) -> None:
        """Wait for the shard being written; its failure aborts the writer and is raised here."""
        saving, self._saving = self._saving, None
        if saving is not None:
            try:
                saving.result()
            except BaseException:
                self.abort()
                raise

    def _flush(self) -> None:
        if self._fill == 0:
            return
        self._wait_saved()  # the spare buffers are free again
        name = shard_name(len(self._shards))
        full = (self._dense[: self._fill], self._sparse[: self._fill], self._labels[: self._fill])
        self._saving = self._saver.submit(self._save_shard, name, full)
        if self._spare is None:
            self._spare = self._buffers()
        (self._dense, self._sparse, self._labels), self._spare = self._spare, (self._dense, self._sparse, self._labels)
        self._shards.append({"name": name, "num_rows": self._fill})
        self._fill = 0

    def commit(self, sources: Sequence[dict[str, Any]] = (), extra: dict[str, Any] | None = None) -> dict:
        """Flush, write the manifest last, fsync, and move the directory into place."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        try:
            self._flush()
            self._wait_saved()
            manifest: dict[str, Any] = {
                "format_version": FORMAT_VERSION,
                "kind": self.kind,
                "dense_names": self.dense_names,
                "sparse_names": self.sparse_names,
                "num_rows": self._num_rows,
                "rows_per_shard": self.rows_per_shard,
                "dense_transform": DENSE_TRANSFORM,
                "dtypes": {"dense": DENSE_DTYPE.str, "sparse": SPARSE_DTYPE.str, "labels": LABEL_DTYPE.str},
                "missing_id": MISSING_ID,
                "shards": list(self._shards),
                "sources": list(sources),
            }
            if extra:
                manifest.update(extra)
            try:
                write_json(self.tmp / MANIFEST_NAME, manifest)
            except OSError as e:
                raise write_error(self.dest, self.tmp / MANIFEST_NAME, e) from None
            fsync_dir(self.tmp)
            try:
                self._publish()
            except (FileExistsError, CacheWriteError):
                raise
            except OSError as e:
                raise write_error(self.dest, self.dest, e) from None
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._saver.shutdown(wait=False)  # idle: the last shard was waited for above
        return manifest

    def _publish(self) -> None:
        dest = self.dest
        old: Path | None = None
        if dest.exists() or dest.is_symlink():
            if not self.overwrite:
                # Only an empty directory may be replaced silently (rename() allows that).
                try:
                    os.replace(self.tmp, dest)
                except OSError as e:
                    if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                        raise FileExistsError(
                            f"{dest} already exists and is not empty; remove it or choose another cache directory"
                        ) from None
                    raise
                fsync_dir(dest.parent)
                return
            old = dest.parent / side_name(dest, OLD_TAG)
            os.replace(dest, old)
        os.replace(self.tmp, dest)
        fsync_dir(dest.parent)
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def abort(self) -> None:
        """Delete the temp dir; the destination is left exactly as it was."""
        self._closed = True
        self._saver.shutdown(wait=True)  # a shard still being written must not outlive the rmtree
        self._saving = None
        shutil.rmtree(self.tmp, ignore_errors=True)
