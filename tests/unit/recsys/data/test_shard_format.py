"""The shard directory's names and the manifest check every reader relies on: a manifest that
is not complete and consistent is refused with one line naming the file and what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from recsys.data.shard_format import FORMAT_VERSION, MANIFEST_NAME, InvalidShardDirError, read_manifest, shard_name, shard_paths


def _manifest(**over) -> dict:
    m = {
        "format_version": FORMAT_VERSION,
        "kind": "criteo",
        "dense_names": ["I1"],
        "sparse_names": ["C1", "C2"],
        "num_rows": 5,
        "shards": [{"name": "shard_00000", "num_rows": 3}, {"name": "shard_00001", "num_rows": 2}],
        "sources": [],
    }
    m.update(over)
    return m


def _write(root: Path, manifest) -> Path:
    root.mkdir(exist_ok=True)
    (root / MANIFEST_NAME).write_text(json.dumps(manifest) if not isinstance(manifest, str) else manifest)
    return root / MANIFEST_NAME


def test_shard_names_and_paths():
    assert shard_name(0) == "shard_00000" and shard_name(123456) == "shard_123456"
    root = Path("/data/ds")
    assert shard_paths(root, "shard_00007") == (
        Path("/data/ds/shard_00007.dense.npy"),
        Path("/data/ds/shard_00007.sparse.npy"),
        Path("/data/ds/shard_00007.labels.npy"),
    )


def test_a_consistent_manifest_is_returned_as_written(tmp_path):
    m = _manifest(shards=[{"name": "shard_00000", "num_rows": 3}, {"name": "shard_00000", "num_rows": 2, "dir": "parts/00001"}])
    _write(tmp_path / "ds", m)
    assert read_manifest(tmp_path / "ds") == m
    assert read_manifest(str(tmp_path / "ds")) == m  # a str path too


def test_missing_directory_and_missing_manifest(tmp_path):
    with pytest.raises(InvalidShardDirError, match=re.escape(f"{tmp_path / 'nope'}: shard directory does not exist")):
        read_manifest(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    msg = f"{tmp_path / 'half'}: not a complete shard directory (no manifest.json; an interrupted write?)"
    with pytest.raises(InvalidShardDirError, match=re.escape(msg)):
        read_manifest(tmp_path / "half")


def test_unparsable_manifest_names_the_file(tmp_path):
    mpath = _write(tmp_path / "ds", '{"format_version": 1,')
    with pytest.raises(InvalidShardDirError, match=re.escape(f"{mpath}: corrupt manifest (Expecting property name")) as e:
        read_manifest(tmp_path / "ds")
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)  # the command line prints ValueErrors as one line


@pytest.mark.parametrize(
    "manifest,what",
    [
        ([1, 2], "not a JSON object"),
        (_manifest(format_version=2), f"format_version 2, expected {FORMAT_VERSION}"),
        (_manifest(kind="movielens"), "kind 'movielens', expected one of ['criteo', 'avazu']"),
        (_manifest(dense_names="I1"), "dense_names must be a list of strings"),
        (_manifest(sparse_names=["C1", 2]), "sparse_names must be a list of strings"),
        (_manifest(num_rows=-1), "num_rows must be a non-negative integer"),
        (_manifest(num_rows=True), "num_rows must be a non-negative integer"),
        (_manifest(num_rows=5.0), "num_rows must be a non-negative integer"),
        (_manifest(shards={"name": "shard_00000"}), "shards must be a list"),
        (_manifest(shards=[{"name": "shard_0", "num_rows": 5}]), "bad shard entry {'name': 'shard_0', 'num_rows': 5}"),
        (_manifest(shards=[{"name": "shard_00000", "num_rows": 0}]), "bad shard entry {'name': 'shard_00000', 'num_rows': 0}"),
        (
            _manifest(shards=[{"name": "shard_00000", "num_rows": 5, "dir": "../other"}]),
            "bad shard entry {'name': 'shard_00000', 'num_rows': 5, 'dir': '../other'}",
        ),
        (
            _manifest(shards=[{"name": "shard_00000", "num_rows": 5, "dir": "parts/00001/../../x"}]),
            "bad shard entry {'name': 'shard_00000', 'num_rows': 5, 'dir': 'parts/00001/../../x'}",
        ),
        (_manifest(num_rows=6), "shard row counts sum to 5, num_rows says 6"),
        (_manifest(sources={"path": "x"}), "sources must be a list"),
    ],
)
def test_inconsistent_manifest_says_what_is_wrong(tmp_path, manifest, what):
    mpath = _write(tmp_path / "ds", manifest)
    with pytest.raises(InvalidShardDirError, match=re.escape(f"{mpath}: corrupt manifest ({what})")):
        read_manifest(tmp_path / "ds")
