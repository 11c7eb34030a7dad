"""Streaming parsers from raw Criteo / Avazu text files into shard directories.

Why this module exists: the raw files are huge (a Criteo 1TB day file has ~200M rows), contain
occasional malformed lines, and come in several layouts (Kaggle/1TB TSV, CSV with a header,
Avazu CSV). Parsing happens once, in bounded memory (chunks of ``chunk_rows`` lines), and the
result is a memory-mapped shard directory (:mod:`recsys.data.shards`) that training reads.

Malformed rows are skipped and counted per file (by reason, with the first few physical line
numbers) so data problems are visible in the log and in ``manifest.json``; a file whose bad
fraction exceeds ``max_bad_fraction`` aborts the whole run and nothing is written.

Only the standard library and numpy are used; ``.gz`` inputs are read transparently.

Not ``torchrec.datasets.criteo`` (``BinaryCriteoUtils.tsv_to_npys`` and friends): it has no
per-row validation (a malformed line raises or is silently mis-parsed), no bad-row accounting,
no CSV or Avazu layouts and no atomic output; its npy layout is close to ours, so its loaders
remain an option for already-converted data.
"""

from __future__ import annotations

import gzip
import io
import itertools
import logging
import math
import operator
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Literal, Sequence

import numpy as np

from recsys.data.cache_key import describe_change, make_key
from recsys.data.errors import DataFileError, read_error, reading
from recsys.data.shards import (
    FORMAT_VERSION,
    InvalidShardDirError,
    ShardedDataset,
    ShardWriter,
)

logger = logging.getLogger(__name__)

CRITEO_DENSE_NAMES: list[str] = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE_NAMES: list[str] = [f"C{i}" for i in range(1, 27)]
CRITEO_COLUMNS: list[str] = ["label", *CRITEO_DENSE_NAMES, *CRITEO_SPARSE_NAMES]

AVAZU_COLUMNS: list[str] = [
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]  # fmt: skip
AVAZU_SPARSE_NAMES: list[str] = [c for c in AVAZU_COLUMNS if c not in ("id", "click")]

# Reasons a row is skipped (keys of FileReport.bad_by_reason).
REASON_COLUMNS = "wrong column count"
REASON_LABEL = "bad label"
REASON_INTEGER = "non-numeric integer"
REASON_NON_INTEGRAL = "non-integral number"
REASON_HEX = "non-hex id"
REASON_NUL = "NUL byte"
_LINE_REASONS = (REASON_COLUMNS, REASON_NUL)  # rows rejected before the vectorised checks

DEFAULT_CHUNK_ROWS = 1 << 16
DEFAULT_ROWS_PER_SHARD = 1 << 20
MAX_BAD_LINES_KEPT = 5
_PROGRESS_EVERY_ROWS = 10_000_000

# Bump when a parser change alters the shards of unchanged inputs: caches built before rebuild.
PARSER_VERSION = 1

_LABELS: dict[bytes, float] = {b"0": 0.0, b"1": 1.0, b"0.0": 0.0, b"1.0": 1.0}
_MAX_HEX_LEN = 8
_BOM = b"\xef\xbb\xbf"


