"""tools/calibrate_cost_model.py: real gloo ranks, real sharded EBCs; the model against the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_rank_calibration_orders_column_splits_like_the_machine():
    """One CPU rank (no communication): 26 dim-16 tables whole, in 2 and in 4 column shards. The
    model charges whole 64-byte cache lines per looked-up row, so 16- and 32-byte shards cost 2x and
    4x; the measured steps must order the plans the same way, and the calibrated cpu-gloo topology
    must put the whole-table step within 3x of the measurement."""
    r = subprocess.run([sys.executable, str(ROOT / "tools/calibrate_cost_model.py"), "--nproc", "1", "--reps", "5",
                        "--max-rows", "20000"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    plans = res["plans"]
    tw, cw2, cw4 = (plans[k] for k in ("table_wise", "column_wise_2", "column_wise_4"))
    assert tw["modeled_ms"] < cw2["modeled_ms"] < cw4["modeled_ms"]
    latency = 5 * res["collectives"]["modeled_latency_us"] / 1e3  # one sharding type's collectives
    assert cw4["modeled_ms"] - latency == pytest.approx(4 * (tw["modeled_ms"] - latency), rel=0.05)
    assert tw["measured_ms"] < cw2["measured_ms"] < cw4["measured_ms"]
    assert 1 / 3 < tw["measured_ms"] / tw["modeled_ms"] < 3
    assert res["collectives"]["a2a_latency_us"] > 0 and res["nproc"] == 1
