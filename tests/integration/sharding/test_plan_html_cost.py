"""`recsys-plan show --format html --topology T` shows the planner's modelled step (the same
PlanCost as the text report, sharding/planner/cost/plan_cost.py), the only step time of every
report, and an SSD column for plans with key_value tables (FBGEMM's SSD kernel) only.

The plans are written by hand (no planner run): on dgx-a100-ssd, a 6e9 x 128 key_value table on
rank 3 and a wide fused table on rank 5. Rank 5 sends the most bytes (the widest pooled outputs);
the planner's model charges rank 3 for its SSD misses, so its bottleneck is rank 3, and the
report's critical rank is rank 3.
"""

from __future__ import annotations

import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

import sharding.plan.file_format as plan_format
import sharding.plan.report as plan_report
import sharding.planner.cost.traffic as plan_traffic
from sharding.planner.cost.plan_cost import modeled_step, plan_pooling, plan_tables, step_line
from sharding.plan.html import render_html
from sharding.topology.topology_file import load_topology
from tests.support.cli import run_main

REPO = Path(__file__).resolve().parents[3]
W, B = 8, 512
KV_RANK, WIDE_RANK = 3, 5
KV_ROWS, KV_DIM, KV_LF = 6_000_000_000, 128, 0.01
SSD_BYTES = KV_ROWS * KV_DIM * 4 + KV_ROWS * 4  # fp32 weights + row-wise Adagrad's float per row
ADAGRAD = {"kind": "rowwise_adagrad", "bytes_per_weight": 0, "bytes_per_row": 4}
STEP_RE = r"modeled step [0-9.]+ ms \(slowest rank \d+: [0-9.]+ ms; collectives [0-9.]+ ms\)"


def _tw(rows: int, cols: int, rank: int, kernel: str = "fused", load_factor: float | None = None) -> dict:
    cache = (
        None
        if load_factor is None
        else {
            "algorithm": None,
            "load_factor": load_factor,
            "reserved_memory": None,
            "precision": None,
            "prefetch_pipeline": None,
            "stats": None,
            "multipass_prefetch_config": None,
        }
    )
    return {
        "sharding_type": "table_wise",
        "compute_kernel": kernel,
        "ranks": [rank],
        "shards": [{"offsets": [0, 0], "sizes": [rows, cols], "placement": f"rank:{rank}/cuda:{rank}"}],
        "cache_params": cache,
        "enforce_hbm": None,
        "stochastic_rounding": None,
        "bounds_check_mode": None,
        "output_dtype": None,
        "key_value_params": None,
    }


def plan_dict(ssd: bool = True) -> dict:
    """8 ranks: t_kv (key_value on rank 3, or a small fused table without ``ssd``), t_wide (dim
    512, rank 5), t_small (rank 1)."""
    kv_rows = KV_ROWS if ssd else 100_000
    specs = {"t_kv": (kv_rows, KV_DIM, KV_RANK), "t_wide": (1_000_000, 512, WIDE_RANK), "t_small": (20_000, 16, 1)}
    params = {n: _tw(r, c, k) for n, (r, c, k) in specs.items()}
    if ssd:
        params["t_kv"] = _tw(KV_ROWS, KV_DIM, KV_RANK, "key_value", KV_LF)
    return {
        "format": plan_format.FORMAT,
        "version": plan_format.VERSION,
        "world_size": W,
        "compute_device": "cuda",
        "tables": {
            n: {"num_embeddings": r, "embedding_dim": c, "data_type": "FP32", "optimizer_state": ADAGRAD} for n, (r, c, _) in specs.items()
        },
        "modules": {"": {"type": "EmbeddingModuleShardingPlan", "params": params}},
        "meta": {"batch_size_per_rank": B},
    }


def rendered(d: dict, topology: str):
    """(html, cost, traffic) as `recsys-plan show --format html --topology` makes them; the cost
    computed here with sharding.planner.cost.plan_cost.modeled_step, as the planner logs it."""
    plan, header = plan_format.plan_from_dict(d)
    topo = load_topology(topology)
    rep = plan_report.report(plan, header)
    infos = plan_report.table_infos(plan, header)
    tr = plan_traffic.apply_topology(plan_traffic.traffic(infos, W, B), topo, infos, rep["ranks"])
    cost = modeled_step(plan, plan_tables(header), topo, B, plan_pooling(header))
    return render_html(rep, tr, topo, cost), cost, tr