@dataclass
class FileReport:
    """Per-input-file parse statistics; stored in the manifest under ``sources``.

    ``total_rows`` counts data rows (good + bad); the header and blank lines are excluded.
    ``first_bad_lines`` holds ``(line, reason)`` with 1-based physical line numbers, so that
    ``sed -n <line>p file`` shows the offending line (a header counts as line 1).
    """

    path: str
    format: str
    header: bool = False
    total_rows: int = 0
    good_rows: int = 0
    bad_rows: int = 0
    blank_lines: int = 0
    padded_rows: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    first_bad_lines: list[tuple[int, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def bad_fraction(self) -> float:
        return self.bad_rows / self.total_rows if self.total_rows else 0.0

    def record_bad(self, line: int, reason: str) -> None:
        self.bad_rows += 1
        self.bad_by_reason[reason] = self.bad_by_reason.get(reason, 0) + 1
        if len(self.first_bad_lines) < MAX_BAD_LINES_KEPT:
            self.first_bad_lines.append((line, reason))

    def _reasons_text(self) -> str:
        return ", ".join(f"{r}: {n}" for r, n in sorted(self.bad_by_reason.items(), key=lambda kv: -kv[1]))

    def _lines_text(self) -> str:
        return ", ".join(str(line) for line, _ in self.first_bad_lines)

    def summary(self) -> str:
        """One log line, e.g. ``x.tsv: skipped 3 of 1000 rows (wrong column count: 2, ...); first bad lines: 17, 45, 99``."""
        s = f"{self.name}: skipped {self.bad_rows} of {self.total_rows} rows"
        if self.bad_rows:
            s += f" ({self._reasons_text()}); first bad lines: {self._lines_text()}"
        if self.padded_rows:
            s += f"; padded {self.padded_rows} short rows whose trailing empty fields were missing"
        if self.blank_lines:
            s += f"; ignored {self.blank_lines} blank lines"
        return s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bad_fraction"] = self.bad_fraction
        d["first_bad_lines"] = [{"line": line, "reason": reason} for line, reason in self.first_bad_lines]
        return d


# --------------------------------------------------------------------------------------------
# File access helpers
# --------------------------------------------------------------------------------------------


def _open_binary(path: Path) -> BinaryIO:
    """Binary line iteration is faster than text mode and leaves ``\\r`` for us to strip."""
    if path.suffix == ".gz":
        return io.BufferedReader(gzip.open(path, "rb"), buffer_size=1 << 20)  # type: ignore[arg-type]
    return open(path, "rb", buffering=1 << 20)


def _first_line(path: Path) -> bytes | None:
    """First non-blank line without BOM and line ending, or None for an empty file."""
    with reading(path), _open_binary(path) as f:
        for raw in f:
            line = raw.rstrip(b"\r\n")
            if raw.startswith(_BOM):
                line = line[len(_BOM) :]
            if line.strip():
                return line
    return None


def _header_names(line: bytes, sep: bytes) -> list[str]:
    return [x.strip().strip(b"\"'").decode("utf-8", "replace").strip().lower() for x in line.split(sep)]


def detect_format(path: str | Path, default: str | None = None) -> str:
    """Guess the layout of a raw file from its first line: ``"tsv"``, ``"csv"`` or ``"avazu"``.

    ``"tsv"`` is Criteo Kaggle/1TB (tab-separated, no header); ``"csv"`` is Criteo with commas
    (normally a ``label,I1..,C26`` header); ``"avazu"`` is an Avazu CSV (header contains
    ``click``, or 24 columns). An empty file returns ``default`` or raises ``ValueError``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file not found: {p}")
    first = _first_line(p)
    if first is None:
        if default is not None:
            return default
        raise ValueError(f"{p}: file is empty, cannot detect its format")
    if b"\t" in first:
        return "tsv"
    if b"," in first:
        names = _header_names(first, b",")
        if "click" in names or len(names) == len(AVAZU_COLUMNS):
            return "avazu"
        return "csv"
    raise ValueError(f"{p}: cannot detect format (first line has neither tabs nor commas)")


def _normalize_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = [Path(p) for p in paths]
    if not out:
        raise ValueError("no input files given")
    return out


def _check_inputs(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir():
            raise read_error(p, IsADirectoryError(p))
        if not p.is_file():
            raise FileNotFoundError(f"input file not found: {p}")


def _column_mapping(
    path: Path, header: list[str], wanted: Sequence[str]
) -> list[int]:
    """Indices in ``header`` of each ``wanted`` column (case-insensitive), or ValueError."""
    index: dict[str, int] = {}
    for i, name in enumerate(header):
        index.setdefault(name, i)
    missing = [w for w in wanted if w.lower() not in index]
    if missing:
        raise ValueError(f"{path}: header lacks columns {missing} (header: {','.join(header)[:200]})")
    return [index[w.lower()] for w in wanted]


class _LineSource:
    """Opens a file, consumes an optional header, and yields numbered chunks of raw lines.

    A first line whose first field is a known column name is a header; it fixes the column count
    and where each wanted column sits. Without a header the file must follow ``default_layout``.
    """

    def __init__(self, path: Path, sep: bytes, wanted: Sequence[str], default_layout: Sequence[str]):
        self.path = path
        self.sep = sep
        self.wanted = list(wanted)
        self.default_layout = [c.lower() for c in default_layout]
        self.num_cols = len(self.default_layout)
        self.mapping = _column_mapping(path, self.default_layout, self.wanted)

    def chunks(self, chunk_rows: int, report: FileReport) -> Iterator[tuple[int, list[bytes]]]:
        """Yield ``(physical line number of lines[0], lines)``; sets num_cols/mapping first.

        Read failures (a truncated or fake ``.gz``, I/O errors) become a one-line
        ``DataFileError`` naming the file; errors of the consumer pass through untouched.
        """
        with reading(self.path), _open_binary(self.path) as f:
            first = f.readline()
            if not first:
                return
            probe = first[len(_BOM) :] if first.startswith(_BOM) else first
            names = _header_names(probe.rstrip(b"\r\n"), self.sep)
            body: Iterable[bytes]
            if probe.strip() and names[0] in self.default_layout:
                report.header = True
                self.num_cols = len(names)
                self.mapping = _column_mapping(self.path, names, self.wanted)
                lineno = 1
                body = f
            else:
                lineno = 0
                body = itertools.chain([probe], f)
            it = iter(body)
            while True:
                lines = list(itertools.islice(it, chunk_rows))
                if not lines:
                    return
                yield lineno + 1, lines
                lineno += len(lines)


# --------------------------------------------------------------------------------------------
# Chunk parsers: per line only bytes.split runs in Python; per-field work is vectorised
# --------------------------------------------------------------------------------------------


def _split_lines(
    lines: list[bytes],
    first_lineno: int,
    sep: bytes,
    num_cols: int,
    min_pad_cols: int | None,
    report: FileReport,
    bad: list[tuple[int, str]],
) -> tuple[list[bytes], list[int]]:
    """The only per-line Python work: split, check the column count, collect the fields flat."""
    flat: list[bytes] = []
    extend = flat.extend
    linenos: list[int] = []
    keep = linenos.append
    pad = [b""] * num_cols
    lo_pad = num_cols if min_pad_cols is None else min_pad_cols
    lineno = first_lineno - 1
    for raw in lines:
        lineno += 1
        line = raw.rstrip(b"\r\n")
        if not line or line.isspace():
            report.blank_lines += 1
            continue
        if b"\0" in line:  # would be confused with the padding of the fixed-width view
            bad.append((lineno, REASON_NUL))
            continue
        parts = line.split(sep)
        n = len(parts)
        if n != num_cols:
            if lo_pad <= n < num_cols:
                parts.extend(pad[n:])
                report.padded_rows += 1
            else:
                bad.append((lineno, REASON_COLUMNS))
                continue
        extend(parts)
        keep(lineno)
    return flat, linenos


def _byte_flags(good: bytes, values: Sequence[int] | None = None) -> np.ndarray:
    """256-entry table: ``values[i]`` (or 0) for the bytes in ``good``, 0x80 for any other byte."""
    t = np.full(256, 0x80, dtype=np.uint8)
    for i, c in enumerate(good):
        t[c] = 0 if values is None else values[i]
    return t


# 0 for bytes an integer field may contain (incl. the NUL padding of the fixed-width view), else 0x80.
_DENSE_CHAR_FLAGS = _byte_flags(b"\x000123456789+-.eE")
# Hex digit -> its value; NUL padding -> 0; any other byte -> 0x80.
_HEX_VALUE = _byte_flags(
    b"\x000123456789abcdefABCDEF", [0, *range(10), *range(10, 16), *range(10, 16)]
)
_HIGH_BITS = np.uint64(0x8080808080808080)
_FIELD_WIDTH = 16  # fixed width of the numpy byte-string view; 16+ byte fields are rejected


def _parse_criteo_chunk(
    lines: list[bytes],
    first_lineno: int,
    sep: bytes,
    num_cols: int,
    mapping: list[int],
    min_pad_cols: int | None,
    report: FileReport,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse Criteo lines into (dense f32 [m,13], sparse i64 [m,26], labels f32 [m]).

    Per line only ``split`` runs in Python; the fields go into one fixed-width byte-string array
    and labels, integers (``260.0`` ok, ``1.5``/``abc`` not) and hex ids are validated and decoded
    column-wise in numpy, several times faster than ``int(x, 16)`` per field.
    """
    bad: list[tuple[int, str]] = []
    flat, linenos = _split_lines(lines, first_lineno, sep, num_cols, min_pad_cols, report, bad)
    m = len(linenos)
    W = _FIELD_WIDTH
    arr = np.fromiter(flat, dtype=f"S{W}", count=len(flat)).reshape(m, num_cols)
    del flat
    if mapping != list(range(num_cols)):
        arr = np.ascontiguousarray(arr[:, mapping])
    u = arr.view(np.uint8).reshape(m, len(CRITEO_COLUMNS), W)
    nd, ns = len(CRITEO_DENSE_NAMES), len(CRITEO_SPARSE_NAMES)

    # label: 0/1 (also 0.0/1.0)
    lab = arr[:, 0]
    is_one = (lab == b"1") | (lab == b"1.0")
    label_ok = is_one | (lab == b"0") | (lab == b"0.0")

    # integer features: allowed characters only, then numpy's float parser, then integrality
    flags = _DENSE_CHAR_FLAGS[u[:, 1 : 1 + nd, :]].view(np.uint64)  # [m, nd, W/8]
    field_ok = ((np.bitwise_or.reduce(flags, axis=2) & _HIGH_BITS) == 0) & (u[:, 1 : 1 + nd, W - 1] == 0)
    d = np.where(field_ok & (arr[:, 1 : 1 + nd] != b""), arr[:, 1 : 1 + nd], b"0")
    try:
        raw_dense = d.astype(np.float64)
    except ValueError:  # e.g. "-" or "1-2": rare, so fall back to a per-field parse of this chunk
        raw_dense = np.array([_float_or_nan(x) for x in d.ravel().tolist()], dtype=np.float64).reshape(m, nd)
    raw_dense[~field_ok] = np.nan
    finite = np.isfinite(raw_dense).all(axis=1)
    with np.errstate(invalid="ignore"):
        integral = (raw_dense == np.floor(raw_dense)).all(axis=1)

    # categorical: at most 8 hex digits. The left-aligned digits are packed into a big-endian
    # uint32 (= the value times 16**(8 - length)) and shifted right by the missing digits.
    cu = u[:, 1 + nd :, :]
    digits = _HEX_VALUE[cu[:, :, :_MAX_HEX_LEN]]  # [m, ns, 8], contiguous
    hex_ok = ((digits.view(np.uint64)[:, :, 0] & _HIGH_BITS) == 0) & (cu[:, :, _MAX_HEX_LEN] == 0)
    hex_ok = hex_ok.all(axis=1)
    digits &= 0x0F
    packed = np.ascontiguousarray((digits[:, :, 0::2] << 4) | digits[:, :, 1::2])
    sparse = packed.view(">u4").reshape(m, ns).astype(np.int64)
    empty = cu[:, :, 0] == 0
    short = ~empty & (cu[:, :, _MAX_HEX_LEN - 1] == 0)  # 1..7 digits: rare in real data
    if short.any():
        length = np.strings.str_len(arr[:, 1 + nd :][short])
        sparse[short] >>= 4 * (_MAX_HEX_LEN - np.minimum(length, _MAX_HEX_LEN))
    sparse[empty] = -1

    ok = label_ok & finite & integral & hex_ok
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
        raw_dense, sparse, is_one = raw_dense[ok], sparse[ok], is_one[ok]
    for line_no, reason in sorted(bad):
        report.record_bad(line_no, reason)
    report.total_rows += m + sum(1 for _, r in bad if r in _LINE_REASONS)
    report.good_rows += int(is_one.shape[0])
    dense = np.log1p(np.maximum(raw_dense, 0.0)).astype(np.float32)
    return dense, sparse, is_one.astype(np.float32)


def _float_or_nan(x: bytes) -> float:
    try:
        return float(x)
    except ValueError:
        return math.nan


def _parse_avazu_chunk(
    lines: list[bytes],
    first_lineno: int,
    num_cols: int,
    label_idx: int,
    cat_idx: list[int],
    report: FileReport,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse Avazu lines; every categorical value is hashed with CRC32 (stable across runs)."""
    getter = operator.itemgetter(*cat_idx)
    crc32 = zlib.crc32
    labels_get = _LABELS.get
    labels_l: list[float] = []
    add_label = labels_l.append
    hashes: list[int] = []
    extend = hashes.extend
    bad: list[tuple[int, str]] = []
    lineno = first_lineno - 1
    for raw in lines:
        lineno += 1
        line = raw.rstrip(b"\r\n")
        if not line or line.isspace():
            report.blank_lines += 1
            continue
        parts = line.split(b",")
        if len(parts) != num_cols:
            bad.append((lineno, REASON_COLUMNS))
            continue
        label = labels_get(parts[label_idx])
        if label is None:
            bad.append((lineno, REASON_LABEL))
            continue
        add_label(label)
        if b",," in line or line[:1] == b"," or line[-1:] == b",":  # some field is empty
            extend([crc32(x) if x else -1 for x in getter(parts)])
        else:
            extend(map(crc32, getter(parts)))
    m = len(labels_l)
    sparse = np.fromiter(hashes, dtype=np.int64, count=len(hashes)).reshape(m, len(cat_idx))
    for line_no, reason in bad:
        report.record_bad(line_no, reason)
    report.total_rows += m + len(bad)
    report.good_rows += m
    return np.zeros((m, 0), np.float32), sparse, np.asarray(labels_l, dtype=np.float32)


def avazu_hash(value: str | bytes) -> int:
    """The id an Avazu categorical value maps to (CRC32 of its UTF-8 bytes; "" -> -1)."""
    b = value.encode("utf-8") if isinstance(value, str) else value
    return zlib.crc32(b) if b else -1


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------


def _existing_manifest(out_dir: Path, key: dict[str, Any], overwrite: bool) -> tuple[dict | None, bool]:
    """``(manifest, False)`` when ``out_dir`` is a complete cache with this exact key (reuse it);
    ``(None, replace)`` when it must be built, ``replace`` saying whether an existing cache goes.

    A complete shard directory with another key (a changed, added or removed input file, other
    parse options, or no key at all) is rebuilt, with one warning line saying why. Anything else
    that is in the way (a file, a non-empty directory that is not a shard cache) is never
    deleted unless ``overwrite``: that is a one-line ``FileExistsError``.
    """
    if overwrite or not (out_dir.exists() or out_dir.is_symlink()):
        return None, overwrite
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory; remove it or choose another cache directory")
    if not any(out_dir.iterdir()):
        return None, False  # an empty directory is replaced by the atomic rename
    try:
        manifest = ShardedDataset.open(out_dir).manifest
    except InvalidShardDirError as e:
        raise FileExistsError(
            f"{out_dir} exists but is not a complete shard directory ({str(e).removeprefix(f'{out_dir}: ')}); "
            "remove it or choose another cache directory"
        ) from None
    why = describe_change(manifest.get("cache_key"), key)
    if why is not None:
        logger.warning("%s: rebuilding the shard cache: %s", out_dir, why)
        return None, True
    logger.info("%s: shard cache is up to date (%d rows); skipping preprocessing", out_dir, manifest["num_rows"])
    return manifest, False


def _no_rows_error(paths: list[Path], reports: list[dict[str, Any]]) -> DataFileError:
    if len(reports) == 1:
        r = reports[0]
        return DataFileError(f"{r['path']}: no valid rows ({r['total_rows']} rows read); nothing was written")
    counts = ", ".join(f"{r['path']}: {r['good_rows']} of {r['total_rows']}" for r in reports)
    return DataFileError(f"no valid rows in {len(paths)} input files ({counts}); nothing was written")


def _finish_file(report: FileReport, max_bad_fraction: float) -> None:
    """Log the per-file summary; abort (nothing is published) past the bad-row limit."""
    if report.bad_fraction > max_bad_fraction:  # the error says it all: no separate summary line
        raise DataFileError(
            f"{report.path}: bad-row fraction {report.bad_fraction:.4f} ({report.bad_rows} of "
            f"{report.total_rows} rows: {report._reasons_text()}) exceeds max_bad_fraction="
            f"{max_bad_fraction}; first bad lines: {report._lines_text()}; nothing was written"
        )
    if report.bad_rows:
        logger.warning(report.summary())
    else:
        logger.info(report.summary())


def _check_common_args(rows_per_shard: int, max_bad_fraction: float, chunk_rows: int) -> None:
    if int(rows_per_shard) < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    if not (0.0 <= float(max_bad_fraction) <= 1.0) or math.isnan(max_bad_fraction):
        raise ValueError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


def _progress(report: FileReport, last: int) -> int:
    if report.total_rows - last >= _PROGRESS_EVERY_ROWS:
        logger.info("%s: %d rows parsed", report.name, report.total_rows)
        return report.total_rows
    return last


def preprocess_criteo(
    paths: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    fmt: Literal["tsv", "csv", "auto"] = "auto",
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    max_bad_fraction: float = 0.01,
    overwrite: bool = False,
    *,
    pad_short_rows: bool = True,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> dict[str, Any]:
    """Parse Criteo files (in order) into one shard directory; returns its manifest.

    ``fmt="auto"`` detects each file (tab -> ``tsv``, comma -> ``csv``). A CSV header, if present,
    may order columns freely. ``pad_short_rows`` accepts rows that lack only trailing
    categorical columns (some copies of the Kaggle file had their trailing empty fields
    stripped) by treating the missing fields as empty; such rows are counted as ``padded_rows``.
    Skips work if ``out_dir`` already holds a complete shard directory with the same cache key
    (:mod:`recsys.data.cache_key`: the same files, unchanged, and the same options); a shard
    directory with another key is rebuilt. No valid rows at all is a one-line ``DataFileError``
    and nothing is written.
    """
    paths = _normalize_paths(paths)
    out_dir = Path(out_dir)
    _check_common_args(rows_per_shard, max_bad_fraction, chunk_rows)
    if fmt not in ("tsv", "csv", "auto"):
        raise ValueError(f"fmt must be 'tsv', 'csv' or 'auto', got {fmt!r}")
    _check_inputs(paths)
    key = make_key(paths, {
        "kind": "criteo", "format": fmt, "pad_short_rows": bool(pad_short_rows), "rows_per_shard": int(rows_per_shard),
        "max_bad_fraction": float(max_bad_fraction), "parser_version": PARSER_VERSION, "format_version": FORMAT_VERSION,
    })
    existing, replace = _existing_manifest(out_dir, key, overwrite)
    if existing is not None:
        return existing
    formats = []
    for p in paths:
        f = detect_format(p, default="tsv") if fmt == "auto" else fmt
        if f not in ("tsv", "csv"):
            raise ValueError(f"{p}: looks like {f} data, not Criteo (use preprocess_avazu)")
        formats.append(f)

    with ShardWriter(
        out_dir,
        kind="criteo",
        dense_names=CRITEO_DENSE_NAMES,
        sparse_names=CRITEO_SPARSE_NAMES,
        rows_per_shard=rows_per_shard,
        overwrite=replace,
    ) as writer:
        reports = []
        for path, f in zip(paths, formats):
            sep = b"\t" if f == "tsv" else b","
            report = FileReport(path=str(path), format=f)
            src = _LineSource(path, sep, CRITEO_COLUMNS, default_layout=CRITEO_COLUMNS)
            last = 0
            for first_lineno, lines in src.chunks(chunk_rows, report):
                # A short row may be padded only if every missing (trailing) column is categorical.
                min_pad = max(src.mapping[: 1 + len(CRITEO_DENSE_NAMES)]) + 1 if pad_short_rows else None
                dense, sparse, labels = _parse_criteo_chunk(
                    lines, first_lineno, sep, src.num_cols, src.mapping, min_pad, report
                )
                writer.append(dense, sparse, labels)
                last = _progress(report, last)
            _finish_file(report, max_bad_fraction)
            reports.append(report.to_dict())
        if writer.num_rows == 0:  # never publish an empty cache: training on it cannot work
            raise _no_rows_error(paths, reports)
        return writer.commit(
            reports, extra={"created_by": "recsys.data.raw_formats.preprocess_criteo", "cache_key": key}
        )


def preprocess_avazu(
    paths: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    max_bad_fraction: float = 0.01,
    overwrite: bool = False,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> dict[str, Any]:
    """Parse Avazu CSV files into one shard directory (no dense features); returns its manifest.

    Label is ``click``; the 22 categorical fields are all columns except ``id`` and ``click``
    (``hour`` stays categorical). Values are hashed with CRC32 of their UTF-8 bytes, so ids are
    stable across processes and runs (unlike ``hash()``); empty values become -1.
    """
    paths = _normalize_paths(paths)
    out_dir = Path(out_dir)
    _check_common_args(rows_per_shard, max_bad_fraction, chunk_rows)
    _check_inputs(paths)
    key = make_key(paths, {
        "kind": "avazu", "rows_per_shard": int(rows_per_shard), "max_bad_fraction": float(max_bad_fraction),
        "parser_version": PARSER_VERSION, "format_version": FORMAT_VERSION,
    })
    existing, replace = _existing_manifest(out_dir, key, overwrite)
    if existing is not None:
        return existing

    with ShardWriter(
        out_dir,
        kind="avazu",
        dense_names=[],
        sparse_names=AVAZU_SPARSE_NAMES,
        rows_per_shard=rows_per_shard,
        overwrite=replace,
    ) as writer:
        reports = []
        for path in paths:
            report = FileReport(path=str(path), format="avazu")
            src = _LineSource(path, b",", ["click", *AVAZU_SPARSE_NAMES], default_layout=AVAZU_COLUMNS)
            last = 0
            for first_lineno, lines in src.chunks(chunk_rows, report):
                dense, sparse, labels = _parse_avazu_chunk(
                    lines, first_lineno, src.num_cols, src.mapping[0], src.mapping[1:], report
                )
                writer.append(dense, sparse, labels)
                last = _progress(report, last)
            _finish_file(report, max_bad_fraction)
            reports.append(report.to_dict())
        if writer.num_rows == 0:
            raise _no_rows_error(paths, reports)
        return writer.commit(
            reports, extra={"created_by": "recsys.data.raw_formats.preprocess_avazu", "cache_key": key}
        )


def preprocess(
    paths: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    kind: Literal["criteo", "avazu", "auto"] = "auto",
    **kwargs: Any,
) -> dict[str, Any]:
    """Dispatch to :func:`preprocess_criteo` or :func:`preprocess_avazu` (``auto``: by the first file)."""
    plist = _normalize_paths(paths)
    if kind == "auto":
        _check_inputs(plist[:1])
        kind = "avazu" if detect_format(plist[0], default="tsv") == "avazu" else "criteo"
    if kind == "criteo":
        return preprocess_criteo(plist, out_dir, **kwargs)
    if kind == "avazu":
        return preprocess_avazu(plist, out_dir, **kwargs)
    raise ValueError(f"kind must be 'criteo', 'avazu' or 'auto', got {kind!r}")
