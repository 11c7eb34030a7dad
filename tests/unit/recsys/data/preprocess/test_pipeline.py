"""The read -> parse -> write pipeline on threads: the shards and the report are those of a
sequential pass whatever the number of workers, a file past the bad-row limit stops the run, and
the progress line's figures follow an injected clock."""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from recsys.data.errors import DataFileError
from recsys.data.preprocess.bad_rows import REASON_LABEL, FileReport
from recsys.data.preprocess.parse_criteo import CRITEO_COLUMNS, CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, parse_criteo_block
from recsys.data.preprocess.pipeline import Progress, default_workers, run_file
from recsys.data.preprocess.read_blocks import BlockReader
from recsys.data.shard_reader import ShardedDataset
from recsys.data.shard_writer import ShardWriter

LOGGER = "recsys.data.preprocess.raw_formats"


def _line(i: int, label: str | None = None) -> str:
    """Row i: label i % 2, I1 = i, C1 = hex(i)."""
    return "\t".join([label or str(i % 2), str(i), *[""] * 12, f"{i:x}", *[""] * 25])


def _parse(block, layout):
    return parse_criteo_block(block, layout, None)


def _run(tmp_path, text: str, workers: int, out: str, max_bad: float = 0.5) -> tuple[FileReport, ShardedDataset]:
    f = tmp_path / "day.tsv"
    f.write_text(text)
    reader = BlockReader(f, b"\t", CRITEO_COLUMNS, CRITEO_COLUMNS, block_bytes=300)
    report = FileReport(path=str(f), format="tsv")
    with ShardWriter(
        tmp_path / out, kind="criteo", dense_names=CRITEO_DENSE_NAMES, sparse_names=CRITEO_SPARSE_NAMES, rows_per_shard=16
    ) as w:
        with ThreadPoolExecutor(workers) as pool:
            run_file(reader, _parse, w, report, pool if workers > 1 else None, workers, Progress([f], every_s=float("inf")), max_bad)
        w.commit()
    return report, ShardedDataset.open(tmp_path / out)


def test_rows_arrive_in_file_order_with_any_number_of_workers(tmp_path):
    lines = [_line(i) for i in range(100)]
    lines[40] = _line(40, label="x")
    text = "\n".join(lines) + "\n"
    reports = []
    for workers in (1, 3):
        report, ds = _run(tmp_path, text, workers, f"out{workers}")
        _, sparse, labels = ds.read(0, ds.num_rows)
        kept = [i for i in range(100) if i != 40]
        assert sparse[:, 0].tolist() == kept and labels.tolist() == [float(i % 2) for i in kept]
        reports.append(report.to_dict())
    assert reports[0] == reports[1]
    assert reports[0]["bad_by_reason"] == {REASON_LABEL: 1} and reports[0]["first_bad_lines"] == [{"line": 41, "reason": REASON_LABEL}]
    assert reports[0]["total_rows"] == 100 and reports[0]["good_rows"] == 99


def test_a_file_past_the_bad_row_limit_stops_with_one_line(tmp_path):
    text = "\n".join([_line(0), _line(1, label="7"), _line(2)]) + "\n"
    f = tmp_path / "day.tsv"
    msg = f"{f}: bad-row fraction 0.3333 (1 of 3 rows: bad label: 1) exceeds max_bad_fraction=0.1; first bad lines: 2; nothing was written"
    with pytest.raises(DataFileError, match=re.escape(msg)):
        _run(tmp_path, text, 1, "out", max_bad=0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.tsv"]  # nothing published


def test_progress_line_figures_follow_the_clock(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 300)
    b.write_bytes(b"x" * 100)
    now = [100.0]
    p = Progress([a, b], every_s=10.0, clock=lambda: now[0])
    assert p.total_bytes == 400
    caplog.set_level(logging.INFO, logger=LOGGER)
    now[0] = 105.0
    p.update(50_000, 300, 0.5)  # 5 s: not yet time for a line
    assert caplog.records == []
    now[0] = 110.0
    p.update(50_000, 300, 1.0)  # 10 s: 100K rows, 300 of 400 bytes
    assert [r.getMessage() for r in caplog.records] == ["preprocessing: 100000 rows, 10K rows/s, 75% of the input, ETA 3 s"]
    p.file_done(300)
    now[0] = 111.0
    p.update(10_000, 100, 0.5, force=True)  # 350 of 400 bytes after 11 s
    assert caplog.records[-1].getMessage() == "preprocessing: 110000 rows, 10K rows/s, 88% of the input, ETA 2 s"
    assert p.line(0.0).endswith("0% of the input, ETA nan s")


def test_default_workers_are_the_cores_this_process_may_use():
    assert default_workers() == len(os.sched_getaffinity(0))


def test_a_shard_holds_the_parsed_values(tmp_path):
    _, ds = _run(tmp_path, "\n".join(_line(i) for i in range(20)), 2, "out")
    dense, sparse, _ = ds.read(15, 18)  # across the 16-row shard boundary
    np.testing.assert_allclose(dense[:, 0], np.log1p([15.0, 16.0, 17.0]).astype(np.float32))
    assert sparse[:, 0].tolist() == [15, 16, 17] and (sparse[:, 1:] == -1).all()