class _Sections(HTMLParser):
    """Each <table> of the page under the <h2> above it: ``{h2: (headers, rows, row classes)}``
    (text unescaped, as a browser shows it)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, tuple[list[str], list[list[str]], list[str]]] = {}
        self.h2, self.text, self.part, self.cls = "", "", "", ""
        self.row: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in ("h2", "th", "td"):
            self.text = ""
        elif tag == "table":
            self.tables[self.h2] = ([], [], [])
        elif tag in ("thead", "tbody"):
            self.part = tag
        elif tag == "tr":
            self.row, self.cls = [], dict(attrs).get("class") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "h2":
            self.h2 = self.text
        elif tag in ("th", "td"):
            self.row.append(self.text)
        elif tag == "tr":
            heads, rows, classes = self.tables[self.h2]
            if self.part == "thead":
                heads[:] = self.row
            else:
                rows.append(self.row)
                classes.append(self.cls)

    def handle_data(self, data: str) -> None:
        self.text += data


def sections(text: str) -> dict[str, tuple[list[str], list[list[str]], list[str]]]:
    """``{h2: (headers, rows, row classes)}`` of every table on the page."""
    p = _Sections()
    p.feed(text)
    return p.tables


def column(table: tuple[list[str], list[list[str]], list[str]], name: str) -> list[str]:
    heads, rows, _ = table
    i = heads.index(name)
    return [row[i] for row in rows]


def gb(n: float) -> str:
    """The report's size format: MB below 1 GiB, GB above."""
    return f"{n / 2**20:,.1f} MB" if n < 2**30 else f"{n / 2**30:,.2f} GB"


@pytest.fixture(scope="module")
def ssd_page():
    return rendered(plan_dict(ssd=True), "dgx-a100-ssd")


def test_html_shows_the_planners_step(ssd_page):
    text, cost, tr = ssd_page
    # the plan is made so that the most bytes and the slowest rank differ: the report follows the model
    assert cost.bottleneck_rank == KV_RANK and int(tr.sent.argmax()) == WIDE_RANK
    line = step_line(cost)
    assert re.fullmatch(STEP_RE, line) and line in text  # no character in it needs escaping
    assert f"modeled step {cost.step_time * 1e3:.4f} ms (slowest rank {KV_RANK}:" in text
    assert f"critical rank: rank {KV_RANK}: " in text and f"critical rank: rank {WIDE_RANK}" not in text
    assert "pairwise view" not in text  # plan_traffic's "why"
    ranks = sections(text)["Ranks"]
    heads, rows, classes = ranks
    assert [c for c in classes if c] == ["critical"] and rows[classes.index("critical")][0] == str(KV_RANK)
    for old in ("compute ms", "NVLink ms", "PCIe ms", "network ms", "shared memory ms"):  # plan_traffic's seconds
        assert old not in heads
    # the cost model's per-rank columns, to the text report's digits; plan_traffic's bytes stay
    assert column(ranks, "total ms") == [f"{cost.rank_time[r] * 1e3:.4f}" for r in range(W)]
    assert column(ranks, "lookup ms") == [f"{cost.lookup[r] * 1e3:.4f}" for r in range(W)]
    assert column(ranks, "comm ms") == [f"{cost.comm[r] * 1e3:.4f}" for r in range(W)]
    assert column(ranks, "host io ms") == [f"{cost.host_io[r] * 1e3:.4f}" for r in range(W)]
    assert column(ranks, "sent / step")[WIDE_RANK] != column(ranks, "sent / step")[0]  # where traffic goes
    # the split adds up to the total (rank_time = lookup + host io + ssd io + collectives)
    for r, row in enumerate(rows):
        parts = sum(float(row[heads.index(h)]) for h in ("lookup ms", "host io ms", "ssd io ms", "comm ms"))
        assert parts == pytest.approx(float(row[heads.index("total ms")]), abs=3e-4), r
    # the topology diagram highlights the planner's bottleneck GPU, and only it
    marked = re.findall(r'fill="#fde8e6" stroke="#b3261e" stroke-width="2"/><text [^>]*>rank (\d+) ·', text)
    assert marked == [str(KV_RANK)]


def test_phase_table_lists_every_collective_phase(ssd_page):
    text, cost, _ = ssd_page
    assert cost.phases  # table-wise tables: ids, pooled outputs forward, gradients backward
    heads, rows, _ = sections(text)["Busiest directed link per collective phase"]
    assert heads == ["phase", "busiest directed link", "ms"]
    assert rows == [[p, link, f"{secs * 1e3:.4f}"] for p, (link, secs) in sorted(cost.phases.items())]
    assert any(">" in link for _, link, _ in rows)  # directed link names (gpu0.nvlink>out), escaped in the page
    assert "nvlink>out" not in text and "nvlink&gt;out" in text


