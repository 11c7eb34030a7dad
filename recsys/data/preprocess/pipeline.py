"""Runs the stages in one direction: read blocks -> parse them (in parallel) -> write shards.

Why threads: the Criteo block parser spends its time in numpy, which releases the GIL, so
``workers`` threads parse ``workers`` blocks at once while the calling thread reads the next
blocks and appends finished ones, in file order, to the :class:`~recsys.data.shard_writer.ShardWriter`
(with one worker, reading and writing still overlap the parsing).
Results are therefore identical for any number of workers. At most ``2 * workers`` blocks are in
flight, which bounds memory (a block is a few MiB of text).

The progress line (logger ``recsys.data.preprocess.raw_formats``, every ``progress_every_s`` seconds) shows
rows, rows/s, the share of the input bytes read and the ETA over all files of the run.

Why processes as well: with many files, :func:`run_files_in_processes` gives each file a process
of its own (the Avazu parser is Python per line, which threads cannot run in parallel), each
writing its own part directory that the calling process then appends in file order.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from recsys.data.preprocess.bad_rows import FileReport, check_bad_fraction
from recsys.data.errors import CacheWriteError
from recsys.data.preprocess.parse_criteo import ParsedBlock
from recsys.data.preprocess.read_blocks import Block, BlockReader, Layout
from recsys.data.shard_reader import ShardedDataset
from recsys.data.shard_writer import ShardWriter

__all__ = ["default_workers", "Progress", "run_file", "run_files_in_processes"]

logger = logging.getLogger("recsys.data.preprocess.raw_formats")  # the drivers' logger: one place to listen
_APPEND_ROWS = 1 << 18  # rows of a part copied at a time (about 70 MB of Criteo arrays)


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class Progress:
    """Rows/s and ETA over the input files of one preprocessing run. ``clock`` is injectable so
    tests can check the figures without depending on how fast the machine is."""

    paths: Sequence[Path]
    every_s: float = 10.0
    rows: int = 0
    done_bytes: int = 0
    clock: Callable[[], float] = time.monotonic
    start: float = field(init=False)
    _last: float = field(init=False)

    def __post_init__(self) -> None:
        self.total_bytes = sum(max(1, p.stat().st_size) for p in self.paths)
        self.start = self._last = self.clock()

    def line(self, fraction: float) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.rows / elapsed
        eta = elapsed * (1.0 - fraction) / fraction if fraction > 0 else float("nan")
        return f"preprocessing: {self.rows} rows, {rate / 1e3:.0f}K rows/s, {100 * fraction:.0f}% of the input, ETA {eta:.0f} s"

    def update(self, rows: int, size: int, file_fraction: float, force: bool = False) -> None:
        self.rows += rows
        now = self.clock()
        if force or now - self._last >= self.every_s:
            self._last = now
            logger.info(self.line((self.done_bytes + file_fraction * size) / self.total_bytes))

    def file_done(self, size: int) -> None:
        self.done_bytes += size


def run_file(
    reader: BlockReader,
    parse: Callable[[Block, Layout], ParsedBlock],
    writer: ShardWriter,
    report: FileReport,
    pool: ThreadPoolExecutor | None,
    workers: int,
    progress: Progress,
    max_bad_fraction: float,
) -> None:
    """Parse one file into ``writer`` and ``report``; raises past ``max_bad_fraction``."""
    size = max(1, reader.path.stat().st_size)
    pending: deque[Future[ParsedBlock] | ParsedBlock] = deque()

    def drain(keep: int) -> None:
        while len(pending) > keep:
            item = pending.popleft()
            parsed = item.result() if isinstance(item, Future) else item
            writer.append(parsed.dense, parsed.sparse, parsed.labels)
            report.add_block(parsed.report)
            progress.update(parsed.report.total_rows, size, reader.progress)

    for block in reader.blocks():
        layout = reader.layout  # known once the first block has been read
        pending.append(pool.submit(parse, block, layout) if pool is not None else parse(block, layout))
        drain(2 * workers)
    drain(0)
    report.header = reader.layout.header
    progress.file_done(size)
    check_bad_fraction(report, max_bad_fraction)


def _file_to_part(
    reader: BlockReader,
    parse: Callable[[Block, Layout], ParsedBlock],
    part_dir: Path,
    writer_args: dict,
    fmt: str,
    max_bad_fraction: float,
) -> FileReport:
    """In a worker process: one file, parsed on this process's thread, into its own shard directory."""
    report = FileReport(path=str(reader.path), format=fmt)
    with ShardWriter(part_dir, **writer_args) as part:
        run_file(reader, parse, part, report, None, 1, Progress([reader.path], every_s=float("inf")), max_bad_fraction)
        if part.num_rows:
            part.commit()
    return report


def run_files_in_processes(
    jobs: Sequence[tuple[Path, str, BlockReader]],
    parse: Callable[[Block, Layout], ParsedBlock],
    writer: ShardWriter,
    processes: int,
    progress: Progress,
    max_bad_fraction: float,
) -> Iterator[FileReport]:
    """Many files: one process per file (``processes`` at a time, forked), each into a part directory
    inside ``writer``'s temp directory; the parts are appended to ``writer`` in file order and
    deleted, so the shards are those of a run on threads. ``parse`` must be picklable.

    Yields each file's report in order; the first file past ``max_bad_fraction`` (in file order,
    as in a sequential run) raises, and files not started yet are cancelled.
    """
    parts = writer.tmp / "parts"
    parts.mkdir()
    writer_args = {"kind": writer.kind, "dense_names": writer.dense_names, "sparse_names": writer.sparse_names, "rows_per_shard": 1 << 20}
    # fork: the children need nothing but numpy and this package, and (unlike spawn) it does not
    # re-import the caller's __main__, which breaks scripts without an `if __name__ == "__main__"`.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context(method)) as pool:
        futures = [
            pool.submit(_file_to_part, reader, parse, parts / f"{i:05d}", writer_args, fmt, max_bad_fraction)
            for i, (_, fmt, reader) in enumerate(jobs)
        ]
        try:
            for i, fut in enumerate(futures):
                part = parts / f"{i:05d}"
                try:
                    report = fut.result()
                except CacheWriteError as e:  # say which cache failed, not which part of it
                    err = CacheWriteError(str(e).replace(str(part.absolute()), str(writer.dest), 1))
                    err.errno = e.errno
                    raise err from None
                if part.is_dir():
                    ds = ShardedDataset.open(part)
                    for start in range(0, ds.num_rows, _APPEND_ROWS):
                        writer.append(*ds.read(start, min(ds.num_rows, start + _APPEND_ROWS)))
                    del ds
                    shutil.rmtree(part)
                size = max(1, jobs[i][0].stat().st_size)
                progress.update(report.total_rows, size, 1.0)
                progress.file_done(size)
                yield report
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    parts.rmdir()
