"""The curves picture of a run: metrics.jsonl read back, three panels written atomically as a PNG
of the size asked for, undefined values drawn as gaps."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from recsys.training.plots import _num, load_metrics, plot_run  # noqa: E402


def _write(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")


RECORDS = [
    {"kind": "train", "step": 10, "loss": 0.7, "samples_per_s": 1000.0},
    {"kind": "eval", "step": 10, "auc": None, "logloss": 0.69, "oracle_auc": 0.8},
    {"kind": "train", "step": 20, "loss": None, "samples_per_s": 1100.0},
    {"kind": "eval", "step": 20, "auc": 0.71, "logloss": 0.6, "oracle_auc": 0.8},
]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_load_metrics_reads_every_record_and_skips_blank_lines(tmp_path):
    _write(tmp_path, RECORDS)
    assert load_metrics(tmp_path) == RECORDS


def test_plot_run_writes_a_15_by_4_inch_png_at_90_dpi(tmp_path):
    run = tmp_path / "smoke"
    _write(run, RECORDS)
    out = plot_run(run)
    assert out == run / "curves.png"
    assert _png_size(out) == (15 * 90, 4 * 90)
    assert sorted(p.name for p in run.iterdir()) == ["curves.png", "metrics.jsonl"]  # no temp file left
    other = plot_run(run, tmp_path / "elsewhere.png")
    assert other == tmp_path / "elsewhere.png" and _png_size(other) == (1350, 360)


def test_undefined_values_are_gaps():
    assert math.isnan(_num(None)) and _num(0.5) == 0.5
