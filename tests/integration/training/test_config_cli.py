"""The launcher refuses a bad config before torchrun starts: exit 2, one line naming the key
(the config's own checks are in tests/unit/recsys/config/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_cli_fails_fast_with_one_line(tmp_path):
    """The launcher refuses before torchrun starts: exit 2, one line naming the key."""
    p = _write(tmp_path, "train:\n  batch_size: 1001\n")
    r = subprocess.run([sys.executable, "-m", "recsys.cli", "train", "--config", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.batch_size" in lines[0] and str(p) in lines[0]
    assert "torch.distributed" not in r.stderr


def test_cli_missing_data_file(tmp_path):
    p = _write(tmp_path, f"data:\n  source: criteo\n  path: {tmp_path}/missing.tsv\n")
    r = subprocess.run([sys.executable, "-m", "recsys.cli", "train", "--config", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "data.path" in r.stderr and "missing.tsv" in r.stderr
