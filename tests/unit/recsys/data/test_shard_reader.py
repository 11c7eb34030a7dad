"""Reading a shard directory written by hand (np.save and a JSON manifest, not the writer): row
ranges across shard boundaries, copies instead of views, pickling by path, and the one-line
errors for a missing, truncated or mismatched shard file."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from recsys.data.shard_format import InvalidShardDirError
from recsys.data.shard_reader import ShardedDataset

SIZES = (4, 3, 5)  # rows of three shards


def _rows(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row i: dense (i, 10 i), ids (i, -1 if i is odd else 100 + i), label i % 2."""
    i = np.arange(n)
    dense = np.stack([i, 10 * i], axis=1).astype(np.float32)
    sparse = np.stack([i, np.where(i % 2 == 1, -1, 100 + i)], axis=1).astype(np.int64)
    return dense, sparse, (i % 2).astype(np.float32)


def _write_dir(root: Path, sizes=SIZES, part: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dense, sparse, labels = _rows(sum(sizes))
    where = root / part if part else root
    where.mkdir(parents=True, exist_ok=True)
    shards, lo = [], 0
    for k, n in enumerate(sizes):
        name = f"shard_{k:05d}"
        np.save(where / f"{name}.dense.npy", dense[lo : lo + n])
        np.save(where / f"{name}.sparse.npy", sparse[lo : lo + n])
        np.save(where / f"{name}.labels.npy", labels[lo : lo + n])
        shards.append({"name": name, "num_rows": n, **({"dir": part} if part else {})})
        lo += n
    manifest = {
        "format_version": 1,
        "kind": "criteo",
        "dense_names": ["I1", "I2"],
        "sparse_names": ["C1", "C2"],
        "num_rows": sum(sizes),
        "shards": shards,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return dense, sparse, labels


def test_any_row_range_reads_the_rows_written(tmp_path):
    dense, sparse, labels = _write_dir(tmp_path / "ds")
    ds = ShardedDataset.open(tmp_path / "ds")
    assert (ds.num_rows, len(ds), ds.num_shards, ds.kind) == (12, 12, 3, "criteo")
    assert ds.dense_names == ["I1", "I2"] and ds.sparse_names == ["C1", "C2"]
    for start, stop in [(0, 12), (0, 4), (3, 5), (4, 7), (2, 11), (11, 12), (6, 6)]:
        d, s, lab = ds.read(start, stop)
        np.testing.assert_array_equal(d, dense[start:stop])
        np.testing.assert_array_equal(s, sparse[start:stop])
        np.testing.assert_array_equal(lab, labels[start:stop])
        assert (d.dtype, s.dtype, lab.dtype) == (np.float32, np.int64, np.float32)
    assert ds.read(3, 5)[1].tolist() == [[3, -1], [4, 104]]  # missing ids stay -1


def test_read_returns_writable_copies(tmp_path):
    _write_dir(tmp_path / "ds")
    ds = ShardedDataset.open(tmp_path / "ds")
    d, s, lab = ds.read(0, 4)
    assert d.flags.writeable and s.flags.writeable and lab.flags.writeable
    d[:] = -5.0
    assert ds.read(0, 4)[0][1].tolist() == [1.0, 10.0]  # the mapped data did not change


def test_rows_outside_the_dataset_are_an_index_error(tmp_path):
    _write_dir(tmp_path / "ds")
    ds = ShardedDataset.open(tmp_path / "ds")
    for start, stop in [(-1, 3), (5, 4), (0, 13)]:
        with pytest.raises(IndexError, match=re.escape(f"row range [{start}, {stop}) outside [0, 12) of {tmp_path / 'ds'}")):
            ds.read(start, stop)


def test_shards_listed_in_a_part_directory_are_read_from_there(tmp_path):
    dense, _, _ = _write_dir(tmp_path / "ds", sizes=(2, 2), part="parts/00003")
    ds = ShardedDataset.open(tmp_path / "ds")
    np.testing.assert_array_equal(ds.read(1, 4)[0], dense[1:4])


def test_pickling_stores_the_path_and_reopens(tmp_path):
    dense, _, _ = _write_dir(tmp_path / "ds")
    ds = ShardedDataset.open(tmp_path / "ds")
    assert ds.__getstate__() == {"path": str(tmp_path / "ds")}
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again.read(2, 9)[0], dense[2:9])
    assert repr(again) == f"ShardedDataset({str(tmp_path / 'ds')!r}, kind=criteo, rows=12, dense=2, sparse=2, shards=3)"


def test_a_missing_shard_file_is_named(tmp_path):
    _write_dir(tmp_path / "ds")
    (tmp_path / "ds" / "shard_00001.sparse.npy").unlink()
    msg = f"{tmp_path / 'ds'}: shard file shard_00001.sparse.npy is missing"
    with pytest.raises(InvalidShardDirError, match=re.escape(msg)):
        ShardedDataset.open(tmp_path / "ds")


def test_a_truncated_shard_file_is_named_at_open(tmp_path):
    _write_dir(tmp_path / "ds")
    f = tmp_path / "ds" / "shard_00002.dense.npy"
    f.write_bytes(f.read_bytes()[:-8])  # the last row loses its second value
    with pytest.raises(InvalidShardDirError, match=re.escape(f"{f}: unreadable shard file (")) as e:
        ShardedDataset.open(tmp_path / "ds")
    assert "\n" not in str(e.value)
    f.write_bytes(b"not an npy file")
    with pytest.raises(InvalidShardDirError, match=re.escape(f"{f}: unreadable shard file (")):
        ShardedDataset.open(tmp_path / "ds")


def test_a_shard_file_of_another_shape_or_dtype_is_named(tmp_path):
    _write_dir(tmp_path / "ds")
    f = tmp_path / "ds" / "shard_00000.labels.npy"
    np.save(f, np.zeros(5, np.float32))
    with pytest.raises(InvalidShardDirError, match=re.escape(f"{f}: expected float32 (4,), found float32 (5,)")):
        ShardedDataset.open(tmp_path / "ds")
    f = tmp_path / "ds" / "shard_00000.labels.npy"
    np.save(f, np.zeros(4, np.float64))
    with pytest.raises(InvalidShardDirError, match=re.escape(f"{f}: expected float32 (4,), found float64 (4,)")):
        ShardedDataset.open(tmp_path / "ds")
