"""The bad-row report: why rows were skipped, how many, and where (per input file).

Why a module of its own: every stage of preprocessing touches it (blocks are parsed in parallel,
each into its own :class:`BlockReport`; the driver merges them in file order into one
:class:`FileReport` and stops past ``max_bad_fraction``), and the result is stored in the
manifest. Keeping the merge here makes "the same counts, reasons and first line numbers whatever
the number of workers" a property of one small piece of code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recsys.data.errors import DataFileError

__all__ = [
    "REASON_COLUMNS", "REASON_LABEL", "REASON_INTEGER", "REASON_NON_INTEGRAL", "REASON_HEX", "REASON_NUL",
    "LINE_REASONS", "MAX_BAD_LINES_KEPT", "BlockReport", "FileReport", "check_bad_fraction",
]  # fmt: skip

# Reasons a row is skipped (keys of FileReport.bad_by_reason).
REASON_COLUMNS = "wrong column count"
REASON_LABEL = "bad label"
REASON_INTEGER = "non-numeric integer"
REASON_NON_INTEGRAL = "non-integral number"
REASON_HEX = "non-hex id"
REASON_NUL = "NUL byte"
LINE_REASONS = (REASON_COLUMNS, REASON_NUL)  # rows rejected before their fields are looked at

MAX_BAD_LINES_KEPT = 5


@dataclass
class BlockReport:
    """What one parsed block of lines contributes to its file's report.

    ``bad`` holds ``(line, reason)`` for every skipped row of the block, sorted by line.
    """

    total_rows: int = 0
    good_rows: int = 0
    blank_lines: int = 0
    padded_rows: int = 0
    padded_fields: int = 0  # trailing fields the padded rows lacked, in all
    padded_max: int = 0  # the most any one row lacked
    bad: list[tuple[int, str]] = field(default_factory=list)


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
    padded_fields: int = 0
    padded_max: int = 0
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

    def add_block(self, block: BlockReport) -> None:
        """Merge the report of the next block of this file (blocks must come in file order)."""
        for line, reason in block.bad:
            self.record_bad(line, reason)
        self.total_rows += block.total_rows
        self.good_rows += block.good_rows
        self.blank_lines += block.blank_lines
        self.padded_rows += block.padded_rows
        self.padded_fields += block.padded_fields
        self.padded_max = max(self.padded_max, block.padded_max)

    def reasons_text(self) -> str:
        return ", ".join(f"{r}: {n}" for r, n in sorted(self.bad_by_reason.items(), key=lambda kv: -kv[1]))

    def lines_text(self) -> str:
        return ", ".join(str(line) for line, _ in self.first_bad_lines)

    def summary(self) -> str:
        """One log line, e.g. ``x.tsv: skipped 3 of 1000 rows (wrong column count: 2, ...); first bad lines: 17, 45, 99``."""
        s = f"{self.name}: skipped {self.bad_rows} of {self.total_rows} rows"
        if self.bad_rows:
            s += f" ({self.reasons_text()}); first bad lines: {self.lines_text()}"
        if self.padded_rows:
            s += (
                f"; padded {self.padded_rows} short rows whose trailing empty fields were missing "
                f"({self.padded_fields} fields in all, up to {self.padded_max} in a row, read as empty)"
            )
        if self.blank_lines:
            s += f"; ignored {self.blank_lines} blank lines"
        return s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bad_fraction"] = self.bad_fraction
        d["first_bad_lines"] = [{"line": line, "reason": reason} for line, reason in self.first_bad_lines]
        return d


def check_bad_fraction(report: FileReport, max_bad_fraction: float) -> None:
    """One-line ``DataFileError`` naming the file when its bad fraction exceeds the limit."""
    if report.bad_fraction > max_bad_fraction:
        raise DataFileError(
            f"{report.path}: bad-row fraction {report.bad_fraction:.4f} ({report.bad_rows} of "
            f"{report.total_rows} rows: {report.reasons_text()}) exceeds max_bad_fraction="
            f"{max_bad_fraction}; first bad lines: {report.lines_text()}; nothing was written"
        )
