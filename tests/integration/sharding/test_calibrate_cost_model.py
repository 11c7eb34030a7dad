"""tools/bench/calibrate_cost_model.py: real gloo ranks, real sharded EBCs; the model against the machine.

Logic only: which plans the tool measures, what the model says about them (checked against an
independent computation), and that its summary statistics are those of its own rows. Whether
the measured times order the plans as the model does depends on the machine and its load: that
is the tool's output (Spearman rank correlation, measured/modeled per plan), recorded in
benchmarks/ (e.g. 2026-11-26-calibration-cpu.md), not a test assertion."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    for r, i in enumerate(order):
        out[i] = float(r)
    return out


def test_one_rank_calibration_rows_and_model():
    """One CPU rank (no communication): 26 dim-16 tables whole, in 2 and in 4 column shards. The
    model charges whole 64-byte cache lines per looked-up row, so 16- and 32-byte shards cost 2x and
    4x the whole table's lookup time (plus one sharding type's fixed collective latency)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/calibrate_cost_model.py"), "--nproc", "1", "--reps", "2", "--max-rows", "20000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    plans = res["plans"]
    assert {"table_wise", "column_wise_2", "column_wise_4"} <= set(plans)
    tw, cw2, cw4 = (plans[k] for k in ("table_wise", "column_wise_2", "column_wise_4"))
    assert tw["types"] == ["table_wise"] and cw4["types"] == ["column_wise"]
    latency = 5 * res["collectives"]["modeled_latency_us"] / 1e3  # one sharding type's collectives
    assert cw2["modeled_ms"] - latency == pytest.approx(2 * (tw["modeled_ms"] - latency), rel=0.05)
    assert cw4["modeled_ms"] - latency == pytest.approx(4 * (tw["modeled_ms"] - latency), rel=0.05)
    rows = {n: p for n, p in plans.items() if "skipped" not in p}
    assert all(math.isfinite(p["measured_ms"]) and p["measured_ms"] > 0 for p in rows.values())
    # the printed table has one row per measured plan, with the ratio of its own numbers
    for n, p in rows.items():
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"{n} "))
        assert float(line.split()[-1]) == pytest.approx(p["measured_ms"] / p["modeled_ms"], rel=0.06, abs=0.06)
    # the summary statistics are those of the rows (computed here independently)
    meas, mod = [p["measured_ms"] for p in rows.values()], [p["modeled_ms"] for p in rows.values()]
    slope, intercept = np.polyfit(mod, meas, 1)
    assert res["fit_slope"] == pytest.approx(slope, rel=1e-6) and res["fit_intercept_ms"] == pytest.approx(intercept, abs=1e-6)
    if len(set(mod)) == len(mod) and len(set(meas)) == len(meas):  # ranks without ties
        assert res["spearman"] == pytest.approx(float(np.corrcoef(_ranks(mod), _ranks(meas))[0, 1]), abs=1e-9)
    assert res["collectives"]["a2a_latency_us"] > 0 and res["nproc"] == 1
