"""Runs the stages in one direction: read blocks -> parse them (in parallel) -> write shards.

Why threads: the Criteo block parser spends its time in numpy, which releases the GIL, so
``workers`` threads parse ``workers`` blocks at once while the calling thread reads the next
blocks and appends finished ones, in file order, to the :class:`~recsys.data.shards.ShardWriter`
(with one worker, reading and writing still overlap the parsing).
Results are therefore identical for any number of workers. At most ``2 * workers`` blocks are in
flight, which bounds memory (a block is a few MiB of text).

The progress line (logger ``recsys.data.raw_formats``, every ``progress_every_s`` seconds) shows
rows, rows/s, the share of the input bytes read and the ETA over all files of the run.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from recsys.data.bad_rows import FileReport, check_bad_fraction
from recsys.data.parse_criteo import ParsedBlock
from recsys.data.read_blocks import Block, BlockReader, Layout
from recsys.data.shards import ShardWriter

__all__ = ["default_workers", "Progress", "run_file"]

logger = logging.getLogger("recsys.data.raw_formats")  # the drivers' logger: one place to listen


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class Progress:
    """Rows/s and ETA over the input files of one preprocessing run."""

    paths: Sequence[Path]
    every_s: float = 10.0
    rows: int = 0
    done_bytes: int = 0
    start: float = field(default_factory=time.monotonic)
    _last: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.total_bytes = sum(max(1, p.stat().st_size) for p in self.paths)

    def line(self, fraction: float) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.rows / elapsed
        eta = elapsed * (1.0 - fraction) / fraction if fraction > 0 else float("nan")
        return f"preprocessing: {self.rows} rows, {rate / 1e3:.0f}K rows/s, {100 * fraction:.0f}% of the input, ETA {eta:.0f} s"

    def update(self, rows: int, size: int, file_fraction: float, force: bool = False) -> None:
        self.rows += rows
        now = time.monotonic()
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
