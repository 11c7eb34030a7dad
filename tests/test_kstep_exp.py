"""tools/exp_kstep.py --quick on a reduced grid: the script runs end to end (two torchrun
launches per run, 2 hosts x 2 ranks), writes results.json and the plot, and ends stdout with
one JSON object. Slow (~40 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_exp_kstep_quick(tmp_path):
    out = tmp_path / "exp"
    r = subprocess.run(
        [sys.executable, "tools/exp_kstep.py", "--quick", "--ks", "1,16", "--moments", "off", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    head = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(head["auc"]) == {"k1", "k16"}
    assert 0.6 < head["auc"]["k1"]["no_moments"] <= head["oracle_auc"] + 0.01
    # every merge moves the same payload: k=1 sends exactly 16x the bytes of k=16
    assert head["bytes_ratio_k1_k16"]["no_moments"] == pytest.approx(16.0)
    assert isinstance(head["target_met"]["no_moments"], bool)
    assert "run 2/2" in r.stderr and " step " in r.stderr  # progress lines
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [x["k"] for x in rows] == [1, 16] and all(x["replica_divergence"] == 0.0 for x in rows)
    assert (out / "kstep_auc.png").stat().st_size > 10_000
