"""The block parser (numpy fast path + per-line reference path) gives exactly the reference's result.

The reference is ``parse_criteo_block(..., fast=False)``: every line through the per-line parser
that preprocessing used before the fast path existed. Tricky input of every kind (bad rows of each
reason, short and padded rows, empty fields, CRLF and stray CRs, blank and whitespace lines, a BOM,
a missing trailing newline, .gz, a reordered CSV header with an extra column) must give
bit-identical arrays, the same bad-row report, and byte-identical shard files for any block size
and number of workers.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from recsys.data.errors import DataFileError  # noqa: E402
from recsys.data.preprocess.parse_criteo import CRITEO_COLUMNS, parse_criteo_block  # noqa: E402
from recsys.data.preprocess.raw_formats import preprocess_criteo  # noqa: E402
from recsys.data.preprocess.read_blocks import Block, BlockReader, Layout  # noqa: E402

TSV_LAYOUT = Layout(b"\t", 40, tuple(range(40)))
GOOD_HEX = ["68fd1e64", "80E26C9B", "0", "a", "00000001", "ffffffff", "7e0cccc", ""]
GOOD_INT = ["0", "1", "-1", "-0", "007", "123456789", "999999999999999", "-12345678901", "", "5"]


def good_row(rng: random.Random) -> list[str]:
    return [rng.choice("01"), *(rng.choice(GOOD_INT) for _ in range(13)), *(rng.choice(GOOD_HEX) for _ in range(26))]


# Each entry turns a good row into a tricky line (good, bad of some reason, padded or blank).
TRICKS = [
    lambda f: "\t".join(f),  # plain good row
    lambda f: "\t".join(f) + "\r",  # CRLF
    lambda f: "\t".join(f) + "\r\r",  # two CRs: stripped by the reference too
    lambda f: "\t".join(f[:30]),  # short: padded
    lambda f: "\t".join(f[:14]),  # shortest that may be padded
    lambda f: "\t".join(f[:13]),  # too short: wrong column count
    lambda f: "\t".join(f + ["x"]),  # too long
    lambda f: "\t".join(["2", *f[1:]]),  # bad label
    lambda f: "\t".join(["", *f[1:]]),  # empty label
    lambda f: "\t".join(["1.0", *f[1:]]),  # label 1.0: good (reference path)
    lambda f: "\t".join(["0.0", *f[1:]]),
    lambda f: "\t".join([f[0], "abc", *f[2:]]),  # non-numeric integer
    lambda f: "\t".join([f[0], "-", *f[2:]]),
    lambda f: "\t".join([f[0], "1-2", *f[2:]]),
    lambda f: "\t".join([f[0], "--1", *f[2:]]),
    lambda f: "\t".join([f[0], "1.5", *f[2:]]),  # non-integral
    lambda f: "\t".join([f[0], "260.0", *f[2:]]),  # integral float: good
    lambda f: "\t".join([f[0], "1e3", "+7", "-2.0E1", *f[4:]]),  # good via the reference path
    lambda f: "\t".join([f[0], "1e400", *f[2:]]),  # inf: non-numeric
    lambda f: "\t".join([f[0], "1234567890123456", *f[2:]]),  # 16 digits: too long
    lambda f: "\t".join([f[0], "123456789012345", *f[2:]]),  # 15 digits: good
    lambda f: "\t".join([f[0], " 5", *f[2:]]),  # space
    lambda f: "\t".join([*f[:14], "zz", *f[15:]]),  # non-hex id
    lambda f: "\t".join([*f[:14], "123456789", *f[15:]]),  # 9 hex digits
    lambda f: "\t".join([*f[:14], "12\r4", *f[15:]]),  # CR inside a field
    lambda f: "\t".join([*f[:39], "ab\x00"]),  # NUL byte
    lambda f: "\t".join(f).replace("\t", "\t\x00", 1),
    lambda f: "",  # blank
    lambda f: "   ",  # whitespace only
    lambda f: "\t" * 39,  # only tabs: blank
    lambda f: "\t" * 20,
    lambda f: "\x0b\x0c",
    lambda f: "\t".join([*f[:20], "ab\x01", *f[21:]]),  # a control byte below the tab
    lambda f: "\t".join([f[0], "1\x08", *f[2:]]),
    lambda f: "\t".join(f).replace("0", "\xe9", 1),  # a non-ASCII byte
]


def tricky_text(rows: int, seed: int, bad_share: float = 0.3) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        f = good_row(rng)
        trick = TRICKS[0] if rng.random() > bad_share else rng.choice(TRICKS)
        out.append(trick(f))
    return "\n".join(out)


def parse_all(data: bytes, fast: bool, block_bytes: int | None = None, layout: Layout = TSV_LAYOUT):
    """Parse ``data`` as blocks (cut after newlines, as the reader does); concatenated results."""
    blocks, lineno, pos = [], 1, 0
    size = block_bytes or len(data) or 1
    while pos < len(data):
        cut = data.rfind(b"\n", pos, pos + size) + 1
        cut = len(data) if pos + size >= len(data) or cut <= pos else cut
        blocks.append(Block(lineno, data[pos:cut]))
        lineno += data.count(b"\n", pos, cut)
        pos = cut
    parsed = [parse_criteo_block(b, layout, 14, fast=fast) for b in blocks]
    dense = np.concatenate([p.dense for p in parsed])
    sparse = np.concatenate([p.sparse for p in parsed])
    labels = np.concatenate([p.labels for p in parsed])
    rep = {
        "total": sum(p.report.total_rows for p in parsed),
        "good": sum(p.report.good_rows for p in parsed),
        "blank": sum(p.report.blank_lines for p in parsed),
        "padded": sum(p.report.padded_rows for p in parsed),
        "bad": [x for p in parsed for x in p.report.bad],
    }
    return dense, sparse, labels, rep


def assert_identical(a, b) -> None:
    for x, y in zip(a[:3], b[:3]):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bit-identical (a -0.0 or a rounding would show)
    assert a[3] == b[3]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ending", ["\n", "", "\r\n"])
def test_fast_path_equals_reference_on_tricky_rows(seed, ending):
    text = tricky_text(3000, seed) + ending
    if ending == "\r\n":
        text = text.replace("\n", "\r\n")
    data = text.encode("latin-1")
    ref = parse_all(data, fast=False)
    assert ref[3]["bad"] and ref[3]["padded"] and ref[3]["blank"]  # the input is tricky
    reasons = {r for _, r in ref[3]["bad"]}
    assert reasons == {"wrong column count", "bad label", "non-numeric integer", "non-integral number", "non-hex id", "NUL byte"}
    for block_bytes in (None, 1 << 14, 200):
        assert_identical(parse_all(data, fast=True, block_bytes=block_bytes), ref)


def test_fast_path_values_against_first_principles():
    line = "1\t-0\t007\t-12\t999999999999999\t\t1\t2\t3\t4\t5\t6\t7\t8\t" + "\t".join(
        ["68fd1e64", "80E26C9B", "0", "a", "", "ffffffff", "7e0cccc"] + ["1"] * 19
    )
    dense, sparse, labels, rep = parse_all(line.encode(), fast=True)
    assert rep == {"total": 1, "good": 1, "blank": 0, "padded": 0, "bad": []}
    raw = [-0.0, 7, -12, 999999999999999, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    expect = np.log1p(np.maximum(np.array(raw, np.float64), 0.0)).astype(np.float32)
    assert dense[0].tobytes() == expect.tobytes()
    assert sparse[0, :7].tolist() == [0x68FD1E64, 0x80E26C9B, 0, 10, -1, 0xFFFFFFFF, 0x7E0CCCC]
    assert labels.tolist() == [1.0]


def test_csv_header_reordered_with_extra_column():
    rng = random.Random(7)
    cols = CRITEO_COLUMNS[::-1] + ["extra"]
    rows = []
    for i in range(500):
        f = dict(zip(CRITEO_COLUMNS, good_row(rng)))
        f["extra"] = "\x00" if i % 50 == 0 else "anything, really" if i % 7 == 0 else "x"
        rows.append(",".join(f[c] for c in cols))
    data = ("\n".join(rows) + "\n").encode()
    layout = Layout(b",", len(cols), tuple(cols.index(c) for c in CRITEO_COLUMNS), header=True)
    ref = parse_all(data, fast=False, layout=layout)
    assert {r for _, r in ref[3]["bad"]} == {"NUL byte", "wrong column count"}
    assert_identical(parse_all(data, fast=True, layout=layout, block_bytes=3000), ref)


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_shards_identical_for_any_workers_and_blocks_plain_and_gz(tmp_path):
    text = "\ufeff" + tricky_text(4000, seed=11, bad_share=0.004)  # BOM, no trailing newline
    plain = tmp_path / "day.tsv"
    plain.write_bytes(text.encode("utf-8"))
    gz = tmp_path / "day.tsv.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    results = []
    for src, workers, block_bytes in [(plain, 1, 1 << 20), (plain, 2, 5000), (gz, 3, 777), (gz, 1, 1 << 16)]:
        out = tmp_path / f"out-{src.suffix}-{workers}-{block_bytes}"
        m = preprocess_criteo(src, out, rows_per_shard=1000, workers=workers, block_bytes=block_bytes, max_bad_fraction=0.5)
        files = shard_bytes(out)
        manifest = json.loads(files.pop("manifest.json"))
        src_report = manifest["sources"][0]
        src_report.pop("path")
        assert src_report.pop("sha256") == hashlib.sha256(src.read_bytes()).hexdigest()  # of the file as given
        results.append((files, src_report, m["num_rows"]))
        assert m["num_rows"] > 3000 and len(files) == 3 * len(m["shards"])
    assert all(r == results[0] for r in results[1:])
    # and the same rows as the reference path over the whole file at once
    reader = BlockReader(plain, b"\t", CRITEO_COLUMNS, CRITEO_COLUMNS, block_bytes=1 << 30)
    blocks = list(reader.blocks())  # the whole file, and its last line without newline
    assert blocks[0].first_lineno == 1 and not blocks[0].data.startswith(b"\xef\xbb\xbf")
    dense, sparse, labels, rep = parse_all(b"".join(b.data for b in blocks), fast=False)
    joined = [np.load(tmp_path / "out-.tsv-1-1048576" / f"shard_{i:05d}.sparse.npy") for i in range(len(results[0][0]) // 3)]
    assert np.concatenate(joined).tobytes() == sparse.tobytes()
    assert results[0][1]["bad_rows"] == len(rep["bad"]) and results[0][1]["padded_rows"] == rep["padded"]
    assert results[0][1]["first_bad_lines"] == [{"line": n, "reason": r} for n, r in rep["bad"][:5]]


def test_bad_fraction_stop_names_file_and_writes_nothing(tmp_path):
    day = tmp_path / "day.tsv"
    day.write_text(tricky_text(2000, seed=3, bad_share=0.5) + "\n")
    _, _, _, rep = parse_all(day.read_bytes(), fast=False)
    bad, total = len(rep["bad"]), rep["total"]
    with pytest.raises(DataFileError) as e:
        preprocess_criteo(day, tmp_path / "cache", workers=2, block_bytes=4096)
    msg = str(e.value)
    assert msg.startswith(f"{day}: bad-row fraction {bad / total:.4f} ({bad} of {total} rows: ")
    assert msg.endswith(f"first bad lines: {', '.join(str(n) for n, _ in rep['bad'][:5])}; nothing was written")
    assert "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.tsv"]


def test_many_files_in_processes_give_the_shards_of_one_thread(tmp_path):
    days = []
    for i in range(3):
        day = tmp_path / f"day_{i}.tsv"
        day.write_text(tricky_text(1500 + 300 * i, seed=20 + i, bad_share=0.004) + "\n")
        days.append(day)
    gz = tmp_path / "day_3.tsv.gz"
    gz.write_bytes(gzip.compress(tricky_text(900, seed=30, bad_share=0.004).encode()))
    days.append(gz)
    runs = {}
    for workers in (1, 3):  # 1: files in turn on one thread; 3: one process per file
        out = tmp_path / f"out{workers}"
        m = preprocess_criteo(days, out, rows_per_shard=1000, workers=workers, max_bad_fraction=0.5)
        runs[workers] = (shard_bytes(out), m)
    (files1, m1), (files3, m3) = runs[1], runs[3]
    assert files1.keys() == files3.keys() and len(m1["shards"]) >= 5
    assert {k: v for k, v in files1.items() if k != "manifest.json"} == {k: v for k, v in files3.items() if k != "manifest.json"}
    assert m1["sources"] == m3["sources"] and m1["num_rows"] == m3["num_rows"]
    assert [s["bad_rows"] for s in m1["sources"]] != [0, 0, 0, 0]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no part or temp directory left


def test_many_files_in_processes_stop_at_the_first_bad_file(tmp_path):
    good = tmp_path / "day_0.tsv"
    good.write_text(tricky_text(500, seed=1, bad_share=0.0) + "\n")
    bad = tmp_path / "day_1.tsv"
    bad.write_text(tricky_text(500, seed=2, bad_share=0.6) + "\n")
    also_bad = tmp_path / "day_2.tsv"
    also_bad.write_text(tricky_text(500, seed=3, bad_share=0.6) + "\n")
    with pytest.raises(DataFileError, match=rf"^{bad}: bad-row fraction .* nothing was written$"):
        preprocess_criteo([good, bad, also_bad], tmp_path / "cache", workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0.tsv", "day_1.tsv", "day_2.tsv"]


def test_full_disk_with_files_in_processes_names_the_cache(tmp_path):
    """A worker process's failed write is reported for the cache, not for its part directory."""
    import subprocess

    from recsys.data.errors import CacheWriteError

    days = []
    for i in range(2):
        day = tmp_path / f"day_{i}.tsv"
        day.write_text(tricky_text(3000, seed=40 + i, bad_share=0.0) + "\n")
        days.append(day)
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {r.stderr.strip() or r.returncode}")
    try:
        with pytest.raises(
            CacheWriteError,
            match=rf"^{mnt / 'cache'}: writing the shard cache failed at shard_00000\."
            r"\w+\.npy: .*\(0 bytes free on that filesystem\); nothing was written$",
        ):
            preprocess_criteo(days, mnt / "cache", workers=2)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_progress_line_rows_per_second_and_eta(tmp_path, caplog):
    import logging

    from recsys.data.preprocess.pipeline import Progress

    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    a.write_bytes(b"x" * 3000)
    b.write_bytes(b"x" * 1000)
    now = [100.0]
    p = Progress([a, b], every_s=5.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="recsys.data.preprocess.raw_formats")
    now[0] = 104.0  # before every_s: no line
    p.update(200_000, 3000, 0.2)
    assert not caplog.records
    now[0] = 110.0  # 10 s into the run
    p.update(300_000, 3000, 0.5)  # half of a.tsv: 1500 of 4000 bytes
    (line,) = [r.getMessage() for r in caplog.records]
    rows, rate, share, eta = re.fullmatch(r"preprocessing: (\d+) rows, (\d+)K rows/s, (\d+)% of the input, ETA (\d+) s", line).groups()
    assert (int(rows), int(share)) == (500_000, 38)
    assert int(rate) == 50  # 500K rows in 10 s
    assert int(eta) == 17  # 10 s for 37.5%: 16.7 s to go
