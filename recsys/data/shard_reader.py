"""Reading a shard directory: every shard memory-mapped, any global row range as fresh arrays.

Why apart from the writer: this is all a training rank loads (:mod:`recsys.data.source`), and its
checks at :meth:`ShardedDataset.open` (every file's dtype and shape against the manifest) are what
turn a truncated or mismatched file into one line naming it before training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from recsys.data.shard_format import DENSE_DTYPE, LABEL_DTYPE, SPARSE_DTYPE, InvalidShardDirError, read_manifest, shard_paths

__all__ = ["ShardedDataset"]


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
