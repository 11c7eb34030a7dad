"""The preprocessing drivers on small hand-written files, in one process: the format detected
from the first line, the manifest and shards written, a cache reused only while its inputs and
options are unchanged, and the one-line errors for inputs and arguments that cannot work."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import zlib

import numpy as np
import pytest

from recsys.data.errors import DataFileError
from recsys.data.preprocess import raw_formats as rf
from recsys.data.preprocess.parse_avazu import AVAZU_COLUMNS
from recsys.data.preprocess.raw_formats import (
    PARSER_VERSION,
    avazu_key,
    criteo_key,
    detect_format,
    preprocess,
    preprocess_criteo,
)
from recsys.data.shard_format import FORMAT_VERSION
from recsys.data.shard_reader import ShardedDataset

LOGGER = "recsys.data.preprocess.raw_formats"


def _criteo(i: int, sep: str = "\t") -> str:
    """Row i: label i % 2, I1 = i, I2 missing, C1 = hex(i + 16), C26 missing."""
    return sep.join([str(i % 2), str(i), "", *["1"] * 11, f"{i + 16:x}", *["abc"] * 24, ""])


@pytest.fixture
def tsv(tmp_path):
    f = tmp_path / "day_0.tsv"
    f.write_text("\n".join(_criteo(i) for i in range(10)) + "\n")
    return f


def test_detect_format_from_the_first_line(tmp_path):
    cases = {
        "a.tsv": "1\t2\t3\n",
        "b.csv": "label,I1,C1\n1,2,a\n",
        "c.csv": "id,click,hour\n1,0,14102100\n",
        "d.csv": ",".join(["x"] * len(AVAZU_COLUMNS)) + "\n",  # Avazu's 24 columns without a header
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    assert [detect_format(tmp_path / n) for n in cases] == ["tsv", "csv", "avazu", "avazu"]
    (tmp_path / "empty").write_text("\n\n")
    assert detect_format(tmp_path / "empty", default="tsv") == "tsv"
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'empty'}: file is empty, cannot detect its format")):
        detect_format(tmp_path / "empty")
    (tmp_path / "one").write_text("12345\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'one'}: cannot detect format (first line has neither tabs nor commas)")):
        detect_format(tmp_path / "one")
    with pytest.raises(FileNotFoundError, match=re.escape(f"input file not found: {tmp_path / 'gone'}")):
        detect_format(tmp_path / "gone")


def test_criteo_rows_become_shards_and_a_manifest(tmp_path, tsv):
    m = preprocess_criteo(tsv, tmp_path / "out", rows_per_shard=4, workers=1)
    assert (m["kind"], m["num_rows"], [s["num_rows"] for s in m["shards"]]) == ("criteo", 10, [4, 4, 2])
    assert m["created_by"] == "recsys.data.preprocess.raw_formats.preprocess_criteo"
    assert m["cache_key"] == criteo_key([tsv], "auto", 4)
    (src,) = m["sources"]
    assert src["path"] == str(tsv) and src["format"] == "tsv" and src["good_rows"] == 10 and src["bad_rows"] == 0
    assert src["sha256"] == hashlib.sha256(tsv.read_bytes()).hexdigest()
    dense, sparse, labels = ShardedDataset.open(tmp_path / "out").read(0, 10)
    np.testing.assert_allclose(dense[:, 0], np.log1p(np.arange(10)).astype(np.float32))
    assert (dense[:, 1] == 0).all() and sparse[:, 0].tolist() == list(range(16, 26)) and (sparse[:, 25] == -1).all()
    assert sparse[0, 1] == 0xABC and labels.tolist() == [float(i % 2) for i in range(10)]


def test_an_unchanged_cache_is_reused_and_a_changed_input_rebuilds_it(tmp_path, tsv, monkeypatch, caplog):
    out = tmp_path / "out"
    first = preprocess_criteo(tsv, out, workers=1)

    def no_parsing(*a, **k):
        raise AssertionError("an up-to-date cache is not parsed again")

    with monkeypatch.context() as mp:
        mp.setattr(rf, "parse_criteo_block", no_parsing)
        assert preprocess_criteo(tsv, out, workers=1) == first
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tsv.write_text("\n".join(_criteo(i) for i in range(12)) + "\n")
    again = preprocess_criteo(tsv, out, workers=1)
    assert again["num_rows"] == 12
    size_before, size_after = len("\n".join(_criteo(i) for i in range(10))) + 1, tsv.stat().st_size
    assert [r.getMessage() for r in caplog.records] == [
        f"{out}: rebuilding the shard cache: {tsv.resolve()} changed (size {size_before} -> {size_after} bytes)"
    ]


def test_full_verification_catches_content_the_key_cannot_see(tmp_path, tsv, caplog):
    out = tmp_path / "out"
    preprocess_criteo(tsv, out, workers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["sources"][0]["sha256"] = "0" * 64  # as if a byte in the middle of the file had changed since
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert preprocess_criteo(tsv, out, workers=1, verify="quick")["sources"][0]["sha256"] == "0" * 64  # trusted
    caplog.set_level(logging.WARNING, logger=LOGGER)
    rebuilt = preprocess_criteo(tsv, out, workers=1)
    assert rebuilt["sources"][0]["sha256"] == hashlib.sha256(tsv.read_bytes()).hexdigest()
    assert [r.getMessage() for r in caplog.records] == [
        f"{out}: rebuilding the shard cache: {tsv} changed (same size and modification time, other content: its SHA-256 differs)"
    ]


def test_avazu_rows_hash_their_values(tmp_path):
    f = tmp_path / "train.csv"
    rows = [["1", "0", "14102100", *[f"v{i}" for i in range(21)]], ["2", "1", "14102101", *[""] * 21]]
    f.write_text(",".join(AVAZU_COLUMNS) + "\n" + "\n".join(",".join(r) for r in rows) + "\n")
    m = preprocess(f, tmp_path / "out", workers=1)  # kind detected from the header
    assert m["kind"] == "avazu" and m["num_rows"] == 2 and m["cache_key"] == avazu_key([f])
    assert m["sources"][0]["header"] is True
    dense, sparse, labels = ShardedDataset.open(tmp_path / "out").read(0, 2)
    assert dense.shape == (2, 0) and labels.tolist() == [0.0, 1.0]
    assert sparse[0].tolist() == [zlib.crc32(v.encode()) for v in rows[0][2:]]
    assert sparse[1, 0] == zlib.crc32(b"14102101") and (sparse[1, 1:] == -1).all()


def test_no_valid_rows_write_nothing(tmp_path):
    f = tmp_path / "bad.tsv"
    f.write_text("\n\n")
    with pytest.raises(DataFileError, match=re.escape(f"{f}: no valid rows (0 rows read); nothing was written")):
        preprocess_criteo(f, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_something_else_in_the_way_is_never_deleted(tmp_path, tsv):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    msg = (
        f"{tmp_path / 'out'} exists but is not a complete shard directory (not a complete shard directory "
        "(no manifest.json; an interrupted write?)); remove it or choose another cache directory"
    )
    with pytest.raises(FileExistsError, match=re.escape(msg)):
        preprocess_criteo(tsv, tmp_path / "out", workers=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=re.escape(f"{tmp_path / 'file'} exists and is not a directory")):
        preprocess_criteo(tsv, tmp_path / "file", workers=1)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"verify": "some"}, "verify must be 'full' or 'quick', got 'some'"),
        ({"rows_per_shard": 0}, "rows_per_shard must be >= 1, got 0"),
        ({"max_bad_fraction": 1.5}, "max_bad_fraction must be in [0, 1], got 1.5"),
        ({"max_bad_fraction": float("nan")}, "max_bad_fraction must be in [0, 1], got nan"),
        ({"block_bytes": 0}, "block_bytes must be >= 1, got 0"),
        ({"workers": 0}, "workers must be >= 1, got 0"),
        ({"fmt": "json"}, "fmt must be 'tsv', 'csv' or 'auto', got 'json'"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, tsv, kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        preprocess_criteo(tsv, tmp_path / "out", **kwargs)


def test_inputs_that_are_not_criteo_files(tmp_path):
    f = tmp_path / "a.csv"
    f.write_text("id,click,hour\n1,0,2\n")
    with pytest.raises(ValueError, match=re.escape(f"{f}: looks like avazu data, not Criteo (use preprocess_avazu)")):
        preprocess_criteo(f, tmp_path / "out")
    with pytest.raises(DataFileError, match=re.escape(f"{tmp_path}: is a directory, not a data file; nothing was written")):
        preprocess_criteo(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="^no input files given$"):
        preprocess_criteo([], tmp_path / "out")
    with pytest.raises(ValueError, match=re.escape("kind must be 'criteo', 'avazu' or 'auto', got 'movielens'")):
        preprocess(f, tmp_path / "out", kind="movielens")


def test_cache_keys_record_every_option_that_changes_the_shards(tsv):
    opts = criteo_key([tsv], "tsv", 64, 0.05, pad_short_rows=False)["options"]
    assert opts == {
        "format": "tsv",
        "format_version": FORMAT_VERSION,
        "kind": "criteo",
        "max_bad_fraction": 0.05,
        "pad_short_rows": False,
        "parser_version": PARSER_VERSION,
        "rows_per_shard": 64,
    }
    assert avazu_key([tsv], 8)["options"] == {
        "format_version": FORMAT_VERSION,
        "kind": "avazu",
        "max_bad_fraction": 0.01,
        "parser_version": PARSER_VERSION,
        "rows_per_shard": 8,
    }
    assert criteo_key([tsv]) != criteo_key([tsv], pad_short_rows=False)
