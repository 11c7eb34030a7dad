"""On-disk shard format for preprocessed CTR data and its memory-mapped reader.

Raw Criteo/Avazu text is parsed once (see :mod:`recsys.data.preprocess.raw_formats`) into fixed-size numpy
shards so that training never re-parses text and every rank can memory-map any row range cheaply.

Layout of a shard directory::

    manifest.json               # written last; its presence marks a complete directory
    shard_00000.dense.npy       # float32 [n, num_dense], log1p(max(x, 0)), missing -> 0
    shard_00000.sparse.npy      # int64   [n, num_sparse], raw 32-bit ids >= 0, -1 = missing
    shard_00000.labels.npy      # float32 [n]
    shard_00001.*.npy ...

Directories are published atomically: everything is written into a hidden temp directory next
to the destination, fsynced, and moved into place with ``os.replace``. A crash therefore never
leaves a destination that :meth:`ShardedDataset.open` accepts while being incomplete.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from recsys.data.errors import CacheWriteError, write_error

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MISSING_ID = -1
DENSE_TRANSFORM = "log1p(max(x, 0)); missing -> 0"
KINDS = ("criteo", "avazu")

DENSE_DTYPE = np.dtype(np.float32)
SPARSE_DTYPE = np.dtype(np.int64)
LABEL_DTYPE = np.dtype(np.float32)

_SHARD_NAME_RE = re.compile(r"^shard_\d{5,}$")
# A joined dataset (recsys/data/preprocess/fanout.py) lists the shards of its parts where they were written,
# ``parts/NNNNN`` below the manifest, instead of copying them; nothing else is allowed (no ``..``).
_PART_DIR_RE = re.compile(r"^parts/\d{5,}$")
_TMP_TAG = "tmp"
_OLD_TAG = "old"


class InvalidShardDirError(ValueError):
    """A path that is not a complete, consistent shard directory (one-line message)."""


def shard_name(index: int) -> str:
    """Base name of shard ``index`` (files are ``<name>.dense.npy`` etc.)."""
    return f"shard_{index:05d}"


def shard_paths(root: Path, name: str) -> tuple[Path, Path, Path]:
    """(dense, sparse, labels) file paths of one shard."""
    return (
        root / f"{name}.dense.npy",
        root / f"{name}.sparse.npy",
        root / f"{name}.labels.npy",
    )


# --------------------------------------------------------------------------------------------
# Durable, atomic writing
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """fsync a directory so renames/creations inside it survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _save_npy(path: Path, array: np.ndarray) -> None:
    """np.save + fsync, so a later manifest never points at data still in the page cache."""
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def replace_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write ``root``'s manifest in place, atomically and durably (temp file, fsync, rename,
    directory fsync): for a directory whose shard files are already there, e.g. one joined from
    parts (recsys/data/preprocess/fanout.py). Readers see the old manifest or the new one, never a mix."""
    tmp = root / f".{MANIFEST_NAME}.tmp"
    _write_json(tmp, manifest)
    os.replace(tmp, root / MANIFEST_NAME)
    _fsync_dir(root)


def _side_name(dest: Path, tag: str) -> str:
    """Hidden sibling name carrying host and pid, so stale ones can be recognised later."""
    host = socket.gethostname().replace(os.sep, "_") or "host"
    return f".{dest.name}.{tag}.{host}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def clean_stale_temp_dirs(dest: str | Path) -> list[Path]:
    """Remove leftover temp/old siblings of ``dest`` from crashed runs *on this host*.

    Only directories whose recorded pid is no longer alive on this host are removed: a temp dir
    of a concurrent writer (or of another host on a shared filesystem) is never touched.
    """
    dest = Path(dest)
    parent = dest.parent
    if not parent.is_dir():
        return []
    host = socket.gethostname().replace(os.sep, "_") or "host"
    removed: list[Path] = []
    for tag in (_TMP_TAG, _OLD_TAG):
        prefix = f".{dest.name}.{tag}."
        for entry in parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            parts = entry.name[len(prefix) :].rsplit(".", 2)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue
            if _pid_alive(int(parts[1])):
                continue
            logger.warning("removing stale temporary directory %s from a crashed run", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


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
        self.tmp = self.dest.parent / _side_name(self.dest, _TMP_TAG)
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
                _save_npy(path, array)
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
                _write_json(self.tmp / MANIFEST_NAME, manifest)
            except OSError as e:
                raise write_error(self.dest, self.tmp / MANIFEST_NAME, e) from None
            _fsync_dir(self.tmp)
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
                _fsync_dir(dest.parent)
                return
            old = dest.parent / _side_name(dest, _OLD_TAG)
            os.replace(dest, old)
        os.replace(self.tmp, dest)
        _fsync_dir(dest.parent)
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


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Load and structurally validate ``<path>/manifest.json``.

    Raises :class:`InvalidShardDirError` (a ``ValueError``) with a one-line message naming the
    path for a missing directory, missing manifest, bad JSON or missing/ill-typed keys.
    """
    root = Path(path)
    mpath = root / MANIFEST_NAME
    if not root.is_dir():
        raise InvalidShardDirError(f"{root}: shard directory does not exist")
    if not mpath.is_file():
        raise InvalidShardDirError(f"{root}: not a complete shard directory (no {MANIFEST_NAME}; an interrupted write?)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidShardDirError(f"{mpath}: corrupt manifest ({msg})") from None

    def bad(what: str) -> InvalidShardDirError:
        return InvalidShardDirError(f"{mpath}: corrupt manifest ({what})")

    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise bad(f"format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    if manifest.get("kind") not in KINDS:
        raise bad(f"kind {manifest.get('kind')!r}, expected one of {list(KINDS)}")
    for key in ("dense_names", "sparse_names"):
        names = manifest.get(key)
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise bad(f"{key} must be a list of strings")
    num_rows = manifest.get("num_rows")
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 0:
        raise bad("num_rows must be a non-negative integer")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise bad("shards must be a list")
    total = 0
    for s in shards:
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("name"), str)
            or not _SHARD_NAME_RE.match(s["name"])
            or not isinstance(s.get("num_rows"), int)
            or s["num_rows"] <= 0
            or ("dir" in s and not (isinstance(s["dir"], str) and _PART_DIR_RE.match(s["dir"])))
        ):
            raise bad(f"bad shard entry {s!r}")
        total += s["num_rows"]
    if total != num_rows:
        raise bad(f"shard row counts sum to {total}, num_rows says {num_rows}")
    if not isinstance(manifest.get("sources", []), list):
        raise bad("sources must be a list")
    return manifest


