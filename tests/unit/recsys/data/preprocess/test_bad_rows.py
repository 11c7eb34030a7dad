"""The bad-row report: blocks merged in file order give the counts, reasons and first line
numbers of one sequential pass, and a file past the limit stops with one line."""

from __future__ import annotations

import re

import pytest

from recsys.data.errors import DataFileError
from recsys.data.preprocess.bad_rows import (
    MAX_BAD_LINES_KEPT,
    REASON_COLUMNS,
    REASON_HEX,
    REASON_LABEL,
    BlockReport,
    FileReport,
    check_bad_fraction,
)


def _merged() -> FileReport:
    r = FileReport(path="/data/day_0.tsv", format="tsv")
    r.add_block(
        BlockReport(total_rows=100, good_rows=97, blank_lines=1, bad=[(3, REASON_COLUMNS), (17, REASON_LABEL), (40, REASON_COLUMNS)])
    )
    r.add_block(
        BlockReport(
            total_rows=50,
            good_rows=46,
            padded_rows=2,
            padded_fields=3,
            padded_max=2,
            bad=[(120, REASON_HEX), (130, REASON_COLUMNS), (140, REASON_COLUMNS), (150, REASON_HEX)],
        )
    )
    r.add_block(BlockReport(total_rows=10, good_rows=10, blank_lines=2, padded_rows=1, padded_fields=1, padded_max=1))
    return r


def test_blocks_add_up_and_only_the_first_bad_lines_are_kept():
    r = _merged()
    assert (r.total_rows, r.good_rows, r.bad_rows, r.blank_lines) == (160, 153, 7, 3)
    assert (r.padded_rows, r.padded_fields, r.padded_max) == (3, 4, 2)
    assert r.bad_by_reason == {REASON_COLUMNS: 4, REASON_LABEL: 1, REASON_HEX: 2}
    assert len(r.first_bad_lines) == MAX_BAD_LINES_KEPT == 5
    assert r.first_bad_lines == [(3, REASON_COLUMNS), (17, REASON_LABEL), (40, REASON_COLUMNS), (120, REASON_HEX), (130, REASON_COLUMNS)]
    assert r.bad_fraction == 7 / 160 and r.name == "day_0.tsv"
    assert FileReport(path="x", format="tsv").bad_fraction == 0.0  # no rows: no division by zero


def test_summary_is_one_line_with_reasons_by_count():
    assert _merged().summary() == (
        "day_0.tsv: skipped 7 of 160 rows (wrong column count: 4, non-hex id: 2, bad label: 1); first bad lines: 3, 17, 40, 120, 130; "
        "padded 3 short rows whose trailing empty fields were missing (4 fields in all, up to 2 in a row, read as empty); "
        "ignored 3 blank lines"
    )
    clean = FileReport(path="/d/a.csv", format="csv", total_rows=5, good_rows=5)
    assert clean.summary() == "a.csv: skipped 0 of 5 rows"


def test_to_dict_is_what_the_manifest_stores():
    d = _merged().to_dict()
    assert d["bad_fraction"] == 7 / 160 and d["path"] == "/data/day_0.tsv" and d["format"] == "tsv" and d["header"] is False
    assert d["first_bad_lines"][:2] == [{"line": 3, "reason": REASON_COLUMNS}, {"line": 17, "reason": REASON_LABEL}]
    assert d["bad_by_reason"] == {REASON_COLUMNS: 4, REASON_LABEL: 1, REASON_HEX: 2}


def test_too_many_bad_rows_stop_the_run_with_one_line():
    r = _merged()
    check_bad_fraction(r, 0.05)  # 4.4%: under the limit
    msg = (
        "/data/day_0.tsv: bad-row fraction 0.0437 (7 of 160 rows: wrong column count: 4, non-hex id: 2, bad label: 1) "
        "exceeds max_bad_fraction=0.01; first bad lines: 3, 17, 40, 120, 130; nothing was written"
    )
    with pytest.raises(DataFileError, match=re.escape(msg)):
        check_bad_fraction(r, 0.01)
