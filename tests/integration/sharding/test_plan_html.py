"""`recsys-plan show --format html`: a self-contained report and the traffic model against a hand
computation (its screenshot in headless Chromium: tests/system/test_plan_html_browser.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import sharding.plan.file_format as plan_format
import sharding.plan.io as plan_io
import sharding.plan.report as plan_report
import sharding.planner.cost.traffic as plan_traffic
from tests.support.cli import run_main

REPO = Path(__file__).resolve().parents[3]
DEMO = str(REPO / "configs" / "experiments" / "demo.yaml")
TOPO = "dgx-a100-2host"  # configs/topologies/dgx-a100-2host.yaml: 2 hosts x 8 GPUs


def tool(*args: str) -> subprocess.CompletedProcess:
    """`recsys-plan ARGS`, run in this process (tests/support/cli.py)."""
    return run_main("recsys.plan_cli", *args, cwd=REPO)


@pytest.fixture(scope="module")
def report16(tmp_path_factory):
    """A 16-rank plan (2 hosts x 8) of the raw Criteo model and its HTML report on 2 DGX A100s."""
    assert (REPO / "configs" / "topologies" / f"{TOPO}.yaml").is_file()
    d = tmp_path_factory.mktemp("html")
    plan, out = d / "plan.json", d / "report.html"
    r = tool(
        "make",
        "--config",
        DEMO,
        "--world-size",
        "16",
        "--local-world-size",
        "8",
        "--hbm-gb",
        "80",
        "--set",
        "data.cardinalities=criteo_kaggle_raw",
        "--out",
        str(plan),
    )
    assert r.returncode == 0, r.stderr
    r = tool("show", str(plan), "--topology", TOPO, "--format", "html", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return plan, out


def test_html_is_self_contained_and_complete(report16):
    plan, out = report16
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "http://" not in text and "https://" not in text and "src=" not in text
    assert "<link" not in text and "<script" not in text and "url(" not in text
    header = plan_io.read_plan_file(plan)[1]
    for name in header["tables"]:
        assert f">{name}<" in text, name
    for chart in ("memory-chart", "traffic-heatmap", "topology-diagram"):
        assert re.search(rf'<svg[^>]*id="{chart}"', text), chart
    assert text.count('class="hm-cell"') == 16 * 16
    assert "critical rank: rank " in text
    # times are the planner's model (tests/integration/sharding/test_plan_html_cost.py checks them to the digit)
    assert re.search(r"modeled step [0-9.]+ ms \(slowest rank \d+: ", text) and "Busiest directed link per collective phase" in text
    assert '<th class="">total ms</th>' in text and '<th class="">compute ms</th>' not in text
    # every rank's GPU box, the wide-model tables too
    for r in range(16):
        assert f"rank {r} · gpu{r % 8}" in text


def test_show_topology_text_json_and_errors(report16, tmp_path):
    import json

    plan, _ = report16
    r = tool("show", str(plan), "--topology", TOPO)
    # one step model: the planner's (its slowest rank), then the bytes by link kind, no second time
    assert r.returncode == 0 and re.search(r"modeled step [0-9.]+ ms \(slowest rank \d+: ", r.stdout)
    assert "traffic by link kind" in r.stdout and "network ms" not in r.stdout and "critical: rank" not in r.stdout
    rep = json.loads(tool("show", str(plan), "--topology", str(REPO / "configs/topologies/dgx-a100-2host.yaml"), "--format", "json").stdout)
    tr = rep["traffic"]
    assert len(tr["ranks"]) == 16 and "critical" not in tr and all("total_s" not in x for x in tr["ranks"])
    # bytes by link kind add up to what each rank sends; the step's times are the planner's
    assert all(sum(x["sent_bytes_by_link"].values()) == x["sent_bytes"] for x in tr["ranks"])
    assert rep["modeled_step"]["step_time_ms"] > 0 and len(rep["modeled_step"]["rank_time_ms"]) == 16
    assert "traffic" not in json.loads(tool("show", str(plan), "--format", "json").stdout)  # unchanged without --topology
    out = tmp_path / "r.html"
    for args, msg in (
        (["--format", "html"], "needs --out"),
        (["--topology", "dgx-a100", "--out", str(out)], "8 ranks"),
        (["--topology", "no-such-topology", "--format", "html", "--out", str(out)], ""),
    ):
        r = tool("show", str(plan), *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, (args, r.stderr)
        assert not out.exists()


def _two_rank_plan(batch: int | None = 512) -> dict:
    def tw(rows: int, cols: int, rank: int) -> dict:
        return {
            "sharding_type": "table_wise",
            "compute_kernel": "fused",
            "ranks": [rank],
            "shards": [{"offsets": [0, 0], "sizes": [rows, cols], "placement": f"rank:{rank}/cpu"}],
            "cache_params": None,
            "enforce_hbm": None,
            "stochastic_rounding": None,
            "bounds_check_mode": None,
            "output_dtype": None,
            "key_value_params": None,
        }

    return {
        "format": plan_format.FORMAT,
        "version": plan_format.VERSION,
        "world_size": 2,
        "compute_device": "cpu",
        "tables": {"a": {"num_embeddings": 1000, "embedding_dim": 16}, "b": {"num_embeddings": 100, "embedding_dim": 4}},
        "modules": {"m": {"type": "EmbeddingModuleShardingPlan", "params": {"a": tw(1000, 16, 0), "b": tw(100, 4, 1)}}},
        "meta": {} if batch is None else {"batch_size_per_rank": batch},
    }


def test_traffic_two_table_wise_tables_by_hand():
    plan, header = plan_format.plan_from_dict(_two_rank_plan())
    tr = plan_traffic.traffic(plan_report.table_infos(plan, header), 2, plan_traffic.batch_size_of(header))
    B = 512
    # forward: a (dim 16, rank 0) sends rank 1's pooled rows, 512 x 16 x 4 B; rank 0 sends its 512
    # ids (8 B) of feature b to b's owner, rank 1. And the other way round for b (dim 4).
    assert tr.fwd.tolist() == [[0, B * 16 * 4 + B * 8], [B * 4 * 4 + B * 8, 0]] == [[0, 36864], [12288, 0]]
    # backward: pooled-output gradients return to the owners; no ids
    assert tr.bwd.tolist() == [[0, B * 4 * 4], [B * 16 * 4, 0]] == [[0, 8192], [32768, 0]]
    assert tr.sent.tolist() == [45056, 45056] and tr.received.tolist() == [45056, 45056]
    # each owner looks up both ranks' ids: 2 x 512
    assert tr.lookups.tolist() == [1024, 1024]
    assert tr.compute_bytes.tolist() == [2 * 1024 * 16 * 4, 2 * 1024 * 4 * 4]
    # default batch when the plan does not say
    plan, header = plan_format.plan_from_dict(_two_rank_plan(None))
    assert plan_traffic.batch_size_of(header) == plan_traffic.DEFAULT_BATCH_SIZE_PER_RANK == 512


def test_traffic_row_wise_and_data_parallel_by_hand():
    d = _two_rank_plan()
    p = d["modules"]["m"]["params"]
    p["a"].update(
        sharding_type="row_wise",
        ranks=[0, 1],
        shards=[
            {"offsets": [0, 0], "sizes": [750, 16], "placement": "rank:0/cpu"},
            {"offsets": [750, 0], "sizes": [250, 16], "placement": "rank:1/cpu"},
        ],
    )
    p["b"].update(sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1], shards=None)
    plan, header = plan_format.plan_from_dict(d)
    tr = plan_traffic.traffic(plan_report.table_infos(plan, header), 2, 512)
    # rw: ids go to the row owner (1/4 of rank 0's ids to rank 1, 3/4 of rank 1's to rank 0),
    # partial sums 512 x 16 x 4 each way; dp: nothing forward
    assert tr.fwd.tolist() == [[0, 512 * 8 * 0.25 + 32768], [512 * 8 * 0.75 + 32768, 0]]
    # backward: partial-sum gradients each way + ring all-reduce of b: 2 (n-1)/n x 100 x 4 x 4 B = 1600
    assert tr.bwd.tolist() == [[0, 32768 + 1600], [32768 + 1600, 0]]


def test_topology_bytes_by_link_on_two_cpu_ranks():
    from sharding.topology.topology_file import load_topology

    topo = load_topology("cpu-gloo")
    assert topo.world_size == 2
    plan, header = plan_format.plan_from_dict(_two_rank_plan())
    infos = plan_report.table_infos(plan, header)
    rep = plan_report.report(plan, header)
    tr = plan_traffic.apply_topology(plan_traffic.traffic(infos, 2, 512), topo, infos, rep["ranks"])
    for r in (0, 1):  # two CPU ranks of one host talk through shared memory only
        assert tr.bytes_by_kind["shm"][r] == tr.sent[r] == 45056
        assert tr.bytes_by_kind["network"][r] == tr.bytes_by_kind["nvlink"][r] == tr.bytes_by_kind["pcie"][r] == 0
    assert not hasattr(tr, "critical") and not hasattr(tr, "total_s")  # times are the planner's alone
    from sharding.plan.html import render_html

    text = render_html(rep, tr, topo)
    assert text.count('class="hm-cell"') == 4 and "&lt;" not in text.split("<body>")[0]
    assert "<svg" in text and "topology-diagram" in text


def test_html_escapes_names():
    d = _two_rank_plan()
    p = d["modules"]["m"]["params"]
    p["<b>&x"] = p.pop("a")
    d["tables"]["<b>&x"] = d["tables"].pop("a")
    plan, header = plan_format.plan_from_dict(d)
    from sharding.plan.html import render_html

    rep = plan_report.report(plan, header)
    tr = plan_traffic.traffic(plan_report.table_infos(plan, header), 2, 512)
    text = render_html(rep, tr)
    assert "<b>&x" not in text and "&lt;b&gt;&amp;x" in text
