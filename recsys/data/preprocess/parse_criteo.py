"""Stage 2 for Criteo: a block of raw lines -> (dense, sparse, labels) arrays + its bad-row report.

Why two paths with one result. The *fast path* splits a whole block with numpy (positions of all
separators and newlines at once), and decodes the fields of clean rows straight from the bytes:
a label ``0``/``1``, integers of at most 15 digits with an optional ``-``, ids of at most 8 hex
digits (or empty fields). Any row it does not recognise as clean (a wrong column count, a blank
line, a NUL or stray ``\\r``, ``1e3``, ``+7``, ``12.0``, a bad label or id, a short row to pad) is
handed to the *reference path*, the per-line parser that preprocessing used before, which decides
whether the row is good and, if not, why. Both paths fill the same raw arrays in line order and
the dense transform runs once on the merged result, so the shards and the bad-row report are
exactly those of the reference path alone (``tests/integration/data/test_parse_blocks.py`` checks this on tricky
input); only the speed differs.

numpy releases the GIL in all the array work here, so blocks parse in parallel on threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from recsys.data.preprocess.bad_rows import (
    LINE_REASONS,
    REASON_COLUMNS,
    REASON_HEX,
    REASON_INTEGER,
    REASON_LABEL,
    REASON_NON_INTEGRAL,
    REASON_NUL,
    BlockReport,
)
from recsys.data.preprocess.read_blocks import Block, Layout

__all__ = [
    "CRITEO_DENSE_NAMES", "CRITEO_SPARSE_NAMES", "CRITEO_COLUMNS", "ParsedBlock", "parse_criteo_block",
    "parse_criteo_lines", "dense_transform",
]  # fmt: skip

CRITEO_DENSE_NAMES: list[str] = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE_NAMES: list[str] = [f"C{i}" for i in range(1, 27)]
CRITEO_COLUMNS: list[str] = ["label", *CRITEO_DENSE_NAMES, *CRITEO_SPARSE_NAMES]
_ND, _NS = len(CRITEO_DENSE_NAMES), len(CRITEO_SPARSE_NAMES)
_MAX_HEX_LEN = 8


@dataclass
class ParsedBlock:
    """Rows of one block in file order: dense f32 [m,13], sparse i64 [m,ns], labels f32 [m]."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    report: BlockReport


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """The shards' dense values: ``log1p(max(x, 0))`` as float32."""
    return np.log1p(np.maximum(raw, 0.0)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Reference path: per line only bytes.split runs in Python; per-field work is vectorised
# --------------------------------------------------------------------------------------------


def _byte_flags(good: bytes, values: Sequence[int] | None = None) -> np.ndarray:
    """256-entry table: ``values[i]`` (or 0) for the bytes in ``good``, 0x80 for any other byte."""
    t = np.full(256, 0x80, dtype=np.uint8)
    for i, c in enumerate(good):
        t[c] = 0 if values is None else values[i]
    return t


# 0 for bytes an integer field may contain (incl. the NUL padding of the fixed-width view), else 0x80.
_DENSE_CHAR_FLAGS = _byte_flags(b"\x000123456789+-.eE")
# Hex digit -> its value; NUL padding -> 0; any other byte -> 0x80.
_HIGH_BITS = np.uint64(0x8080808080808080)
_HEX_VALUE = _byte_flags(b"\x000123456789abcdefABCDEF", [0, *range(10), *range(10, 16), *range(10, 16)])
_FIELD_WIDTH = 16  # fixed width of the numpy byte-string view; 16+ byte fields are rejected


def _float_or_nan(x: bytes) -> float:
    try:
        return float(x)
    except ValueError:
        return math.nan


def parse_criteo_lines(
    lines: Sequence[tuple[int, bytes]], layout: Layout, min_pad_cols: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, BlockReport]:
    """The reference parser for numbered lines (no line ending needed).

    Returns the good rows' line numbers, raw dense values (float64, before the transform), ids,
    labels, and the report of these lines. Per line only ``split`` runs in Python; the fields go
    into one fixed-width byte-string array and labels, integers (``260.0`` ok, ``1.5``/``abc``
    not) and hex ids are validated and decoded column-wise in numpy.
    """
    rep = BlockReport()
    bad: list[tuple[int, str]] = []
    sep, num_cols, mapping = layout.sep, layout.num_cols, list(layout.mapping)
    flat: list[bytes] = []
    linenos: list[int] = []
    pad = [b""] * num_cols
    lo_pad = num_cols if min_pad_cols is None else min_pad_cols
    for lineno, raw in lines:
        line = raw.rstrip(b"\r\n")
        if not line or line.isspace():
            rep.blank_lines += 1
            continue
        if b"\0" in line:  # would be confused with the padding of the fixed-width view
            bad.append((lineno, REASON_NUL))
            continue
        parts = line.split(sep)
        n = len(parts)
        if n != num_cols:
            if lo_pad <= n < num_cols:
                parts.extend(pad[n:])
                rep.padded_rows += 1
                rep.padded_fields += num_cols - n
                rep.padded_max = max(rep.padded_max, num_cols - n)
            else:
                bad.append((lineno, REASON_COLUMNS))
                continue
        flat.extend(parts)
        linenos.append(lineno)
    m = len(linenos)
    W = _FIELD_WIDTH
    arr = np.fromiter(flat, dtype=f"S{W}", count=len(flat)).reshape(m, num_cols)
    del flat
    if mapping != list(range(num_cols)):
        arr = np.ascontiguousarray(arr[:, mapping])
    u = arr.view(np.uint8).reshape(m, len(CRITEO_COLUMNS), W)

    lab = arr[:, 0]
    is_one = (lab == b"1") | (lab == b"1.0")
    label_ok = is_one | (lab == b"0") | (lab == b"0.0")

    # integer features: allowed characters only, then numpy's float parser, then integrality
    flags = _DENSE_CHAR_FLAGS[u[:, 1 : 1 + _ND, :]].view(np.uint64)  # [m, nd, W/8]
    field_ok = ((np.bitwise_or.reduce(flags, axis=2) & _HIGH_BITS) == 0) & (u[:, 1 : 1 + _ND, W - 1] == 0)
    d = np.where(field_ok & (arr[:, 1 : 1 + _ND] != b""), arr[:, 1 : 1 + _ND], b"0")
    try:
        raw_dense = d.astype(np.float64)
    except ValueError:  # e.g. "-" or "1-2": rare, so fall back to a per-field parse
        raw_dense = np.array([_float_or_nan(x) for x in d.ravel().tolist()], dtype=np.float64).reshape(m, _ND)
    raw_dense[~field_ok] = np.nan
    finite = np.isfinite(raw_dense).all(axis=1)
    with np.errstate(invalid="ignore"):
        integral = (raw_dense == np.floor(raw_dense)).all(axis=1)

    # categorical: at most 8 hex digits. The left-aligned digits are packed into a big-endian
    # uint32 (= the value times 16**(8 - length)) and shifted right by the missing digits.
    cu = u[:, 1 + _ND :, :]
    digits = _HEX_VALUE[cu[:, :, :_MAX_HEX_LEN]]  # [m, ns, 8], contiguous
    hex_ok = ((digits.view(np.uint64)[:, :, 0] & _HIGH_BITS) == 0) & (cu[:, :, _MAX_HEX_LEN] == 0)
    hex_ok = hex_ok.all(axis=1)
    digits &= 0x0F
    packed = np.ascontiguousarray((digits[:, :, 0::2] << 4) | digits[:, :, 1::2])
    sparse = packed.view(">u4").reshape(m, _NS).astype(np.int64)
    empty = cu[:, :, 0] == 0
    short = ~empty & (cu[:, :, _MAX_HEX_LEN - 1] == 0)  # 1..7 digits: rare in real data
    if short.any():
        length = np.strings.str_len(arr[:, 1 + _ND :][short])
        sparse[short] >>= 4 * (_MAX_HEX_LEN - np.minimum(length, _MAX_HEX_LEN))
    sparse[empty] = -1

    ok = label_ok & finite & integral & hex_ok
    good_lines = np.asarray(linenos, dtype=np.int64)
    if not ok.all():
        for i in np.flatnonzero(~ok):
            if not label_ok[i]:
                reason = REASON_LABEL
            elif not finite[i]:
                reason = REASON_INTEGER
            elif not integral[i]:
                reason = REASON_NON_INTEGRAL
            else:
                reason = REASON_HEX
            bad.append((linenos[i], reason))
        raw_dense, sparse, is_one, good_lines = raw_dense[ok], sparse[ok], is_one[ok], good_lines[ok]
    rep.bad = sorted(bad)
    rep.total_rows = m + sum(1 for _, r in bad if r in LINE_REASONS)
    rep.good_rows = int(is_one.shape[0])
    return good_lines, raw_dense, sparse, is_one.astype(np.float32), rep


# --------------------------------------------------------------------------------------------
# Fast path: the whole block at once
# --------------------------------------------------------------------------------------------

_PAD = 16  # zero bytes before and after the block, so fixed-width windows never leave the buffer
_NL, _CR, _MINUS, _ZERO = 0x0A, 0x0D, 0x2D, 0x30
_U = np.uint64
_ALL = _U(0xFFFFFFFFFFFFFFFF)
_ASCII_ZEROS = _U(0x3030303030303030)
_SEVENTY_SIXES = _U(0x7676767676767676)
_LANE16 = _U(0x000F000F000F000F)
_LANE32 = _U(0x000000FF000000FF)
_LOW16 = _U(0xFFFF)


def _byte_pair_table() -> np.ndarray:
    """uint16 (two bytes, little-endian) -> 16 * hex(first) + hex(second), or 0x100 if either is no hex digit."""
    v = _byte_flags(b"0123456789abcdefABCDEF", [*range(10), *range(10, 16), *range(10, 16)]).astype(np.uint16)
    first, second = v[np.arange(1 << 16) & 0xFF], v[np.arange(1 << 16) >> 8]
    bad = (first | second) & 0x80
    return np.where(bad != 0, 0x100, (first << 4) | second).astype(np.uint16)


_HEX_PAIRS = _byte_pair_table()


def _u64_at(buf: np.ndarray) -> np.ndarray:
    """Unaligned uint64 (little-endian) view starting at every byte of ``buf``."""
    return np.ndarray((buf.shape[0] - 7,), dtype="<u8", buffer=buf, strides=(1,))


def _last_bytes(u64: np.ndarray, ends: np.ndarray, n: np.ndarray, fill: np.uint64) -> np.ndarray:
    """The ``n`` (0..8) bytes before ``ends`` right-aligned in a uint64, the other bytes ``fill``'s."""
    keep = _ALL << ((8 - n.astype(np.uint64)) << _U(3))
    return (u64[ends - 8] & keep) | (fill & ~keep)


def _decimal8(x: np.ndarray) -> np.ndarray:
    """Eight ASCII digits (first = most significant = lowest byte) -> their integer (SWAR)."""
    x = (x & _LANE16) * _U(10) + ((x >> _U(8)) & _LANE16)
    x = (x & _LANE32) * _U(100) + ((x >> _U(16)) & _LANE32)
    return (x & _LOW16) * _U(10000) + ((x >> _U(32)) & _LOW16)


def _not_digits(x: np.ndarray) -> np.ndarray:
    """True where some byte of ``x`` is not an ASCII digit (SWAR; no false negatives)."""
    d = x - _ASCII_ZEROS  # a borrow only starts at a byte < "0", which is then > 9 itself
    return (((d + _SEVENTY_SIXES) | d) & _HIGH_BITS) != 0


def _fast_rows(
    buf: np.ndarray, u64: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode candidate rows given field [start, end) positions in ``buf``, wanted columns only.

    Returns (clean mask, raw dense f64, ids i64, labels f32); rows not clean are left to the
    reference path and their values are meaningless.
    """
    lens = ends - starts
    # label: exactly "0" or "1"
    lab = buf[starts[:, 0]]
    clean = (lens[:, 0] == 1) & ((lab == _ZERO) | (lab == _ZERO + 1))
    labels = (lab - _ZERO).astype(np.float32)

    # integers: "", or an optional "-" and 1..15 digits
    dl = lens[:, 1 : 1 + _ND]
    de = ends[:, 1 : 1 + _ND]
    neg = buf[starts[:, 1 : 1 + _ND]] == _MINUS
    neg &= dl > 0
    ndig = dl - neg.view(np.int8)
    clean &= ((ndig > 0) | (dl == 0)).all(axis=1) & (dl <= 15).all(axis=1)
    lo = _last_bytes(u64, de, np.clip(ndig, 0, 8), _ASCII_ZEROS)
    clean &= ~_not_digits(lo).any(axis=1)
    value = _decimal8(lo).astype(np.float64)
    big = np.flatnonzero(ndig > 8)  # 9..15 digits: rare
    if big.shape[0]:
        hi = _last_bytes(u64, de.ravel()[big] - 8, np.clip(ndig.ravel()[big] - 8, 0, 7), _ASCII_ZEROS)
        clean[big[_not_digits(hi)] // _ND] = False
        value.ravel()[big] += _decimal8(hi).astype(np.float64) * 1e8
    raw = np.where(neg, -value, value)

    # ids: "" or 1..8 hex digits, looked up two characters at a time
    sl = lens[:, 1 + _ND :]
    clean &= (sl <= _MAX_HEX_LEN).all(axis=1)
    w = _last_bytes(u64, ends[:, 1 + _ND :], np.minimum(sl, _MAX_HEX_LEN), _ASCII_ZEROS)
    pairs = _HEX_PAIRS[w.view(np.uint16)].view(np.uint64)  # 4 x (16-bit lane: byte value | 0x100 if bad)
    clean &= ((pairs & _U(0x0100010001000100)) == 0).all(axis=1)
    pairs = ((pairs & _LANE32) << _U(8)) | ((pairs >> _U(16)) & _LANE32)
    ids = (((pairs & _LOW16) << _U(16)) | ((pairs >> _U(32)) & _LOW16)).view(np.int64)
    ids[sl == 0] = -1
    return clean, raw, ids, labels


def parse_criteo_block(block: Block, layout: Layout, min_pad_cols: int | None, *, fast: bool = True) -> ParsedBlock:
    """Parse one block (see the module docstring); rows come out in line order.

    ``fast=False`` sends every line through the reference path (for tests and comparisons).
    """
    data = block.data
    if not fast:
        lines = data.split(b"\n")
        if data.endswith(b"\n"):
            lines.pop()
        good, raw, ids, labels, rep = parse_criteo_lines([(block.first_lineno + i, x) for i, x in enumerate(lines)], layout, min_pad_cols)
        return ParsedBlock(dense_transform(raw), ids, labels, rep)
    n = len(data)
    total = n if data.endswith(b"\n") else n + 1  # a last line without newline gets one
    buf = np.zeros(total + 2 * _PAD, dtype=np.uint8)
    buf[_PAD : _PAD + n] = np.frombuffer(data, dtype=np.uint8)
    buf[_PAD + total - 1] = _NL
    body = buf[_PAD : _PAD + total]
    num_cols = layout.num_cols
    sep = layout.sep[0]

    pos_t = np.int32 if buf.shape[0] < (1 << 31) else np.int64  # halves the traffic of the index work
    if sep < _NL:  # a tab: one comparison finds tabs, newlines and the rarer control bytes below them
        delims = np.flatnonzero(body <= _NL).astype(pos_t)
        kind = body[delims]
        if not ((kind == sep) | (kind == _NL)).all():  # a control byte inside a field: not a delimiter
            delims = delims[(kind == sep) | (kind == _NL)]
    else:
        delims = np.flatnonzero((body == sep) | (body == _NL)).astype(pos_t)
    delims += _PAD
    nl_idx = np.flatnonzero(buf[delims] == _NL)  # index in delims of every line's end
    num_lines = nl_idx.shape[0]
    line_end = delims[nl_idx]
    line_start = np.empty(num_lines, pos_t)
    line_start[0] = _PAD
    line_start[1:] = line_end[:-1] + 1
    fields = np.diff(nl_idx, prepend=-1)
    cand = np.flatnonzero(fields == num_cols)
    if cand.shape[0] == num_lines and delims.shape[0] == num_lines * num_cols:
        ends = delims.reshape(num_lines, num_cols)
    else:
        ends = delims[(nl_idx[cand] - (num_cols - 1))[:, None] + np.arange(num_cols)]
    starts = np.empty_like(ends)
    starts[:, 0] = line_start[cand]
    starts[:, 1:] = ends[:, :-1] + 1
    last = ends[:, -1]
    crlf = (buf[last - 1] == _CR) & (last > starts[:, -1])
    ends[:, -1] = last - crlf
    mapping = list(layout.mapping)
    if mapping != list(range(num_cols)):
        starts, ends = np.ascontiguousarray(starts[:, mapping]), np.ascontiguousarray(ends[:, mapping])
    clean, raw, ids, labels = _fast_rows(buf, _u64_at(buf), starts, ends)

    if len(set(mapping)) < num_cols:  # unused columns are not looked at: a NUL there is still bad
        nul_lines = np.searchsorted(line_end, np.flatnonzero(body == 0) + _PAD)
        clean &= ~np.isin(cand, nul_lines)
    slow = np.ones(num_lines, dtype=bool)
    slow[cand[clean]] = False
    slow_idx = np.flatnonzero(slow)
    fast_idx = cand[clean]
    raw, ids, labels = raw[clean], ids[clean], labels[clean]
    rep = BlockReport(total_rows=fast_idx.shape[0], good_rows=fast_idx.shape[0])
    if slow_idx.shape[0]:
        lines = [(block.first_lineno + int(i), buf[int(line_start[i]) : int(line_end[i])].tobytes()) for i in slow_idx]
        s_lines, s_raw, s_ids, s_labels, s_rep = parse_criteo_lines(lines, layout, min_pad_cols)
        rep.total_rows += s_rep.total_rows
        rep.good_rows += s_rep.good_rows
        rep.blank_lines, rep.padded_rows, rep.bad = s_rep.blank_lines, s_rep.padded_rows, s_rep.bad
        rep.padded_fields, rep.padded_max = s_rep.padded_fields, s_rep.padded_max
        if s_lines.shape[0]:
            order = np.argsort(np.concatenate([fast_idx, s_lines - block.first_lineno]), kind="stable")
            raw = np.concatenate([raw, s_raw])[order]
            ids = np.concatenate([ids, s_ids])[order]
            labels = np.concatenate([labels, s_labels])[order]
    return ParsedBlock(dense_transform(raw), ids, labels, rep)
