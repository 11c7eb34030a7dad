"""Stage 1 of preprocessing: a raw text file as numbered blocks of whole lines.

Why blocks of bytes instead of lines: handing a parser megabytes at a time lets it split and
decode with numpy over the whole block (:mod:`recsys.data.preprocess.parse_criteo`) and lets blocks be
parsed in parallel; Python never touches individual lines on the fast path.

The reader also settles the file's layout from its first line: a UTF-8 BOM is dropped, and a first
line whose first field is a known column name is a header that fixes the column count and where
each wanted column sits. ``.gz`` inputs are decompressed on the fly. Read failures (truncated or
fake ``.gz``, I/O errors) become a one-line ``DataFileError`` naming the file; errors raised by
the consumer of the blocks pass through untouched.
"""

from __future__ import annotations

import gzip
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from recsys.data.errors import reading

__all__ = ["DEFAULT_BLOCK_BYTES", "Block", "Layout", "open_binary", "first_line", "header_names", "BlockReader"]

DEFAULT_BLOCK_BYTES = 1 << 20
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Layout:
    """How the fields of a file's rows are laid out: separator, column count, wanted columns."""

    sep: bytes
    num_cols: int
    mapping: tuple[int, ...]  # index in a row of each wanted column
    header: bool = False


@dataclass(frozen=True)
class Block:
    """Whole lines ``data`` (the last possibly without its newline) starting at ``first_lineno``."""

    first_lineno: int
    data: bytes


def open_binary(path: Path) -> BinaryIO:
    """Binary reading leaves ``\\r`` for the parsers to strip; ``.gz`` is decompressed."""
    if path.suffix == ".gz":
        return io.BufferedReader(gzip.open(path, "rb"), buffer_size=1 << 20)  # type: ignore[arg-type]
    return open(path, "rb", buffering=1 << 20)


def first_line(path: Path) -> bytes | None:
    """First non-blank line without BOM and line ending, or None for an empty file."""
    with reading(path), open_binary(path) as f:
        for raw in f:
            line = raw.rstrip(b"\r\n")
            if raw.startswith(BOM):
                line = line[len(BOM) :]
            if line.strip():
                return line
    return None


def header_names(line: bytes, sep: bytes) -> list[str]:
    return [x.strip().strip(b"\"'").decode("utf-8", "replace").strip().lower() for x in line.split(sep)]


def column_mapping(path: Path, header: Sequence[str], wanted: Sequence[str]) -> tuple[int, ...]:
    """Indices in ``header`` of each ``wanted`` column (case-insensitive), or ValueError."""
    index: dict[str, int] = {}
    for i, name in enumerate(header):
        index.setdefault(name, i)
    missing = [w for w in wanted if w.lower() not in index]
    if missing:
        raise ValueError(f"{path}: header lacks columns {missing} (header: {','.join(header)[:200]})")
    return tuple(index[w.lower()] for w in wanted)


class BlockReader:
    """Reads ``path`` as :class:`Block` s of about ``block_bytes``, cut after a newline.

    :attr:`layout` is the default layout until :meth:`blocks` has read the first line, then the
    file's own (from its header, if it has one). :attr:`progress` is the fraction of the file
    (compressed bytes for ``.gz``) consumed so far, for the progress line.
    """

    def __init__(
        self,
        path: Path,
        sep: bytes,
        wanted: Sequence[str],
        default_layout: Sequence[str],
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        self.path = path
        self.wanted = list(wanted)
        self.default_layout = [c.lower() for c in default_layout]
        self.block_bytes = int(block_bytes)
        self.layout = Layout(sep, len(self.default_layout), column_mapping(path, self.default_layout, self.wanted))
        self._raw: BinaryIO | None = None
        self._size = 0

    @property
    def progress(self) -> float:
        if self._raw is None or not self._size:
            return 0.0
        try:
            return min(1.0, self._raw.tell() / self._size)
        except (OSError, ValueError):
            return 0.0

    def blocks(self) -> Iterator[Block]:
        sep = self.layout.sep
        with reading(self.path), open_binary(self.path) as f:
            raw = f.raw if isinstance(f, io.BufferedReader) else f
            self._raw = getattr(raw, "fileobj", None) or raw  # the compressed file of a .gz
            self._size = os.fstat(self._raw.fileno()).st_size
            first = f.readline()
            if not first:
                return
            probe = first[len(BOM) :] if first.startswith(BOM) else first
            names = header_names(probe.rstrip(b"\r\n"), sep)
            if probe.strip() and names[0] in self.default_layout:
                self.layout = Layout(sep, len(names), column_mapping(self.path, names, self.wanted), header=True)
                lineno, carry = 2, b""
            else:
                lineno, carry = 1, probe
            while True:
                chunk = f.read(self.block_bytes)
                if not chunk:
                    break
                data = carry + chunk if carry else chunk
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    carry = data
                    continue
                carry = data[cut:]
                yield Block(lineno, data[:cut])
                lineno += data.count(b"\n", 0, cut)
            if carry:
                yield Block(lineno, carry)