def test_ssd_plan_has_ssd_columns_and_note(ssd_page):
    text, cost, _ = ssd_page
    # SSD bytes per rank, from the plan's shard alone: the key_value table's rows and their state
    expected = [SSD_BYTES if r == KV_RANK else 0 for r in range(W)]
    pages = sections(text)
    assert column(pages["Ranks"], "SSD") == [gb(n) for n in expected]
    assert gb(SSD_BYTES) == "2,883.37 GB"  # 6e9 x 516 B
    tables = pages["Tables"]
    ssd_of = dict(zip(column(tables, "table"), column(tables, "SSD")))
    assert ssd_of == {"t_kv": gb(SSD_BYTES), "t_wide": gb(0), "t_small": gb(0)}
    # SSD time of the misses: (1 - load factor) x every rank's lookups x row bytes over read + write
    misses = (1 - KV_LF) * W * B
    row_bytes = KV_DIM * 4 + 4
    assert cost.ssd_io[KV_RANK] == pytest.approx(misses * row_bytes / 25e9 + misses * row_bytes / 12e9, rel=1e-9)
    assert column(pages["Ranks"], "ssd io ms") == [f"{cost.ssd_io[r] * 1e3:.4f}" for r in range(W)]
    assert f"+ ssd io {cost.ssd_io[KV_RANK] * 1e3:.4f} ms" in text  # in the critical rank's why
    # the memory section's note, not stacked into the HBM / host chart (TBs would flatten it)
    assert f"largest SSD use: rank {KV_RANK} with {gb(SSD_BYTES)}" in text
    chart = text[text.index('id="memory-chart"') : text.index("</svg>", text.index('id="memory-chart"'))]
    assert gb(SSD_BYTES) not in chart and f"rank {KV_RANK}: host {gb(0)}" in chart
    hosts = pages["Hosts"]
    assert column(hosts, "SSD used / capacity") == [f"{gb(SSD_BYTES)} / {gb(28610 * 2**30)}"]


def test_plan_without_key_value_tables_has_no_ssd_column():
    text, cost, _ = rendered(plan_dict(ssd=False), "dgx-a100")
    pages = sections(text)
    for name in ("Tables", "Ranks", "Hosts"):
        assert not [h for h in pages[name][0] if "SSD" in h or "ssd" in h], name
    assert "ssd io" not in text and "largest SSD" not in text and 'id="ssd-note"' not in text
    assert column(pages["Ranks"], "total ms") == [f"{cost.rank_time[r] * 1e3:.4f}" for r in range(W)]
    assert step_line(cost) in text


def test_without_a_cost_the_report_has_bytes_and_no_times():
    d = plan_dict(ssd=True)
    plan, header = plan_format.plan_from_dict(d)
    rep = plan_report.report(plan, header)
    infos = plan_report.table_infos(plan, header)
    bare = plan_traffic.traffic(infos, W, B)
    text = render_html(rep, bare)  # no topology: bytes only, SSD still reported
    assert "no topology given" in text and "modeled step" not in text and "Busiest directed link" not in text
    assert column(sections(text)["Ranks"], "SSD")[KV_RANK] == gb(SSD_BYTES)
    topo = load_topology("dgx-a100-ssd")
    tr = plan_traffic.apply_topology(plan_traffic.traffic(infos, W, B), topo, infos, rep["ranks"])
    page = render_html(rep, tr, topo)  # a caller with a topology but no cost: still no second time model
    heads = sections(page)["Ranks"][0]
    assert "no modeled step given" in page and "modeled step " not in page.replace("no modeled step given", "")
    assert not any(h.endswith(" ms") for h in heads) and "sent / step" in heads


def test_show_html_prints_the_text_reports_step(tmp_path):
    """The CLI passes the cost to the HTML: its step line is the text report's, to the digit."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_dict(ssd=True)))
    out = tmp_path / "report.html"

    def show(*args: str) -> subprocess.CompletedProcess:
        return run_main("recsys.plan_cli", "show", str(path), "--topology", "dgx-a100-ssd", *args, cwd=REPO)

    text = show()
    assert text.returncode == 0, text.stderr
    html = show("--format", "html", "--out", str(out))
    assert html.returncode == 0, html.stderr
    page = out.read_text()
    (line,) = re.findall(STEP_RE, text.stdout)
    assert re.findall(STEP_RE, page) == [line]
    _, cost, _ = rendered(plan_dict(ssd=True), "dgx-a100-ssd")
    assert line == step_line(cost)
    assert f"critical rank: rank {cost.bottleneck_rank}: " in page