class ShardedDataset:
    """Memory-mapped view of a shard directory with random access to any global row range.

    Opening validates the manifest and every shard file's dtype and shape, so a truncated or
    mismatched file fails at ``open`` with a one-line ``ValueError`` rather than mid-training.
    Pickling stores only the path (workers re-map the files instead of copying the data).
    """

    def __init__(self, path: Path, manifest: dict[str, Any], arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
        self.path = path
        self.manifest = manifest
        self._arrays = arrays
        counts = [int(s["num_rows"]) for s in manifest["shards"]]
        self._offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._offsets[1:])

    @classmethod
    def open(cls, path: str | Path) -> "ShardedDataset":
        """Validate ``path`` and memory-map all shards read-only."""
        root = Path(path)
        manifest = read_manifest(root)
        nd, ns = len(manifest["dense_names"]), len(manifest["sparse_names"])
        arrays = []
        for s in manifest["shards"]:
            n = s["num_rows"]
            expected = (
                (DENSE_DTYPE, (n, nd)),
                (SPARSE_DTYPE, (n, ns)),
                (LABEL_DTYPE, (n,)),
            )
            loaded = []
            for p, (dtype, shape) in zip(shard_paths(root / s.get("dir", ""), s["name"]), expected):
                try:
                    a = np.load(p, mmap_mode="r", allow_pickle=False)
                except FileNotFoundError:
                    raise InvalidShardDirError(f"{root}: shard file {p.relative_to(root)} is missing") from None
                except (OSError, ValueError, EOFError) as e:
                    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise InvalidShardDirError(f"{p}: unreadable shard file ({msg})") from None
                if a.dtype != dtype or a.shape != shape:
                    raise InvalidShardDirError(f"{p}: expected {dtype} {shape}, found {a.dtype} {a.shape}")
                loaded.append(a)
            arrays.append(tuple(loaded))
        return cls(root, manifest, arrays)

    # -- metadata ------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self.manifest["num_rows"])

    @property
    def dense_names(self) -> list[str]:
        return list(self.manifest["dense_names"])

    @property
    def sparse_names(self) -> list[str]:
        return list(self.manifest["sparse_names"])

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def num_shards(self) -> int:
        return len(self._arrays)

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"ShardedDataset({str(self.path)!r}, kind={self.kind}, rows={self.num_rows}, "
            f"dense={len(self.dense_names)}, sparse={len(self.sparse_names)}, shards={self.num_shards})"
        )

    # -- pickling: reopen instead of serialising the mapped data ---------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = type(self).open(state["path"])
        self.__dict__.update(other.__dict__)

    # -- data -------------------------------------------------------------------------------------
    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``[start, stop)`` as fresh, writable arrays (dense f32, sparse i64, labels f32).

        The range may span any number of shards. Copies are returned so callers can hand them to
        ``torch.from_numpy`` without aliasing the read-only mappings.
        """
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"row range [{start}, {stop}) outside [0, {self.num_rows}) of {self.path}")
        nd, ns = len(self.manifest["dense_names"]), len(self.manifest["sparse_names"])
        n = stop - start
        dense = np.empty((n, nd), DENSE_DTYPE)
        sparse = np.empty((n, ns), SPARSE_DTYPE)
        labels = np.empty((n,), LABEL_DTYPE)
        if n == 0:
            return dense, sparse, labels
        offsets = self._offsets
        shard = int(np.searchsorted(offsets, start, side="right")) - 1
        out = 0
        pos = start
        while pos < stop:
            lo = pos - int(offsets[shard])
            hi = min(stop, int(offsets[shard + 1])) - int(offsets[shard])
            d, s, lab = self._arrays[shard]
            take = hi - lo
            dense[out : out + take] = d[lo:hi]
            sparse[out : out + take] = s[lo:hi]
            labels[out : out + take] = lab[lo:hi]
            out += take
            pos += take
            shard += 1
        return dense, sparse, labels
