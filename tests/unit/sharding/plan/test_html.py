"""sharding/plan/html.py: the page of a known 2-table plan holds its figures (bytes per table and
rank, traffic, the modelled times and why the critical rank is slowest), escaped."""

from __future__ import annotations

import re

import numpy as np

from sharding.plan import html as plan_html
from sharding.plan import report as plan_report
from sharding.plan.file_format import plan_from_dict
from sharding.planner.cost.model import PlanCost
from sharding.planner.cost.traffic import Traffic

ADAM = {"kind": "adam", "bytes_per_weight": 8, "bytes_per_row": 0}
ROWWISE = {"kind": "rowwise_adagrad", "bytes_per_weight": 0, "bytes_per_row": 4}


def _tw(rank: int, rows: int, cols: int, kernel: str = "fused", load_factor: float | None = None) -> dict:
    return {
        "sharding_type": "table_wise",
        "compute_kernel": kernel,
        "ranks": [rank],
        "shards": [{"offsets": [0, 0], "sizes": [rows, cols], "placement": f"rank:{rank}/cuda:{rank}"}],
        "cache_params": None if load_factor is None else {"load_factor": load_factor},
    }


def _report(params: dict, tables: dict, meta: dict | None = None) -> dict:
    d = {
        "format": "recsys-sharding-plan",
        "version": 2,
        "world_size": 2,
        "compute_device": "cuda",
        "tables": tables,
        "modules": {"m": {"type": "EmbeddingModuleShardingPlan", "params": params}},
        "meta": meta or {},
    }
    return plan_report.report(*plan_from_dict(d))


def _two_tables() -> dict:
    """'big': 65536 x 16, Adam, HBM of rank 0 (12 MiB); 'cached': 32768 x 32, row-wise Adagrad, host
    memory of rank 1 (4 MiB + 128 KiB) with half its weights cached in HBM (2 MiB)."""
    t = {"num_embeddings": 65536, "embedding_dim": 16, "data_type": "FP32", "optimizer_state": ADAM}
    c = {"num_embeddings": 32768, "embedding_dim": 32, "data_type": "FP32", "optimizer_state": ROWWISE}
    meta = {"batch_size_per_rank": 512, "planner": "topology", "note": "", "score": 0.0}
    return _report({"big": _tw(0, 65536, 16), "cached": _tw(1, 32768, 32, "fused_uvm_caching", 0.5)}, {"big": t, "cached": c}, meta)


def _traffic(hosts: list[dict] | None = None) -> Traffic:
    """Rank 0 sends 36,864 B forward and 8,192 B backward to rank 1, which sends 12,288 B back."""
    return Traffic(
        world_size=2,
        batch_size_per_rank=512,
        fwd=np.array([[0.0, 36864.0], [12288.0, 0.0]]),
        bwd=np.array([[0.0, 8192.0], [0.0, 0.0]]),
        lookups=np.array([1024.0, 2048.0]),
        compute_bytes=np.zeros(2),
        uvm_bytes=np.zeros(2),
        hosts=hosts or [],
    )


def _cost(rank_time=(0.001, 0.003), ssd_io=None) -> PlanCost:
    return PlanCost(
        step_time=0.004,
        rank_time=np.array(rank_time),
        lookup=np.array([0.0005, 0.001]),
        host_io=np.array([0.0, 0.0015]),
        comm=np.array([0.0005, 0.0005]),
        hbm_bytes=np.zeros(2),
        host_bytes=np.zeros(2),
        comm_time=0.0006,
        phases={"fwd_a2a": ("gpu0->gpu1 nvlink", 0.0004)},
        ssd_io=None if ssd_io is None else np.array(ssd_io),
    )


