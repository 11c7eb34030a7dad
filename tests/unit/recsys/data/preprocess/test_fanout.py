"""Fanned-out preprocessing in one process: how the files are split over tasks, and the join
that lists every part's shards in file order under one manifest, once all parts are there and
built from the files as they are now."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from recsys.data.preprocess.fanout import JOINED_BY, join_parts, part_dir, run_task, task_files
from recsys.data.shard_reader import ShardedDataset
from recsys.data.shard_writer import ShardWriter


def _files(where: Path, sizes) -> list[Path]:
    where.mkdir(exist_ok=True)
    out = []
    for i, n in enumerate(sizes):
        f = where / f"in_{i}.txt"
        f.write_bytes(b"x" * n)
        out.append(f)
    return out


def test_task_files_are_contiguous_groups_of_similar_bytes(tmp_path):
    a, b, c, d = _files(tmp_path / "even", [100, 100, 100, 100])
    assert [task_files([a, b, c, d], t, 2) for t in range(2)] == [[a, b], [c, d]]
    big, s1, s2, s3 = _files(tmp_path / "uneven", [300, 10, 10, 10])
    assert [task_files([big, s1, s2, s3], t, 2) for t in range(2)] == [[big], [s1, s2, s3]]
    assert [task_files([a, b, c], t, 5) for t in range(5)] == [[a], [], [b], [], [c]]  # more tasks than files
    with pytest.raises(ValueError, match=re.escape("task 3 is not in 0..2")):
        task_files([a], 3, 3)
    assert part_dir(tmp_path, 7) == tmp_path / "parts" / "00007"


def _key_of(files) -> dict:
    return {"files": [Path(f).name for f in files], "sizes": [Path(f).stat().st_size for f in files]}


def _preprocess(files, out) -> dict:
    """Each input byte is one row; a file of n bytes gives n rows whose id is the file's index
    times 1000 plus the row's index in the file."""
    with ShardWriter(out, kind="avazu", dense_names=[], sparse_names=["C1"], rows_per_shard=3) as w:
        for f in files:
            n, k = f.stat().st_size, int(f.stem.split("_")[1])
            w.append(np.zeros((n, 0), np.float32), (k * 1000 + np.arange(n))[:, None], np.ones(n, np.float32))
        return w.commit(sources=[{"path": str(f), "good_rows": f.stat().st_size} for f in files], extra={"cache_key": _key_of(files)})


def test_the_last_task_to_finish_joins_the_parts_in_file_order(tmp_path):
    files = _files(tmp_path, [4, 2, 5])
    out = tmp_path / "cache"
    assert run_task(files, out, 2, 3, _preprocess, _key_of) is None  # parts 0 and 1 missing
    assert run_task(files, out, 0, 3, _preprocess, _key_of) is None
    m = run_task(files, out, 1, 3, _preprocess, _key_of)
    assert m["num_rows"] == 11 and m["cache_key"] == _key_of(files) and m["created_by"] == f"{JOINED_BY} (3 parts)"
    assert [s["path"] for s in m["sources"]] == [str(f) for f in files]
    assert [(s["dir"], s["name"], s["num_rows"]) for s in m["shards"]] == [
        ("parts/00000", "shard_00000", 3),
        ("parts/00000", "shard_00001", 1),
        ("parts/00001", "shard_00000", 2),
        ("parts/00002", "shard_00000", 3),
        ("parts/00002", "shard_00001", 2),
    ]
    ds = ShardedDataset.open(out)
    assert ds.manifest == m
    assert ds.read(0, 11)[1][:, 0].tolist() == [0, 1, 2, 3, 1000, 1001, 2000, 2001, 2002, 2003, 2004]

    def never(files, out):
        raise AssertionError("an up-to-date cache is not preprocessed again")

    assert run_task(files, out, 0, 3, never, _key_of) == m


def test_a_stale_part_is_not_joined(tmp_path):
    files = _files(tmp_path, [4, 2])
    out = tmp_path / "cache"
    for t in range(2):
        _preprocess(task_files(files, t, 2), part_dir(out, t))
    files[1].write_bytes(b"x" * 3)  # changed after its part was built
    assert join_parts(out, files, 2, _key_of) is None
    assert not (out / "manifest.json").exists()


def test_the_join_removes_what_an_older_cache_left_in_the_same_place(tmp_path):
    files = _files(tmp_path, [2, 2])
    out = tmp_path / "cache"
    _preprocess(files[:1], out)  # an older single-process cache: top-level shards
    _preprocess(files[:1], part_dir(out, 5))  # an older fan-out's part
    for t in range(2):
        _preprocess(task_files(files, t, 2), part_dir(out, t))
    m = join_parts(out, files, 2, _key_of)
    assert m["num_rows"] == 4
    assert sorted(p.name for p in out.iterdir()) == [".join.lock", "manifest.json", "parts"]
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["00000", "00001"]
    assert ShardedDataset.open(out).read(0, 4)[1][:, 0].tolist() == [0, 1, 1000, 1001]


def test_parts_with_other_columns_are_not_joined(tmp_path):
    files = _files(tmp_path, [2, 2])
    out = tmp_path / "cache"
    _preprocess(files[:1], part_dir(out, 0))
    with ShardWriter(part_dir(out, 1), kind="avazu", dense_names=[], sparse_names=["C2"]) as w:
        w.append(np.zeros((2, 0), np.float32), np.zeros((2, 1), np.int64), np.zeros(2, np.float32))
        w.commit(extra={"cache_key": _key_of(files[1:])})
    with pytest.raises(ValueError, match=re.escape(f"{part_dir(out, 1)}: its columns differ from {part_dir(out, 0)}'s")):
        join_parts(out, files, 2, _key_of)
