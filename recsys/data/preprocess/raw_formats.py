"""Preprocessing drivers: raw Criteo / Avazu text files -> one shard directory.

Why this module exists: the raw files are huge (a Criteo 1TB day file has ~200M rows), contain
occasional malformed lines, and come in several layouts (Kaggle/1TB TSV, CSV with a header,
Avazu CSV). Parsing happens once, in bounded memory, and the result is a memory-mapped shard
directory (:mod:`recsys.data.shard_format`) that training reads.

The work goes one way through small modules, one per stage:

1. :mod:`recsys.data.preprocess.read_blocks` reads each file (``.gz`` too) as blocks of whole lines and
   settles its layout (header, column order);
2. :mod:`recsys.data.preprocess.parse_criteo` / :mod:`recsys.data.preprocess.parse_avazu` turn a block into arrays and
   its bad-row report (:mod:`recsys.data.preprocess.bad_rows`), on a pool of threads;
3. :class:`recsys.data.shard_writer.ShardWriter` appends them in file order and publishes atomically;

:mod:`recsys.data.preprocess.pipeline` connects them (with a progress line). This module only checks the
arguments, decides whether the cache is up to date (:mod:`recsys.data.cache_key`), and runs the
files through the pipeline.

Malformed rows are skipped and counted per file (by reason, with the first few physical line
numbers) so data problems are visible in the log and in ``manifest.json``; a file whose bad
fraction exceeds ``max_bad_fraction`` aborts the whole run and nothing is written.

Not ``torchrec.datasets.criteo`` (``BinaryCriteoUtils.tsv_to_npys`` and friends): it has no
per-row validation (a malformed line raises or is silently mis-parsed), no bad-row accounting,
no CSV or Avazu layouts and no atomic output; its npy layout is close to ours, so its loaders
remain an option for already-converted data.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from recsys.data.preprocess.bad_rows import (  # noqa: F401  (re-exported: the names users know)
    MAX_BAD_LINES_KEPT,
    REASON_COLUMNS,
    REASON_HEX,
    REASON_INTEGER,
    REASON_LABEL,
    REASON_NON_INTEGRAL,
    REASON_NUL,
    FileReport,
)
from recsys.data.cache_key import content_sha256, describe_change, make_key
from recsys.data.errors import DataFileError, read_error
from recsys.data.preprocess.parse_avazu import AVAZU_COLUMNS, AVAZU_SPARSE_NAMES, avazu_hash, parse_avazu_block  # noqa: F401
from recsys.data.preprocess.parse_criteo import (  # noqa: F401
    CRITEO_COLUMNS,
    CRITEO_DENSE_NAMES,
    CRITEO_SPARSE_NAMES,
    ParsedBlock,
    parse_criteo_block,
)
from recsys.data.preprocess.pipeline import Progress, default_workers, run_file, run_files_in_processes
from recsys.data.preprocess.read_blocks import DEFAULT_BLOCK_BYTES, Block, BlockReader, Layout, first_line, header_names
from recsys.data.shard_format import FORMAT_VERSION, InvalidShardDirError
from recsys.data.shard_reader import ShardedDataset
from recsys.data.shard_writer import ShardWriter

logger = logging.getLogger(__name__)

DEFAULT_ROWS_PER_SHARD = 1 << 20

# Bump when a parser change alters the shards of unchanged inputs: caches built before rebuild.
PARSER_VERSION = 1


# How an up-to-date-looking cache is checked before reuse: every byte of its inputs hashed again
# ("full"), or size, mtime and the first and last MiB only ("quick"; recsys/data/cache_key.py).
Verify = Literal["full", "quick"]


def detect_format(path: str | Path, default: str | None = None) -> str:
    """Guess the layout of a raw file from its first line: ``"tsv"``, ``"csv"`` or ``"avazu"``.

    ``"tsv"`` is Criteo Kaggle/1TB (tab-separated, no header); ``"csv"`` is Criteo with commas
    (normally a ``label,I1..,C26`` header); ``"avazu"`` is an Avazu CSV (header contains
    ``click``, or 24 columns). An empty file returns ``default`` or raises ``ValueError``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file not found: {p}")
    first = first_line(p)
    if first is None:
        if default is not None:
            return default
        raise ValueError(f"{p}: file is empty, cannot detect its format")
    if b"\t" in first:
        return "tsv"
    if b"," in first:
        names = header_names(first, b",")
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