def _rows(table_html: str) -> list[list[str]]:
    return [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", table_html) if "<td" in tr]


def _section(page: str, title: str) -> str:
    return page.split(f"<h2>{title}</h2>", 1)[1].split("<h2>", 1)[0]


def test_page_without_a_cost_holds_the_plans_figures():
    page = plan_html.render_html(_two_tables(), _traffic())
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</body></html>\n")
    assert "<title>sharding plan: 2 ranks</title>" in page and "<h1>Sharding plan report: 2 tables on 2 ranks</h1>" in page
    assert "<b>2</b> tables on <b>2</b> ranks, compute device <b>cuda</b>; batch 512 per rank, pooling factor 1." in page
    assert "plan: batch_size_per_rank=512, planner=topology<br>" in page  # empty values left out
    # rank 0 sends 36,864 + 8,192 B = 44 KiB per step
    assert "no topology given (use --topology): no modeled times; rank 0 sends the most, 44.0 KB per step." in page
    assert _rows(_section(page, "Tables")) == [
        ["big", "m", "table_wise", "fused", "0", "r0:65536x16", "", "12.0 MB", "0.0 MB"],
        ["cached", "m", "table_wise", "fused_uvm_caching", "1", "r1:32768x32", "0.50", "2.0 MB", "4.1 MB"],
    ]
    assert _rows(_section(page, "Ranks")) == [
        ["0", "1", "12.0 MB", "0.0 MB", "44.0 KB", "12.0 KB", "1,024"],
        ["1", "1", "2.0 MB", "4.1 MB", "12.0 KB", "44.0 KB", "2,048"],
    ]
    assert "Busiest directed link" not in page and "<h2>Hosts</h2>" not in page and "SSD" not in page
    assert page.count('class="hm-cell"') == 4 and 'id="memory-chart"' in page and "topology-diagram" not in page


def test_page_with_a_cost_names_the_critical_rank_and_its_split():
    page = plan_html.render_html(_two_tables(), _traffic(), cost=_cost())
    assert '<span class="step">modeled step 4.0000 ms (slowest rank 1: 3.0000 ms; collectives 0.6000 ms)</span>, batch 512 per rank' in page
    assert (
        '<span class="crit">critical rank: rank 1: 3.0000 ms = lookup 1.0000 ms (33%) + host io 1.5000 ms (50%) + collectives '
        "0.5000 ms (17%); mostly host io (its collectives: each phase&#x27;s busiest link among the rank&#x27;s own, plus latency)</span>"
    ) in page
    ranks = _section(page, "Ranks")
    assert '<th class="">lookup ms</th>' in ranks and "ssd io ms" not in ranks
    assert _rows(ranks)[1][-4:] == ["1.0000", "1.5000", "0.5000", "3.0000"]
    assert '<tr class="critical"><td class="l">1</td>' in ranks and '<tr><td class="l">0</td>' in ranks
    links = _section(page, "Busiest directed link per collective phase")
    assert "The collectives' 0.6000 ms in the step: the sum of these plus 0.2000 ms latency" in links
    assert _rows(links) == [["fwd_a2a", "gpu0-&gt;gpu1 nvlink", "0.4000"]]


def test_critical_why_without_shares_when_a_rank_cannot_run():
    """A key_value shard on a host without SSD costs inf: the split is shown without percentages."""
    cost = _cost(rank_time=(0.001, np.inf), ssd_io=[0.0, np.inf])
    assert plan_html.critical_why(cost, ssd=True) == (
        "rank 1: inf ms = lookup 1.0000 ms + host io 1.5000 ms + ssd io inf ms + collectives 0.5000 ms; mostly ssd io "
        "(its collectives: each phase's busiest link among the rank's own, plus latency)"
    )


def test_phase_table_without_collectives():
    cost = _cost()
    cost.phases = {}
    assert plan_html.phase_table(cost) == '<p class="note">no collectives: every table is local to its rank.</p>'


def test_ssd_tables_get_a_column_and_a_note():
    kv = {"num_embeddings": 1000, "embedding_dim": 16, "data_type": "FP32", "optimizer_state": ADAM}
    rep = _report({"kv": _tw(1, 1000, 16, "key_value")}, {"kv": kv})
    # weights 64,000 B + Adam 128,000 B on rank 1's SSD
    assert plan_html.ssd_note(rep) == (
        "largest SSD use: rank 1 with 0.2 MB (0.2 MB on all ranks; key_value tables: FBGEMM's SSD kernels, rows and "
        "optimizer state on the host's SSD, not in the chart above)"
    )
    page = plan_html.render_html(rep, _traffic())
    assert '<p class="note" id="ssd-note">largest SSD use: rank 1 with 0.2 MB' in page
    assert _rows(_section(page, "Tables"))[0][-1] == "0.2 MB" and _rows(_section(page, "Ranks"))[1][4] == "0.2 MB"


def test_hosts_table_shows_use_against_capacity_and_switch_loads():
    host = {
        "host": 0,
        "name": "h<0>",
        "ranks": [0, 1],
        "hbm_bytes": 14 * 2**20,
        "hbm_capacity": 80 * 2**30,
        "host_bytes": 3 * 2**20,
        "host_capacity": 512 * 2**30,
        "pcie_switches": [{"switch": "sw0", "bytes_per_step": 2048}, {"switch": "sw1", "bytes_per_step": 0}],
    }
    page = plan_html.render_html(_two_tables(), _traffic([host]))
    assert _rows(_section(page, "Hosts")) == [
        ["0", "h&lt;0&gt;", "0,1", "14.0 MB / 80.00 GB", "3.0 MB / 512.00 GB", "sw0: 2.0 KB, sw1: 0 B"],
    ]
