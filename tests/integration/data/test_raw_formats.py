"""Raw Criteo/Avazu parsing into shard directories, checked on real sample rows.

Expected values are computed here by an independent, naive parse (``str.split``, ``int(x, 16)``,
``zlib.crc32``) of the same lines, so the vectorised parser is compared against first principles.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # lets the file run before `pip install -e .`
    sys.path.insert(0, str(REPO))

from recsys.data.preprocess import raw_formats as rf  # noqa: E402
from recsys.data.preprocess.raw_formats import (  # noqa: E402
    AVAZU_SPARSE_NAMES,
    CRITEO_DENSE_NAMES,
    CRITEO_SPARSE_NAMES,
    detect_format,
    preprocess_avazu,
    preprocess_criteo,
)
from recsys.data.shard_format import MANIFEST_NAME  # noqa: E402
from recsys.data.shard_reader import ShardedDataset  # noqa: E402
from recsys.data.shard_writer import ShardWriter  # noqa: E402

# ../shared next to the checkout; RECSYS_SHARED_DIR points elsewhere (e.g. from a git worktree)
SHARED = Path(os.environ.get("RECSYS_SHARED_DIR") or Path(__file__).resolve().parents[4] / "shared") / "data"
TSV = "criteo_kaggle_sample_1k.tsv"
CSV = "criteo_sample_200.csv"
AVAZU = "avazu_sample_100.csv"


def sample(name: str) -> Path:
    p = SHARED / name
    if not p.is_file():
        pytest.skip(f"shared sample data not available: {p}")
    return p


# ---------------------------------------------------------------------------------------------
# Independent reference parse
# ---------------------------------------------------------------------------------------------


def data_lines(path: Path, header: bool) -> list[str]:
    lines = path.read_text().replace("\r\n", "\n").split("\n")
    lines = lines[1:] if header else lines
    return [x for x in lines if x]


def manual_criteo(line: str, sep: str) -> tuple[float, list[float], list[int]]:
    f = line.split(sep)
    f += [""] * (40 - len(f))  # trailing empty categorical fields may be stripped
    dense = [math.log1p(max(int(float(x)), 0)) if x else 0.0 for x in f[1:14]]
    sparse = [int(x, 16) if x else -1 for x in f[14:40]]
    return float(f[0]), dense, sparse


def manual_arrays(lines: list[str], sep: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [manual_criteo(x, sep) for x in lines]
    return (
        np.array([r[1] for r in rows], dtype=np.float32),
        np.array([r[2] for r in rows], dtype=np.int64),
        np.array([r[0] for r in rows], dtype=np.float32),
    )


def read_all(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ds = ShardedDataset.open(path)
    return ds.read(0, ds.num_rows)


def assert_same(a: tuple, b: tuple) -> None:
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])


# ---------------------------------------------------------------------------------------------
# The real samples
# ---------------------------------------------------------------------------------------------


def test_criteo_tsv_sample(tmp_path, caplog):
    src = sample(TSV)
    caplog.set_level(logging.INFO, logger="recsys.data.preprocess.raw_formats")
    m = preprocess_criteo([src], tmp_path / "tsv", fmt="tsv")
    lines = data_lines(src, header=False)
    # README says 999 rows (= `wc -l`): the last line has no newline, so there are 1000 rows.
    assert len(lines) == 1000 and m["num_rows"] == 1000
    [rep] = m["sources"]
    assert rep["total_rows"] == 1000 and rep["bad_rows"] == 0 and rep["header"] is False
    # 498 lines had their trailing empty C25/C26 (tabs) stripped; they are padded, not dropped.
    assert rep["padded_rows"] == sum(len(x.split("\t")) < 40 for x in lines) == 498
    assert "skipped 0 of 1000 rows" in caplog.text

    dense, sparse, labels = read_all(tmp_path / "tsv")
    assert dense.shape == (1000, 13) and dense.dtype == np.float32
    assert sparse.shape == (1000, 26) and sparse.dtype == np.int64
    assert labels.shape == (1000,) and labels.dtype == np.float32
    assert_same((dense, sparse, labels), manual_arrays(lines, "\t"))

    # Row 1 by hand: "0 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2 68fd1e64 ... 07b5194c <empty> 3a171ecb ..."
    f = lines[0].split("\t")
    assert labels[0] == 0.0
    assert dense[0, 0] == np.float32(math.log1p(1)) and dense[0, 4] == np.float32(math.log1p(1382))
    assert f[12] == "" and dense[0, 11] == 0.0
    assert f[14] == "68fd1e64" and sparse[0, 0] == 0x68FD1E64
    assert f[35] == "" and sparse[0, 21] == -1
    # Line 3 is one of the stripped rows: C25/C26 absent -> -1.
    assert len(lines[2].split("\t")) == 38 and list(sparse[2, 24:]) == [-1, -1]
    # Negative integers (I2 = -1 occurs) are clamped to 0 before log1p.
    neg = [i for i, x in enumerate(lines) if x.split("\t")[2].startswith("-")]
    assert neg and np.all(dense[neg, 1] == 0.0)
    assert set(np.unique(labels)) == {0.0, 1.0}
    assert sparse.min() == -1 and sparse.max() < 2**32


def test_criteo_csv_sample_and_consistency_with_tsv(tmp_path):
    src = sample(CSV)
    m = preprocess_criteo(src, tmp_path / "csv")  # fmt auto-detected
    assert m["num_rows"] == 200 and m["sources"][0]["header"] is True
    assert m["sources"][0]["format"] == "csv"
    lines = data_lines(src, header=True)
    assert len(lines) == 200
    dense, sparse, labels = read_all(tmp_path / "csv")
    assert_same((dense, sparse, labels), manual_arrays(lines, ","))

    f1, f2 = lines[0].split(","), lines[1].split(",")
    assert f1[3] == "260.0" and dense[0, 2] == np.float32(math.log1p(260))  # integral float accepted
    assert f1[1] == "" and dense[0, 0] == 0.0
    assert f2[2] == "-1" and dense[1, 1] == 0.0  # negative -> 0
    assert f1[33] == "" and sparse[0, 18] == -1
    assert sparse[0, 0] == int(f1[14], 16)

    tsv = preprocess_criteo(sample(TSV), tmp_path / "tsv")
    assert tsv["dense_names"] == m["dense_names"] == CRITEO_DENSE_NAMES
    assert tsv["sparse_names"] == m["sparse_names"] == CRITEO_SPARSE_NAMES
    d2, s2, l2 = read_all(tmp_path / "tsv")
    assert (d2.shape[1], s2.shape[1], d2.dtype, s2.dtype, l2.dtype) == (
        dense.shape[1],
        sparse.shape[1],
        dense.dtype,
        sparse.dtype,
        labels.dtype,
    )


def test_avazu_sample(tmp_path):
    src = sample(AVAZU)
    m = preprocess_avazu([src], tmp_path / "av")
    assert m["kind"] == "avazu" and m["num_rows"] == 100
    assert m["dense_names"] == [] and m["sparse_names"] == AVAZU_SPARSE_NAMES
    assert len(AVAZU_SPARSE_NAMES) == 22 and AVAZU_SPARSE_NAMES[0] == "hour"
    assert "id" not in AVAZU_SPARSE_NAMES and "click" not in AVAZU_SPARSE_NAMES
    dense, sparse, labels = read_all(tmp_path / "av")
    assert dense.shape == (100, 0) and sparse.shape == (100, 22)
    lines = data_lines(src, header=True)
    header = src.read_text().split("\n", 1)[0].split(",")
    rows = [dict(zip(header, x.split(","))) for x in lines]
    want = [[zlib.crc32(r[c].encode()) if r[c] else -1 for c in AVAZU_SPARSE_NAMES] for r in rows]
    np.testing.assert_array_equal(sparse, np.array(want, dtype=np.int64))
    np.testing.assert_array_equal(labels, [float(r["click"]) for r in rows])
    assert sparse[0, 0] == zlib.crc32(b"14102100")  # hour kept as a categorical value
    assert sparse[0, AVAZU_SPARSE_NAMES.index("site_id")] == zlib.crc32(b"1fbe01fe")
    assert rf.avazu_hash("1fbe01fe") == zlib.crc32(b"1fbe01fe") and rf.avazu_hash("") == -1


def test_detect_format():
    assert detect_format(sample(TSV)) == "tsv"
    assert detect_format(sample(CSV)) == "csv"
    assert detect_format(sample(AVAZU)) == "avazu"


# ---------------------------------------------------------------------------------------------
# Malformed input
# ---------------------------------------------------------------------------------------------


def _corrupt(lines: list[str], sep: str, lineno: int, col: int | None, value: str | None, header: bool) -> None:
    """Edit physical line ``lineno`` (1-based, counting a header)."""
    i = lineno - 1
    f = lines[i].split(sep)
    if col is None:
        f = f[:10] if value == "short" else f + ["0"] * 20
    else:
        f[col] = value
    lines[i] = sep.join(f)


def test_malformed_tsv_rows_skipped_with_line_numbers(tmp_path, caplog):
    src = sample(TSV)
    lines = src.read_text().split("\n")
    good = list(lines)
    _corrupt(lines, "\t", 17, None, "short", False)  # 10 columns
    _corrupt(lines, "\t", 45, 16, "zzzz1234", False)  # C3 not hex
    _corrupt(lines, "\t", 99, 3, "abc", False)  # I3 not a number
    _corrupt(lines, "\t", 120, 1, "1.5", False)  # I1 not integral
    _corrupt(lines, "\t", 300, 0, "2", False)  # label not 0/1
    _corrupt(lines, "\t", 640, None, "long", False)  # 41+ columns
    _corrupt(lines, "\t", 700, 20, "123456789", False)  # 9 hex digits
    # valid but unusual spellings: short / upper-case hex ids, an integral float, "+7"
    for lineno, col, value in [(200, 14, "1f"), (201, 15, "00ABCDEF"), (202, 5, "260.0"), (203, 2, "+7")]:
        _corrupt(lines, "\t", lineno, col, value, False)
        _corrupt(good, "\t", lineno, col, value, False)
    text = "\n".join(x + ("\r" if i % 3 == 0 else "") for i, x in enumerate(lines)) + "\n\n\r\n"
    bad_file = tmp_path / "criteo_bad.tsv"
    bad_file.write_bytes(text.encode())

    caplog.set_level(logging.INFO, logger="recsys.data.preprocess.raw_formats")
    m = preprocess_criteo([bad_file], tmp_path / "out", block_bytes=4096)  # many block boundaries
    [rep] = m["sources"]
    assert rep["total_rows"] == 1000 and rep["bad_rows"] == 7 and m["num_rows"] == 993
    assert rep["bad_by_reason"] == {
        "wrong column count": 2,
        "non-hex id": 2,
        "non-numeric integer": 1,
        "non-integral number": 1,
        "bad label": 1,
    }
    assert [b["line"] for b in rep["first_bad_lines"]] == [17, 45, 99, 120, 300]
    assert [b["reason"] for b in rep["first_bad_lines"]] == [
        "wrong column count",
        "non-hex id",
        "non-numeric integer",
        "non-integral number",
        "bad label",
    ]
    assert rep["blank_lines"] == 2  # trailing empty lines are not rows
    assert "criteo_bad.tsv: skipped 7 of 1000 rows" in caplog.text
    assert "first bad lines: 17, 45, 99, 120, 300" in caplog.text
    # The surviving rows are exactly the untouched lines, \r\n or not.
    bad_idx = {17, 45, 99, 120, 300, 640, 700}
    kept = [x for i, x in enumerate(good, 1) if x and i not in bad_idx]
    got = read_all(tmp_path / "out")
    assert_same(got, manual_arrays(kept, "\t"))
    row200 = 200 - sum(1 for b in bad_idx if b < 200) - 1
    assert got[1][row200, 0] == 0x1F and got[1][row200 + 1, 1] == 0xABCDEF
    assert got[0][row200 + 2, 4] == np.float32(math.log1p(260)) and got[0][row200 + 3, 1] == np.float32(math.log1p(7))


def test_csv_bad_line_numbers_count_the_header(tmp_path):
    lines = sample(CSV).read_text().split("\n")
    _corrupt(lines, ",", 10, 20, "not-hex!", True)
    _corrupt(lines, ",", 2, 5, "x7", True)
    p = tmp_path / "criteo_bad.csv"
    p.write_text("\n".join(lines))
    m = preprocess_criteo(p, tmp_path / "out", fmt="csv", max_bad_fraction=0.05)
    rep = m["sources"][0]
    assert [b["line"] for b in rep["first_bad_lines"]] == [2, 10]
    assert rep["bad_by_reason"] == {"non-numeric integer": 1, "non-hex id": 1}
    assert m["num_rows"] == 198


def test_too_many_bad_rows_raises_and_writes_nothing(tmp_path):
    lines = sample(AVAZU).read_text().split("\n")
    _corrupt(lines, ",", 5, 1, "x", True)  # click not 0/1
    _corrupt(lines, ",", 7, None, "short", True)
    _corrupt(lines, ",", 50, None, "long", True)
    bad = tmp_path / "avazu_bad.csv"
    bad.write_text("\n".join(lines))
    out = tmp_path / "out" / "avazu"
    # the good file first: its rows are already in the temp dir when the bad file aborts the run
    with pytest.raises(ValueError) as ei:
        preprocess_avazu([sample(AVAZU), bad], out, rows_per_shard=16)
    msg = str(ei.value)
    assert "\n" not in msg
    assert str(bad) in msg and "0.0300" in msg and "max_bad_fraction=0.01" in msg
    assert "first bad lines: 5, 7, 50" in msg
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no temp dir left behind
    # under a looser limit the same file goes through
    m = preprocess_avazu([bad], out, max_bad_fraction=0.05)
    assert m["num_rows"] == 97
    assert m["sources"][0]["bad_by_reason"] == {"bad label": 1, "wrong column count": 2}


def test_missing_input_file(tmp_path):
    missing = tmp_path / "nope" / "day_0.tsv"
    with pytest.raises(FileNotFoundError, match="day_0.tsv"):
        preprocess_criteo([missing], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="day_0.tsv"):
        preprocess_avazu(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Equivalent encodings of the same rows
# ---------------------------------------------------------------------------------------------


def test_crlf_gzip_and_reordered_header_give_identical_arrays(tmp_path):
    ref = preprocess_criteo(sample(CSV), tmp_path / "ref")
    want = read_all(tmp_path / "ref")

    raw = sample(CSV).read_bytes()
    crlf = tmp_path / "crlf.csv"
    crlf.write_bytes(raw.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
    gz = tmp_path / "sample.csv.gz"
    gz.write_bytes(gzip.compress(raw))
    rows = [x.split(",") for x in raw.decode().strip("\n").split("\n")]
    perm = list(range(40))[::-1]  # columns in reverse order, header included
    rev = tmp_path / "reversed.csv"
    rev.write_text("\n".join(",".join(r[i] for i in perm) for r in rows) + "\n")

    for i, p in enumerate([crlf, gz, rev]):
        m = preprocess_criteo(p, tmp_path / f"v{i}")
        assert m["num_rows"] == ref["num_rows"] == 200
        assert_same(read_all(tmp_path / f"v{i}"), want)


# ---------------------------------------------------------------------------------------------
# Shard reading and atomicity
# ---------------------------------------------------------------------------------------------


def test_read_across_shard_boundaries(tmp_path):
    out = tmp_path / "csv"
    m = preprocess_criteo(sample(CSV), out, rows_per_shard=64)
    assert [s["num_rows"] for s in m["shards"]] == [64, 64, 64, 8]
    on_disk = [np.concatenate([np.load(out / f"{s['name']}.{part}.npy") for s in m["shards"]]) for part in ("dense", "sparse", "labels")]
    ds = ShardedDataset.open(out)
    assert ds.num_rows == len(ds) == 200 and ds.num_shards == 4
    for start, stop in [(0, 200), (60, 130), (63, 65), (64, 128), (199, 200), (5, 5)]:
        got = ds.read(start, stop)
        for g, full in zip(got, on_disk):
            np.testing.assert_array_equal(g, full[start:stop])
        assert got[0].flags.writeable and got[0].dtype == np.float32
    assert_same(ds.read(0, 200), read_all(out))
    with pytest.raises(IndexError):
        ds.read(150, 201)
    # pickling re-maps by path instead of copying the data
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 1000
    np.testing.assert_array_equal(clone.read(60, 130)[1], on_disk[1][60:130])


def test_directory_without_manifest_or_corrupt_manifest_is_invalid(tmp_path):
    out = tmp_path / "ds"
    preprocess_criteo(sample(CSV), out, rows_per_shard=64)
    assert ShardedDataset.open(out).num_rows == 200

    no_manifest = tmp_path / "no_manifest"
    shutil.copytree(out, no_manifest)
    (no_manifest / MANIFEST_NAME).unlink()
    with pytest.raises(ValueError, match="no_manifest") as ei:
        ShardedDataset.open(no_manifest)
    assert "\n" not in str(ei.value)

    truncated = tmp_path / "truncated"
    shutil.copytree(out, truncated)
    mp = truncated / MANIFEST_NAME
    mp.write_text(mp.read_text()[:100])
    with pytest.raises(ValueError, match="truncated.*corrupt manifest"):
        ShardedDataset.open(truncated)

    lying = tmp_path / "lying"
    shutil.copytree(out, lying)
    man = json.loads((lying / MANIFEST_NAME).read_text())
    man["shards"][1]["num_rows"] += 1
    man["num_rows"] += 1
    (lying / MANIFEST_NAME).write_text(json.dumps(man))
    with pytest.raises(ValueError, match="shard_00001"):
        ShardedDataset.open(lying)

    with pytest.raises(ValueError, match="does not exist"):
        ShardedDataset.open(tmp_path / "absent")

    # a non-empty directory without a manifest is never silently reused or deleted ...
    with pytest.raises(
        FileExistsError, match="no_manifest exists but is not a complete shard directory .*; remove it or choose another cache directory$"
    ):
        preprocess_criteo(sample(CSV), no_manifest)
    # ... unless asked to
    assert preprocess_criteo(sample(CSV), no_manifest, overwrite=True)["num_rows"] == 200
    assert ShardedDataset.open(no_manifest).num_rows == 200


CRASH_SCRIPT = """
import os, sys, numpy as np
sys.path.insert(0, sys.argv[1])
from recsys.data.shard_writer import ShardWriter
w = ShardWriter(sys.argv[2], kind="criteo", dense_names=["I1"], sparse_names=["C1"], rows_per_shard=2)
w.append(np.zeros((5, 1), np.float32), np.zeros((5, 1), np.int64), np.zeros(5, np.float32))
print(w.tmp, flush=True)
os._exit(1)  # killed mid-write: no commit, no cleanup
"""


def test_crash_mid_write_leaves_nothing_that_opens(tmp_path):
    dest = tmp_path / "ds"
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(REPO), str(dest)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    stale = Path(proc.stdout.strip())
    assert stale.is_dir() and stale.parent == tmp_path and any(stale.glob("shard_*.npy"))
    assert not dest.exists()
    with pytest.raises(ValueError):
        ShardedDataset.open(stale)
    with pytest.raises(ValueError):
        ShardedDataset.open(dest)
    # the next run publishes a complete directory and removes the dead process's temp dir
    m = preprocess_criteo(sample(CSV), dest)
    assert ShardedDataset.open(dest).num_rows == m["num_rows"] == 200
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_failure_before_publish_cleans_up(tmp_path, monkeypatch):
    import recsys.data.shard_writer as shard_writer

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shard_writer, "write_json", boom)
    with pytest.raises(OSError, match="disk full"):
        preprocess_criteo(sample(CSV), tmp_path / "ds", rows_per_shard=64)
    assert list(tmp_path.iterdir()) == []


def test_existing_complete_dir_is_reused_only_with_the_same_key(tmp_path, monkeypatch, caplog):
    out = tmp_path / "ds"
    first = preprocess_criteo(sample(CSV), out, rows_per_shard=64)
    assert first["cache_key"]["files"][0]["path"] == str(sample(CSV).resolve())

    def no_parsing(*a, **k):
        raise AssertionError("should not re-parse")

    with monkeypatch.context() as mp:
        mp.setattr(rf, "parse_criteo_block", no_parsing)
        assert preprocess_criteo(sample(CSV), out, rows_per_shard=64) == first
    again = preprocess_criteo(sample(CSV), out, rows_per_shard=100, overwrite=True)
    assert [s["num_rows"] for s in again["shards"]] == [100, 100]
    assert ShardedDataset.open(out).num_shards == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # old copy removed
    # another option, another file, another kind: rebuilt, with one warning line saying why
    caplog.set_level(logging.WARNING, logger="recsys.data.preprocess.raw_formats")
    for call, why in [
        (lambda: preprocess_criteo(sample(CSV), out, rows_per_shard=64), "parse options changed: rows_per_shard 100 -> 64"),
        (
            lambda: preprocess_criteo(sample(TSV), out),
            f"new input file {sample(TSV).resolve()}; input file {sample(CSV).resolve()} no longer given",
        ),
        (
            lambda: preprocess_avazu(sample(AVAZU), out),
            f"new input file {sample(AVAZU).resolve()}; input file {sample(TSV).resolve()} no longer given",
        ),
    ]:
        caplog.clear()
        m = call()
        assert [r.getMessage() for r in caplog.records] == [f"{out}: rebuilding the shard cache: {why}"]
        assert ShardedDataset.open(out).manifest == m
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    assert ShardedDataset.open(out).kind == "avazu" and m["num_rows"] == 100


def test_writer_rejects_mismatched_chunk(tmp_path):
    with ShardWriter(tmp_path / "w", kind="avazu", dense_names=[], sparse_names=["a", "b"]) as w:
        with pytest.raises(ValueError, match="do not match"):
            w.append(np.zeros((3, 0), np.float32), np.zeros((3, 3), np.int64), np.zeros(3, np.float32))
    assert list(tmp_path.iterdir()) == []
