"""Writing shards: rows cut into shards of the configured size, the manifest written last, the
directory published atomically, and nothing left behind when writing fails or is abandoned."""

from __future__ import annotations

import errno
import json
import re

import numpy as np
import pytest

import recsys.data.shard_writer as shard_writer
from recsys.data.errors import CacheWriteError
from recsys.data.shard_reader import ShardedDataset
from recsys.data.shard_writer import ShardWriter


def _rows(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row i: dense (i / 2), ids (i, 7 i), label i % 2."""
    i = np.arange(lo, hi)
    return (i[:, None] / 2).astype(np.float32), np.stack([i, 7 * i], axis=1).astype(np.int64), (i % 2).astype(np.float32)


def _writer(dest, **kw) -> ShardWriter:
    return ShardWriter(dest, kind="criteo", dense_names=["I1"], sparse_names=["C1", "C2"], **{"rows_per_shard": 4, **kw})


def test_rows_are_cut_into_shards_and_the_manifest_says_so(tmp_path):
    dest = tmp_path / "ds"
    with _writer(dest) as w:
        for lo, hi in [(0, 3), (3, 9), (9, 10)]:  # chunks that straddle the shard boundaries
            w.append(*_rows(lo, hi))
        assert w.num_rows == 10
        m = w.commit(sources=[{"path": "a.tsv", "good_rows": 10}], extra={"created_by": "test"})
    assert m == {
        "format_version": 1,
        "kind": "criteo",
        "dense_names": ["I1"],
        "sparse_names": ["C1", "C2"],
        "num_rows": 10,
        "rows_per_shard": 4,
        "dense_transform": "log1p(max(x, 0)); missing -> 0",
        "dtypes": {"dense": "<f4", "sparse": "<i8", "labels": "<f4"},
        "missing_id": -1,
        "shards": [{"name": "shard_00000", "num_rows": 4}, {"name": "shard_00001", "num_rows": 4}, {"name": "shard_00002", "num_rows": 2}],
        "sources": [{"path": "a.tsv", "good_rows": 10}],
        "created_by": "test",
    }
    assert json.loads((dest / "manifest.json").read_text()) == m
    # the files themselves, read with numpy: shard 1 holds rows 4..7
    np.testing.assert_array_equal(np.load(dest / "shard_00001.sparse.npy"), [[4, 28], [5, 35], [6, 42], [7, 49]])
    np.testing.assert_array_equal(np.load(dest / "shard_00002.labels.npy"), [0.0, 1.0])
    np.testing.assert_array_equal(np.load(dest / "shard_00000.dense.npy")[:, 0], [0.0, 0.5, 1.0, 1.5])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp dir left


def test_write_then_read_round_trip(tmp_path):
    with _writer(tmp_path / "ds", rows_per_shard=3) as w:
        w.append(*_rows(0, 11))
        w.commit()
    ds = ShardedDataset.open(tmp_path / "ds")
    d, s, lab = ds.read(2, 10)
    want = _rows(2, 10)
    np.testing.assert_array_equal(d, want[0])
    np.testing.assert_array_equal(s, want[1])
    np.testing.assert_array_equal(lab, want[2])


def test_nothing_is_visible_until_commit_and_leaving_without_it_cleans_up(tmp_path):
    dest = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="^stop here$"):
        with _writer(dest) as w:
            w.append(*_rows(0, 9))  # two full shards already on disk, in the temp dir
            assert w.tmp.parent == tmp_path and w.tmp.name.startswith(".ds.tmp.")
            assert not dest.exists()
            raise RuntimeError("stop here")
    assert list(tmp_path.iterdir()) == []
    with _writer(dest) as w:
        w.append(*_rows(0, 2))  # never committed
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="^ShardWriter is closed$"):
        w.append(*_rows(0, 1))
    with pytest.raises(RuntimeError, match="^ShardWriter is closed$"):
        w.commit()


def test_an_existing_directory_is_replaced_only_when_empty_or_asked(tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    with _writer(dest) as w:  # empty: replaced silently
        w.append(*_rows(0, 2))
        w.commit()
    assert ShardedDataset.open(dest).num_rows == 2
    with pytest.raises(
        FileExistsError, match=re.escape(f"{dest} already exists and is not empty; remove it or choose another cache directory")
    ):
        with _writer(dest) as w:
            w.append(*_rows(0, 5))
            w.commit()
    assert ShardedDataset.open(dest).num_rows == 2  # untouched
    with _writer(dest, overwrite=True) as w:
        w.append(*_rows(0, 5))
        w.commit()
    assert ShardedDataset.open(dest).num_rows == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # the old copy is gone


def test_a_failed_shard_write_is_one_line_naming_the_cache_and_publishes_nothing(tmp_path, monkeypatch):
    def full_disk(path, array):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_writer, "save_npy", full_disk)
    dest = tmp_path / "ds"
    msg = f"{dest}: writing the shard cache failed at shard_00000.dense.npy: No space left on device ("
    with pytest.raises(CacheWriteError, match=re.escape(msg)) as e:
        with _writer(dest) as w:
            w.append(*_rows(0, 4))
            w.commit()
    assert e.value.errno == errno.ENOSPC and str(e.value).endswith("bytes free on that filesystem); nothing was written")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_manifest_write_publishes_nothing(tmp_path, monkeypatch):
    def fail(path, obj):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shard_writer, "write_json", fail)
    with pytest.raises(
        CacheWriteError, match=re.escape(f"{tmp_path / 'ds'}: writing the shard cache failed at manifest.json: Input/output error")
    ):
        with _writer(tmp_path / "ds") as w:
            w.append(*_rows(0, 3))
            w.commit()
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_and_chunks(tmp_path):
    with pytest.raises(ValueError, match=re.escape("unknown kind 'movielens'; expected one of ('criteo', 'avazu')")):
        ShardWriter(tmp_path / "ds", kind="movielens", dense_names=[], sparse_names=["a"])
    with pytest.raises(ValueError, match="^rows_per_shard must be >= 1, got 0$"):
        _writer(tmp_path / "ds", rows_per_shard=0)
    assert list(tmp_path.iterdir()) == []
    with _writer(tmp_path / "ds") as w:
        d, s, lab = _rows(0, 3)
        msg = "chunk shapes dense=(3, 1) sparse=(3, 1) labels=(3,) do not match 1 dense / 2 sparse columns"
        with pytest.raises(ValueError, match=re.escape(msg)):
            w.append(d, s[:, :1], lab)
        assert w.num_rows == 0
