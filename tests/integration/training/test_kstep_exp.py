"""tools/experiments/kstep.py --quick on a reduced grid: the script runs end to end (two torchrun
launches per run, 2 hosts x 2 ranks), writes results.json and the plot, and ends stdout with
one JSON object. Slow (~40 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.processes import run_main_and_children

REPO = Path(__file__).resolve().parents[3]


def test_exp_kstep_quick(tmp_path):
    out, results = tmp_path / "exp", tmp_path / "net.json"
    # the script's main in this process (its torchrun agents and workers are real processes);
    # tests/integration/cowclip/test_cowclip_training.py starts the real script
    r = run_main_and_children(
        "tools.experiments.kstep",
        "--quick",
        "--ks",
        "1,16",
        "--moments",
        "off",
        "--rows",
        "all",
        "--out",
        str(out),
        "--sync",
        "--eval-every",
        "16",
        "--results",
        str(results),
        "--network-plot",
        str(tmp_path / "net.png"),
        "--dmpcollection",
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    head = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(head["auc"]) == {"k1", "k16"}
    assert 0.6 < head["auc"]["k1"]["no_moments"] <= head["oracle_auc"] + 0.01
    # every merge moves the same payload: k=1 sends exactly 16x the bytes of k=16
    assert head["bytes_ratio_k1_k16"]["no_moments"] == pytest.approx(16.0)
    assert isinstance(head["target_met"]["no_moments"], bool)
    assert "run 3/3" in r.stderr and " step " in r.stderr  # progress lines (sync, k=1, k=16)
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [x["k"] for x in rows] == [0, 1, 16]
    sync, k1, k16 = rows
    assert sync["arm"] == "sync" and sync["merges"] == 0 and "replica_divergence" not in sync
    assert all(x["replica_divergence"] == 0.0 for x in (k1, k16))
    # the synchronous model: the plan's all-to-all and DDP's dense all-reduce, per step, all steps
    assert sync["cross_host_bytes_total"] == pytest.approx(
        (sync["cross_host_bytes_per_step_embeddings"] + sync["cross_host_bytes_per_step_dense"]) * sync["steps"]
    )
    assert sync["cross_host_bytes_per_step_embeddings"] > 0 and sync["cross_host_bytes_per_step_dense"] > 0
    # an eval every 16 of 64 steps, on a time axis without evals that grows with the steps
    for x in rows:
        assert [p["step"] for p in x["eval_curve"]] == [16, 32, 48, 64]
        ts = [p["train_s"] for p in x["eval_curve"]]
        assert ts == sorted(ts) and ts[-1] == pytest.approx(x["train_s"], rel=0.05)
        assert x["epoch_s"] == pytest.approx(x["train_s"])  # one epoch
    assert (out / "kstep_auc.png").stat().st_size > 10_000
    doc = json.loads(results.read_text())
    e = doc["summary"]["loopback"]
    assert e["sync"]["auc"] == sync["auc"] and set(e["k"]) == {"1", "16"}
    assert e["k"]["16"]["speedup_vs_k1"] == pytest.approx(k1["epoch_s"] / k16["epoch_s"])
    assert e["k"]["16"]["speedup_vs_sync"] == pytest.approx(sync["epoch_s"] / k16["epoch_s"])
    first = next((p["train_s"] for p in k16["eval_curve"] if p["auc"] >= sync["auc"]), None)
    assert e["k"]["16"]["time_to_sync_auc_s"] == first
    assert doc["dmpcollection"]["arm"] == "dmpcollection" and isinstance(doc["dmpcollection"]["constructs"], bool)
    if not doc["dmpcollection"]["constructs"]:  # torchrec 1.8 on CPU: its constructor asserts CUDA
        assert "CUDA" in doc["dmpcollection"]["error"]
    assert (tmp_path / "net.png").stat().st_size > 10_000
    assert "| loopback | sync DMP | 64 |" in r.stdout  # the per-link table


def _row(net: str, k: int, epoch_s: float, auc: float, curve: list[tuple[float, float]], arm: str = "kstep") -> dict:
    return {
        "net": net,
        "arm": arm,
        "k": k,
        "moments": False,
        "merge_route": None if arm == "sync" else "hierarchical",
        "epoch_s": epoch_s,
        "auc": auc,
        "steps": 512,
        "samples": 512 * 4096,
        "cross_host_bytes_per_sample": 1.0,
        "eval_curve": [{"step": 64 * (i + 1), "train_s": t, "auc": a} for i, (t, a) in enumerate(curve)],
    }


def test_network_summary_crossovers_and_results_merge(tmp_path):
    import tools.experiments.kstep as E

    net = "rate=1gbit,delay=0"
    rows = [
        _row(net, 0, 60.0, 0.795, [(30, 0.79), (60, 0.795)], arm="sync"),
        _row(net, 1, 400.0, 0.796, [(200, 0.794), (400, 0.796)]),
        _row(net, 16, 75.0, 0.7956, [(37, 0.7945), (75, 0.7956)]),
        _row(net, 64, 58.0, 0.7956, [(29, 0.7952), (58, 0.7956)]),
    ]
    s = E.network_summary(rows)[net]
    assert s["k_beats_sync"] == 64  # 58 < 60; 75 is not
    assert s["k_stops_paying"] == 64  # 75 is 29% above the fastest (58): k=16 still leaves time on the table
    assert s["k"]["16"]["time_to_sync_auc_s"] == 75 and s["k"]["16"]["time_to_sync_auc_tol_s"] == 37
    assert s["k"]["64"]["time_to_sync_auc_s"] == 29
    assert s["k"]["1"]["time_to_sync_auc_s"] == 400 and s["k"]["16"]["speedup_vs_k1"] == pytest.approx(400 / 75)
    rows[3]["epoch_s"] = 70.0  # now k=16 is within 10% of the fastest: merges stop paying at 16
    assert E.network_summary(rows)[net]["k_stops_paying"] == 16
    # touched-row arms: their own keys and crossovers, next to the whole-shard ones
    touched = dict(
        rows[2], merge_rows="touched", epoch_s=40.0, rows_merged_last=10, rows_tracked=1000, cross_host_bytes_total=1.0, samples_per_s=1.0
    )
    s = E.network_summary([*rows, touched])[net]
    assert s["k"]["16-touched"]["speedup_vs_sync"] == pytest.approx(60 / 40) and s["k_beats_sync_touched"] == 16
    assert s["k"]["16-touched"]["rows_merged_share"] == 0.01 and s["k"]["16"]["epoch_s"] == 75.0
    assert s["k_beats_sync"] is None and "| k=16, touched rows |" in E.network_table({"rows": [touched], "summary": {net: s}})
    # merging invocations: same (link, arm, k, moments, route) replaces, others add
    path = tmp_path / "r.json"
    E.merge_results(path, rows[:2], {"n": 1}, None)
    E.merge_results(path, [dict(rows[1], epoch_s=390.0), _row("rate=100mbit,delay=0", 1, 3000.0, 0.79, [])], {"n": 2}, None)
    doc = json.loads(path.read_text())
    assert [(r["net"], r["k"]) for r in doc["rows"]] == [("rate=100mbit,delay=0", 1), (net, 0), (net, 1)]
    assert doc["rows"][2]["epoch_s"] == 390.0 and [m["n"] for m in doc["runs"]] == [1, 2]
    assert list(doc["summary"]) == ["rate=100mbit,delay=0", net]  # slowest link first
