"""Stage 2 for Avazu: a block of raw lines -> (no dense, hashed ids, labels) + its bad-row report.

Why per line: every Avazu value is hashed with CRC32 of its bytes (stable across processes and
runs, unlike ``hash()``), which numpy cannot vectorise; ``zlib.crc32`` is C and the per-line
work is one ``split``. Blocks still parse on threads and files in order.
"""

from __future__ import annotations

import operator
import zlib

import numpy as np

from recsys.data.preprocess.bad_rows import REASON_COLUMNS, REASON_LABEL, BlockReport
from recsys.data.preprocess.parse_criteo import ParsedBlock
from recsys.data.preprocess.read_blocks import Block, Layout

__all__ = ["AVAZU_COLUMNS", "AVAZU_SPARSE_NAMES", "avazu_hash", "parse_avazu_block"]

AVAZU_COLUMNS: list[str] = [
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]  # fmt: skip
AVAZU_SPARSE_NAMES: list[str] = [c for c in AVAZU_COLUMNS if c not in ("id", "click")]

_LABELS: dict[bytes, float] = {b"0": 0.0, b"1": 1.0, b"0.0": 0.0, b"1.0": 1.0}


def avazu_hash(value: str | bytes) -> int:
    """The id an Avazu categorical value maps to (CRC32 of its UTF-8 bytes; "" -> -1)."""
    b = value.encode("utf-8") if isinstance(value, str) else value
    return zlib.crc32(b) if b else -1


def parse_avazu_block(block: Block, layout: Layout) -> ParsedBlock:
    """Parse the lines of one block; ``layout.mapping`` is ``(click, *categorical columns)``."""
    num_cols, label_idx, cat_idx = layout.num_cols, layout.mapping[0], list(layout.mapping[1:])
    getter = operator.itemgetter(*cat_idx)
    crc32 = zlib.crc32
    labels_get = _LABELS.get
    labels_l: list[float] = []
    add_label = labels_l.append
    hashes: list[int] = []
    extend = hashes.extend
    rep = BlockReport()
    lines = block.data.split(b"\n")
    if block.data.endswith(b"\n"):
        lines.pop()
    lineno = block.first_lineno - 1
    for raw in lines:
        lineno += 1
        line = raw.rstrip(b"\r\n")
        if not line or line.isspace():
            rep.blank_lines += 1
            continue
        parts = line.split(b",")
        if len(parts) != num_cols:
            rep.bad.append((lineno, REASON_COLUMNS))
            continue
        label = labels_get(parts[label_idx])
        if label is None:
            rep.bad.append((lineno, REASON_LABEL))
            continue
        add_label(label)
        if b",," in line or line[:1] == b"," or line[-1:] == b",":  # some field is empty
            extend([crc32(x) if x else -1 for x in getter(parts)])
        else:
            extend(map(crc32, getter(parts)))
    m = len(labels_l)
    sparse = np.fromiter(hashes, dtype=np.int64, count=len(hashes)).reshape(m, len(cat_idx))
    rep.total_rows = m + len(rep.bad)
    rep.good_rows = m
    return ParsedBlock(np.zeros((m, 0), np.float32), sparse, np.asarray(labels_l, dtype=np.float32), rep)
