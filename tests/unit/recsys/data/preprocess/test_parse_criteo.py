"""Parsing Criteo lines: hand-written rows against values worked out in the test (hex ids,
log1p of the counts, -1 for a missing id), the reason and line of every refused row, padding of
rows that lost trailing empty fields, and the fast path agreeing with the reference path."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recsys.data.preprocess.bad_rows import REASON_COLUMNS, REASON_HEX, REASON_INTEGER, REASON_LABEL, REASON_NON_INTEGRAL, REASON_NUL
from recsys.data.preprocess.parse_criteo import CRITEO_COLUMNS, dense_transform, parse_criteo_block, parse_criteo_lines
from recsys.data.preprocess.read_blocks import Block, Layout

TSV = Layout(b"\t", 40, tuple(range(40)))


def _line(label="1", ints=None, cats=None, sep="\t") -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return sep.join([label, *ints, *cats])


GOOD = [
    _line(
        "1",
        ["5", "", "-3", "260.0", "0", "12345678901", "7", "", "", "1", "2", "3", "99"],
        ["05db9164", "", "a", *[f"{i:x}" for i in range(23)]],
    ),
    _line("0", [""] * 13, [""] * 26),
    _line("1.0"),
    _line("0.0", cats=["FFFFFFFF", "DeadBeef", *["0"] * 24]),
]


def _expected(line: str, sep: str = "\t") -> tuple[list[float], list[int], float]:
    """The reference semantics, written out: log1p(max(x, 0)) of each count (missing: 0), ids as
    hexadecimal numbers (missing: -1), the label as a number."""
    parts = line.split(sep)
    dense = [math.log1p(max(float(x), 0.0)) if x else 0.0 for x in parts[1:14]]
    ids = [int(x, 16) if x else -1 for x in parts[14:]]
    return dense, ids, float(parts[0])


def _block(lines, first=1) -> Block:
    return Block(first, ("\n".join(lines) + "\n").encode())


@pytest.mark.parametrize("fast", [True, False])
def test_good_rows_decode_to_the_expected_values(fast):
    parsed = parse_criteo_block(_block(GOOD), TSV, None, fast=fast)
    assert parsed.report.total_rows == parsed.report.good_rows == 4 and parsed.report.bad == []
    for k, line in enumerate(GOOD):
        dense, ids, label = _expected(line)
        np.testing.assert_allclose(parsed.dense[k], dense, rtol=1e-6)
        assert parsed.sparse[k].tolist() == ids and parsed.labels[k] == label
    assert parsed.sparse[0, :3].tolist() == [0x05DB9164, -1, 0xA] and parsed.sparse[3, :2].tolist() == [0xFFFFFFFF, 0xDEADBEEF]
    assert parsed.dense.dtype == np.float32 and parsed.sparse.dtype == np.int64 and parsed.labels.dtype == np.float32


BAD = [
    (_line("2"), REASON_LABEL),
    (_line(ints=["abc", *["1"] * 12]), REASON_INTEGER),
    (_line(ints=["1e3", *["1"] * 12]), None),  # a number written otherwise, still an integer: good
    (_line(ints=["1.5", *["1"] * 12]), REASON_NON_INTEGRAL),
    (_line(cats=["zz", *["1"] * 25]), REASON_HEX),
    (_line(cats=["123456789", *["1"] * 25]), REASON_HEX),  # more than 32 bits
    ("1\t2\t3", REASON_COLUMNS),
    (_line() + "\textra", REASON_COLUMNS),
    (_line(ints=["1\x002", *["1"] * 12]), REASON_NUL),
]


@pytest.mark.parametrize("fast", [True, False])
def test_refused_rows_are_counted_with_their_line_and_reason(fast):
    lines = [GOOD[0]]
    for line, _ in BAD:
        lines += [line, ""]  # blank lines between them keep the physical numbering honest
    parsed = parse_criteo_block(_block(lines, first=11), TSV, None, fast=fast)
    want_bad = [(12 + 2 * k, reason) for k, (_, reason) in enumerate(BAD) if reason is not None]
    assert parsed.report.bad == want_bad
    assert (parsed.report.total_rows, parsed.report.good_rows, parsed.report.blank_lines) == (1 + len(BAD), 2, len(BAD))
    assert parsed.dense[1, 0] == np.float32(math.log1p(1000.0))  # the "1e3" row, kept in line order


@pytest.mark.parametrize("fast", [True, False])
def test_rows_short_of_trailing_categorical_fields_are_padded_only_when_allowed(fast):
    short = "\t".join(_line().split("\t")[:37])  # lacks C24..C26
    too_short = "\t".join(_line().split("\t")[:13])  # lacks dense values: never padded
    parsed = parse_criteo_block(_block([short, too_short]), TSV, 14, fast=fast)
    assert parsed.report.bad == [(2, REASON_COLUMNS)]
    assert (parsed.report.padded_rows, parsed.report.padded_fields, parsed.report.padded_max) == (1, 3, 3)
    assert parsed.sparse[0, -4:].tolist() == [22, -1, -1, -1]
    strict = parse_criteo_block(_block([short]), TSV, None, fast=fast)
    assert strict.report.bad == [(1, REASON_COLUMNS)] and strict.report.padded_rows == 0


def test_a_csv_header_order_is_followed_through_the_mapping():
    order = list(reversed(CRITEO_COLUMNS))  # columns in another order in the file
    layout = Layout(b",", 40, tuple(order.index(c) for c in CRITEO_COLUMNS), header=True)
    line = GOOD[0].split("\t")
    row = ",".join(line[CRITEO_COLUMNS.index(c)] for c in order)
    for fast in (True, False):
        parsed = parse_criteo_block(Block(2, row.encode()), layout, None, fast=fast)  # no final newline either
        dense, ids, label = _expected(GOOD[0])
        assert parsed.sparse[0].tolist() == ids and parsed.labels.tolist() == [label]
        np.testing.assert_allclose(parsed.dense[0], dense, rtol=1e-6)


def test_crlf_line_endings_are_stripped():
    parsed = parse_criteo_block(Block(1, (GOOD[2] + "\r\n" + GOOD[3] + "\r\n").encode()), TSV, None)
    assert parsed.report.good_rows == 2 and parsed.sparse[1].tolist() == _expected(GOOD[3])[1]


def test_the_fast_path_agrees_with_the_reference_on_random_rows():
    rng = np.random.default_rng(5)
    lines = []
    for _ in range(300):
        ints = [str(int(x)) if rng.random() > 0.3 else "" for x in rng.integers(-5, 10**9, 13)]
        cats = [f"{int(x):x}" if rng.random() > 0.2 else "" for x in rng.integers(0, 2**32, 26)]
        line = _line(str(int(rng.integers(0, 2))), ints, cats)
        if rng.random() < 0.05:
            line = line.replace("\t", "\t\t", 1)
        lines.append(line)
    fast = parse_criteo_block(_block(lines), TSV, None, fast=True)
    ref = parse_criteo_block(_block(lines), TSV, None, fast=False)
    np.testing.assert_array_equal(fast.dense, ref.dense)
    np.testing.assert_array_equal(fast.sparse, ref.sparse)
    np.testing.assert_array_equal(fast.labels, ref.labels)
    assert fast.report == ref.report and 0 < len(fast.report.bad) < 50


def test_reference_lines_return_raw_values_and_good_line_numbers():
    good, raw, ids, labels, rep = parse_criteo_lines([(7, GOOD[0].encode()), (9, b"1\t2"), (12, GOOD[1].encode())], TSV, None)
    assert good.tolist() == [7, 12] and rep.bad == [(9, REASON_COLUMNS)]
    assert raw[0, :4].tolist() == [5.0, 0.0, -3.0, 260.0] and labels.tolist() == [1.0, 0.0] and ids[1].tolist() == [-1] * 26
    np.testing.assert_allclose(dense_transform(np.array([-3.0, 0.0, 260.0])), [0.0, 0.0, math.log1p(260.0)], rtol=1e-6)