@contextlib.contextmanager
def cache_lock(out_dir: Path) -> Iterator[None]:
    """One preprocessing per cache directory at a time on this machine: a second run waits for the
    first, then finds its cache up to date, instead of calling the winner's new cache "in the way".

    The lock is an flock on a file named by the hash of the cache's resolved path, in a shared
    directory under the system's temp dir: the cache directory itself is replaced by a rename, so
    it cannot hold a lock, and a lock file beside it would be one more entry in the user's
    directory. The file is opened read-only, so a lock file another user created still locks."""
    where = Path(tempfile.gettempdir()) / "recsys-cache-locks"
    try:
        where.mkdir(mode=0o1777, exist_ok=True)
        if where.stat().st_uid == os.getuid():  # mkdir's mode is cut by the umask
            where.chmod(0o1777)
        name = hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:32]
        fd = os.open(where / f"{name}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:  # no usable temp dir: go on unlocked, as before
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("%s: another process is preprocessing into this cache; waiting for it", out_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _existing_manifest(out_dir: Path, key: dict[str, Any], overwrite: bool, verify: Verify = "full") -> tuple[dict | None, bool]:
    """``(manifest, False)`` when ``out_dir`` is a complete cache with this exact key (reuse it);
    ``(None, replace)`` when it must be built, ``replace`` saying whether an existing cache goes.

    A complete shard directory with another key (a changed, added or removed input file, other
    parse options, or no key at all) is rebuilt, with one warning line saying why; so is one whose
    inputs' content hashes no longer match (``verify="full"``: a change in the middle of a file
    that kept its size and modification time). Anything else
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
    if why is None and verify == "full":
        why, unverified = _content_changes(manifest)
        if unverified:
            logger.warning(
                "%s: %s predate%s whole-file hashes: reused as matched by size, modification time and "
                "first and last MiB only (delete the cache to rebuild it with them)",
                out_dir,
                ", ".join(unverified[:3]) + (f" and {len(unverified) - 3} more" if len(unverified) > 3 else ""),
                "s" if len(unverified) == 1 else "",
            )
    if why is not None:
        logger.warning("%s: rebuilding the shard cache: %s", out_dir, why)
        return None, True
    how = (
        "every byte of the inputs verified"
        if verify == "full"
        else "data.verify=quick: inputs matched by size, modification time and first and last MiB, not every byte"
    )
    logger.info("%s: shard cache is up to date (%d rows; %s); skipping preprocessing", out_dir, manifest["num_rows"], how)
    return manifest, False


def _content_changes(manifest: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(one line naming the first input whose bytes no longer hash as recorded, or None;
    the inputs with no recorded hash)."""
    unverified = []
    for src in manifest.get("sources", []):
        want = src.get("sha256")
        if not want:
            unverified.append(str(src.get("path")))
            continue
        if content_sha256(src["path"]) != want:
            return (f"{src['path']} changed (same size and modification time, other content: its SHA-256 differs)", unverified)
    return None, unverified


def _with_content_hashes(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each file's report with the SHA-256 of all its bytes (the reuse check of ``verify="full"``).
    Taken after parsing, from the page cache: 0.7 s per GB on one core, 3% of the 24 s per GB
    the parse took on two (tools/bench/integrity.py)."""
    return [dict(r, sha256=content_sha256(r["path"])) for r in reports]


def _no_rows_error(paths: list[Path], reports: list[dict[str, Any]]) -> DataFileError:
    if len(reports) == 1:
        r = reports[0]
        return DataFileError(f"{r['path']}: no valid rows ({r['total_rows']} rows read); nothing was written")
    counts = ", ".join(f"{r['path']}: {r['good_rows']} of {r['total_rows']}" for r in reports)
    return DataFileError(f"no valid rows in {len(paths)} input files ({counts}); nothing was written")


# Copies of the Criteo Kaggle file that strip trailing empty fields lose up to 3 of them per row
# (the shared 1k-row sample: 469 rows lack 2, 29 lack 3); a row lacking more is worth a warning.
PADDED_FIELDS_QUIET = 3


def _log_summary(report: FileReport) -> None:
    """A warning when rows were skipped, or padded with more missing fields than stripped copies
    of the Kaggle file have (PADDED_FIELDS_QUIET); else one info line."""
    if report.bad_rows or report.padded_max > PADDED_FIELDS_QUIET:
        logger.warning(report.summary())
    else:
        logger.info(report.summary())


def _check_common_args(rows_per_shard: int, max_bad_fraction: float, block_bytes: int, workers: int | None, verify: str = "full") -> None:
    if verify not in ("full", "quick"):
        raise ValueError(f"verify must be 'full' or 'quick', got {verify!r}")
    if int(rows_per_shard) < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    if not (0.0 <= float(max_bad_fraction) <= 1.0) or math.isnan(max_bad_fraction):
        raise ValueError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    if int(block_bytes) < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    if workers is not None and int(workers) < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")


def _run(
    kind: str,
    jobs: list[tuple[Path, str, BlockReader]],
    parse: Any,
    out_dir: Path,
    key: dict[str, Any],
    rows_per_shard: int,
    max_bad_fraction: float,
    replace: bool,
    workers: int | None,
) -> dict[str, Any]:
    """The files of one run through read -> parse -> write; returns the published manifest."""
    workers = default_workers() if workers is None else int(workers)
    paths = [p for p, _, _ in jobs]
    progress = Progress(paths)
    dense_names = CRITEO_DENSE_NAMES if kind == "criteo" else []
    sparse_names = CRITEO_SPARSE_NAMES if kind == "criteo" else AVAZU_SPARSE_NAMES
    with ShardWriter(
        out_dir,
        kind=kind,
        dense_names=dense_names,
        sparse_names=sparse_names,
        rows_per_shard=rows_per_shard,
        overwrite=replace,
    ) as writer:
        reports = []
        if len(jobs) > 1 and workers > 1:  # many files: one process per file
            for report in run_files_in_processes(jobs, parse, writer, min(workers, len(jobs)), progress, max_bad_fraction):
                _log_summary(report)
                reports.append(report.to_dict())
        else:  # one file (or one worker): blocks on threads
            with ThreadPoolExecutor(workers, thread_name_prefix="parse") as pool:
                for path, fmt, reader in jobs:
                    report = FileReport(path=str(path), format=fmt)
                    run_file(reader, parse, writer, report, pool, workers, progress, max_bad_fraction)
                    _log_summary(report)
                    reports.append(report.to_dict())
        if writer.num_rows == 0:  # never publish an empty cache: training on it cannot work
            raise _no_rows_error(paths, reports)
        if progress.rows >= 1_000_000:
            logger.info(progress.line(1.0))
        return writer.commit(
            _with_content_hashes(reports), extra={"created_by": f"recsys.data.preprocess.raw_formats.preprocess_{kind}", "cache_key": key}
        )


@dataclass(frozen=True)
class _CriteoParse:
    """The Criteo block parser with its padding option (a class, so worker processes can get it)."""

    pad_short_rows: bool

    def __call__(self, block: Block, layout: Layout) -> ParsedBlock:
        # A short row may be padded only if every missing (trailing) column is categorical.
        min_pad = max(layout.mapping[: 1 + len(CRITEO_DENSE_NAMES)]) + 1 if self.pad_short_rows else None
        return parse_criteo_block(block, layout, min_pad)


def criteo_key(
    paths: Sequence[Path],
    fmt: str = "auto",
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    max_bad_fraction: float = 0.01,
    pad_short_rows: bool = True,
) -> dict[str, Any]:
    """The cache key :func:`preprocess_criteo` writes for these files and options (also the key
    of a dataset joined from parts, recsys/data/preprocess/fanout.py)."""
    return make_key(
        paths,
        {
            "kind": "criteo",
            "format": fmt,
            "pad_short_rows": bool(pad_short_rows),
            "rows_per_shard": int(rows_per_shard),
            "max_bad_fraction": float(max_bad_fraction),
            "parser_version": PARSER_VERSION,
            "format_version": FORMAT_VERSION,
        },
    )


def avazu_key(paths: Sequence[Path], rows_per_shard: int = DEFAULT_ROWS_PER_SHARD, max_bad_fraction: float = 0.01) -> dict[str, Any]:
    """The cache key :func:`preprocess_avazu` writes for these files and options."""
    return make_key(
        paths,
        {
            "kind": "avazu",
            "rows_per_shard": int(rows_per_shard),
            "max_bad_fraction": float(max_bad_fraction),
            "parser_version": PARSER_VERSION,
            "format_version": FORMAT_VERSION,
        },
    )


def preprocess_criteo(
    paths: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    fmt: Literal["tsv", "csv", "auto"] = "auto",
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    max_bad_fraction: float = 0.01,
    overwrite: bool = False,
    *,
    pad_short_rows: bool = True,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    workers: int | None = None,
    verify: Verify = "full",
) -> dict[str, Any]:
    """Parse Criteo files (in order) into one shard directory; returns its manifest.

    ``fmt="auto"`` detects each file (tab -> ``tsv``, comma -> ``csv``). A CSV header, if present,
    may order columns freely. ``pad_short_rows`` accepts rows that lack only trailing
    categorical columns (some copies of the Kaggle file had their trailing empty fields
    stripped) by treating the missing fields as empty; such rows are counted as ``padded_rows``.
    Skips work if ``out_dir`` already holds a complete shard directory with the same cache key
    (:mod:`recsys.data.cache_key`: the same files, unchanged, and the same options); a shard
    directory with another key is rebuilt. No valid rows at all is a one-line ``DataFileError``
    and nothing is written. ``workers`` (default: one per core) threads parse blocks of
    ``block_bytes`` of one file; with several files, ``workers`` processes take one file each.
    Neither changes the result. ``verify``: how a cache whose key matches is checked before it is
    reused (``"full"``: every byte of the inputs against the hashes recorded at build time).
    """
    paths = _normalize_paths(paths)
    out_dir = Path(out_dir)
    _check_common_args(rows_per_shard, max_bad_fraction, block_bytes, workers, verify)
    if fmt not in ("tsv", "csv", "auto"):
        raise ValueError(f"fmt must be 'tsv', 'csv' or 'auto', got {fmt!r}")
    _check_inputs(paths)
    key = criteo_key(paths, fmt, rows_per_shard, max_bad_fraction, pad_short_rows)
    with cache_lock(out_dir):
        existing, replace = _existing_manifest(out_dir, key, overwrite, verify)
        if existing is not None:
            return existing
        jobs = []
        for p in paths:
            f = detect_format(p, default="tsv") if fmt == "auto" else fmt
            if f not in ("tsv", "csv"):
                raise ValueError(f"{p}: looks like {f} data, not Criteo (use preprocess_avazu)")
            sep = b"\t" if f == "tsv" else b","
            jobs.append((p, f, BlockReader(p, sep, CRITEO_COLUMNS, CRITEO_COLUMNS, block_bytes)))
        return _run("criteo", jobs, _CriteoParse(bool(pad_short_rows)), out_dir, key, rows_per_shard, max_bad_fraction, replace, workers)


def preprocess_avazu(
    paths: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    max_bad_fraction: float = 0.01,
    overwrite: bool = False,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    workers: int | None = None,
    verify: Verify = "full",
) -> dict[str, Any]:
    """Parse Avazu CSV files into one shard directory (no dense features); returns its manifest.

    Label is ``click``; the 22 categorical fields are all columns except ``id`` and ``click``
    (``hour`` stays categorical). Values are hashed with CRC32 of their UTF-8 bytes, so ids are
    stable across processes and runs (unlike ``hash()``); empty values become -1.
    """
    paths = _normalize_paths(paths)
    out_dir = Path(out_dir)
    _check_common_args(rows_per_shard, max_bad_fraction, block_bytes, workers, verify)
    _check_inputs(paths)
    key = avazu_key(paths, rows_per_shard, max_bad_fraction)
    with cache_lock(out_dir):
        existing, replace = _existing_manifest(out_dir, key, overwrite, verify)
        if existing is not None:
            return existing
        jobs = [(p, "avazu", BlockReader(p, b",", ["click", *AVAZU_SPARSE_NAMES], AVAZU_COLUMNS, block_bytes)) for p in paths]
        return _run("avazu", jobs, parse_avazu_block, out_dir, key, rows_per_shard, max_bad_fraction, replace, workers)


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
