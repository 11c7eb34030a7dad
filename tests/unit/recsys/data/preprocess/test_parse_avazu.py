"""Parsing Avazu lines: every categorical value hashed to the CRC32 of its bytes (empty: -1), the
click as the label, and the reason and line of every refused row."""

from __future__ import annotations

import zlib

import numpy as np

from recsys.data.preprocess.bad_rows import REASON_COLUMNS, REASON_LABEL
from recsys.data.preprocess.parse_avazu import AVAZU_COLUMNS, AVAZU_SPARSE_NAMES, avazu_hash, parse_avazu_block
from recsys.data.preprocess.read_blocks import Block, Layout

LAYOUT = Layout(b",", 24, tuple(AVAZU_COLUMNS.index(c) for c in ["click", *AVAZU_SPARSE_NAMES]), header=True)
ROW_1 = (
    "1000009418151094273,0,14102100,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,ddd2926e,44956a24,"
    "1,2,15706,320,50,1722,0,35,-1,79"
)
ROW_2 = (  # empty site_id and C21
    "10000169349117863715,1,14102100,1005,0,,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,96809ac8,711ee120,"
    "1,0,15704,320,50,1722,0,35,100084,"
)


def _ids(row: str) -> list[int]:
    """CRC32 of each value's bytes, -1 for an empty one, for every column but id and click."""
    return [zlib.crc32(v.encode()) if v else -1 for v in row.split(",")[2:]]


def test_values_hash_to_crc32_and_the_click_is_the_label():
    parsed = parse_avazu_block(Block(2, f"{ROW_1}\n{ROW_2}\n".encode()), LAYOUT)
    assert parsed.sparse.tolist() == [_ids(ROW_1), _ids(ROW_2)]
    assert parsed.labels.tolist() == [0.0, 1.0] and parsed.dense.shape == (2, 0)
    assert parsed.sparse[1, 3] == -1 and parsed.sparse[1, -1] == -1  # empty site_id and C21
    assert parsed.sparse[0, 0] == zlib.crc32(b"14102100")  # hour stays categorical
    assert (parsed.report.total_rows, parsed.report.good_rows, parsed.report.bad) == (2, 2, [])


def test_avazu_hash_of_text_and_bytes():
    assert avazu_hash("1fbe01fe") == avazu_hash(b"1fbe01fe") == zlib.crc32(b"1fbe01fe")
    assert avazu_hash("é") == zlib.crc32("é".encode("utf-8"))
    assert avazu_hash("") == avazu_hash(b"") == -1


def test_refused_rows_are_counted_with_their_line_and_reason():
    lines = [ROW_1, "", ROW_1.replace(",0,14102100", ",yes,14102100", 1), ROW_1 + ",extra", ROW_2.rsplit(",", 3)[0], "  ", ROW_2 + "\r"]
    parsed = parse_avazu_block(Block(10, "\n".join(lines).encode()), LAYOUT)  # no final newline
    assert parsed.report.bad == [(12, REASON_LABEL), (13, REASON_COLUMNS), (14, REASON_COLUMNS)]
    assert (parsed.report.total_rows, parsed.report.good_rows, parsed.report.blank_lines) == (5, 2, 2)
    np.testing.assert_array_equal(parsed.sparse, [_ids(ROW_1), _ids(ROW_2)])


def test_columns_are_taken_where_the_header_puts_them():
    order = list(reversed(AVAZU_COLUMNS))
    layout = Layout(b",", 24, tuple(order.index(c) for c in ["click", *AVAZU_SPARSE_NAMES]), header=True)
    values = dict(zip(AVAZU_COLUMNS, ROW_2.split(",")))
    parsed = parse_avazu_block(Block(2, ",".join(values[c] for c in order).encode()), layout)
    assert parsed.sparse.tolist() == [_ids(ROW_2)] and parsed.labels.tolist() == [1.0]
