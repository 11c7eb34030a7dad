"""One self-contained HTML report of a sharding plan (`recsys-plan show --format html`).

No external JS, CSS, fonts or images: the charts are inline SVG (sharding/plan/svg_charts.py
draws them; this module assembles the page around them). Every piece of text from the plan or
topology goes through :func:`html.escape`. Laid out for a 1280 px window.

Sections: summary (world size, device; with a topology the planner's modelled step and the
critical rank and why), memory per rank (HBM and host stacked, HBM capacity line with a topology;
the largest SSD use as a note, since key_value tables' SSD bytes are TBs and would flatten the
chart), a rank x rank traffic heatmap (bytes per step, forward + backward), the topology with the
tables on each GPU, and the per-table, per-rank and per-host tables (an SSD column only for plans
with key_value tables, as in the text report).

Times come from one model, the planner's own (:class:`sharding.planner.cost.model.PlanCost`, via
:func:`sharding.planner.cost.plan_cost.modeled_step`): the step it minimised, each rank's lookup /
host io / ssd io / collective split, and every collective phase's busiest directed link; the same
numbers as ``recsys-plan show --topology`` prints. Bytes come from
``sharding/planner/cost/traffic.py`` (heatmap, sent / received / lookups per rank, host and PCIe
switch loads): where traffic goes. Without a cost the report has no times.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sharding.planner.cost.model import PlanCost
from sharding.planner.cost.plan_cost import step_line
from sharding.plan.report import has_ssd
from sharding.plan.svg_charts import esc, fmt_bytes, fmt_mb, heatmap, memory_chart, topology_diagram
from sharding.planner.cost.traffic import Traffic

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:20px 32px;color:#222;max-width:1216px}
h1{font-size:22px;margin:0 0 8px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ccc;padding-bottom:3px}
.summary{background:#f4f6fa;border:1px solid #d5dbe5;padding:10px 14px;border-radius:4px;line-height:1.5}
.crit{color:#b3261e;font-weight:600}
table{border-collapse:collapse;font-size:12px;margin:6px 0} th,td{border:1px solid #ddd;padding:2px 6px;text-align:right}
th{background:#eef1f6} td.l,th.l{text-align:left} tr.critical td{background:#fde8e6}
.note{color:#666;font-size:12px} svg{display:block;margin:6px 0} svg text{font-family:inherit}
"""


def _table(headers: list[str], rows: list[list[Any]], left: int = 1, row_class: list[str] | None = None) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{esc(h)}</th>' for i, h in enumerate(headers))
    body = []
    for k, row in enumerate(rows):
        cls = f' class="{esc(row_class[k])}"' if row_class and row_class[k] else ""
        body.append(f"<tr{cls}>" + "".join(f'<td class="{"l" if i < left else ""}">{esc(v)}</td>' for i, v in enumerate(row)) + "</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _ranks(rs: list[int]) -> str:
    return ",".join(map(str, rs)) if len(rs) <= 6 else f"{rs[0]}..{rs[-1]} ({len(rs)})"


def ssd_note(report: dict[str, Any]) -> str:
    """One line for the memory section: the rank with the most SSD bytes. Kept out of the
    HBM / host chart on purpose: TBs of SSD would flatten the GB-sized bars."""
    top = max(report["ranks"], key=lambda r: r.get("ssd_bytes", 0))
    total = sum(r.get("ssd_bytes", 0) for r in report["ranks"])
    return (
        f"largest SSD use: rank {top['rank']} with {fmt_mb(top.get('ssd_bytes', 0))} ({fmt_mb(total)} on all ranks; "
        "key_value tables: FBGEMM's SSD kernels, rows and optimizer state on the host's SSD, not in the chart above)"
    )


def _ms(seconds: float) -> str:
    """Milliseconds as the text report prints them (sharding/planner/cost/plan_cost.py: 4 decimals)."""
    return f"{seconds * 1e3:.4f}"


def _cost_terms(cost: PlanCost, rank: int, ssd: bool) -> list[tuple[str, float]]:
    """A rank's modelled time, term by term (``rank_time = lookup + host_io + ssd_io + comm``)."""
    terms = [("lookup", float(cost.lookup[rank])), ("host io", float(cost.host_io[rank]))]
    if ssd:
        terms.append(("ssd io", float(cost.ssd_io[rank])))
    return terms + [("collectives", float(cost.comm[rank]))]


def critical_why(cost: PlanCost, ssd: bool) -> str:
    """Why the bottleneck rank is slowest: its time split into the cost model's terms, the largest
    named, so a reader knows whether to move lookups, host traffic, SSD misses or collectives."""
    r = cost.bottleneck_rank
    total = float(cost.rank_time[r])
    terms = _cost_terms(cost, r, ssd)
    ok = np.isfinite(total) and total > 0  # a key_value shard on a host without SSD costs inf

    def share(v: float) -> str:
        return f" ({v / total:.0%})" if ok else ""

    split = " + ".join(f"{name} {_ms(v)} ms{share(v)}" for name, v in terms)
    top = max(terms, key=lambda kv: kv[1])[0]
    return (
        f"rank {r}: {_ms(total)} ms = {split}; mostly {top} (its collectives: each phase's busiest link among the rank's own, plus latency)"
    )


def phase_table(cost: PlanCost) -> str:
    """Every collective phase's busiest directed link and its seconds there: what sets
    ``cost.comm_time``, the part of the step no rank can shorten on its own."""
    rows = [[phase, link, _ms(secs)] for phase, (link, secs) in sorted(cost.phases.items())]
    if not rows:
        return '<p class="note">no collectives: every table is local to its rank.</p>'
    return _table(["phase", "busiest directed link", "ms"], rows, left=2)


def render_html(report: dict[str, Any], traffic: Traffic, topology=None, cost: PlanCost | None = None) -> str:
    """The whole report as one HTML string (see the module docstring). ``cost``: the planner's
    modelled step of this plan on ``topology`` (:func:`sharding.planner.cost.plan_cost.modeled_step`); with it,
    every time shown is the planner's, so the page agrees with the text report to the digit."""
    W = report["world_size"]
    meta = report.get("meta") or {}
    ssd = has_ssd(report)
    ssd_time = ssd or (cost is not None and bool(cost.ssd_io.any()))  # an "ssd io ms" column
    tables_by_rank: dict[int, list[str]] = {}
    for t in report["tables"]:
        for s in t["shards"]:
            tables_by_rank.setdefault(s["rank"], [])
            if t["table"] not in tables_by_rank[s["rank"]]:
                tables_by_rank[s["rank"]].append(t["table"])
    crit_rank = cost.bottleneck_rank if cost is not None else None
    summary = [
        f"<b>{esc(len(report['tables']))}</b> tables on <b>{esc(W)}</b> ranks, compute device <b>{esc(report['compute_device'])}</b>; "
        f"batch {esc(traffic.batch_size_per_rank)} per rank, pooling factor 1."
    ]
    if meta:
        summary.append("plan: " + esc(", ".join(f"{k}={v}" for k, v in meta.items() if v not in (None, "", [], 0.0))))
    if topology is not None:
        summary.append(
            f"topology <b>{esc(topology.name or topology.source)}</b>: "
            f"{esc(len(topology.hosts))} host(s) x {esc(topology.local_world_size)} GPUs."
        )
    if cost is not None:
        summary.append(
            f'<span class="step">{esc(step_line(cost))}</span>, batch {esc(traffic.batch_size_per_rank)} per rank '
            "(the planner's model, sharding/planner/cost/model.py: the step it minimised)"
        )
        summary.append(f'<span class="crit">critical rank: {esc(critical_why(cost, ssd_time))}</span>')
    else:
        busiest = int(np.argmax(traffic.sent)) if W else 0
        why = "no topology given (use --topology)" if topology is None else "no modeled step given"
        summary.append(
            f"{why}: no modeled times; rank {busiest} sends the most, {esc(fmt_bytes(float(traffic.sent[busiest]) if W else 0))} per step."
        )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=1280">',
        f"<title>sharding plan: {esc(W)} ranks</title><style>{CSS}</style></head><body>",
        f"<h1>Sharding plan report: {esc(len(report['tables']))} tables on {esc(W)} ranks</h1>",
        '<div class="summary">' + "<br>".join(summary) + "</div>",
        "<h2>Memory per rank</h2>",
        memory_chart(report["ranks"], topology),
    ]
    if ssd:
        parts.append(f'<p class="note" id="ssd-note">{esc(ssd_note(report))}</p>')
    parts += [
        "<h2>Traffic between ranks (bytes per step, forward + backward)</h2>",
        '<p class="note">Model: input ids (8 B each) to shard owners, pooled outputs (4 B per column per sample) back, '
        "gradients the reverse; data-parallel tables all-reduce in a ring. See sharding/planner/cost/traffic.py "
        "(bytes: where traffic goes; the step's times are the planner's cost model).</p>",
        heatmap(traffic, topology),
    ]
    if topology is not None:
        parts += ["<h2>Topology and tables</h2>", topology_diagram(topology, tables_by_rank, crit_rank)]
    parts += ["<h2>Tables</h2>", _tables_table(report, ssd)]
    parts += ["<h2>Ranks</h2>", _ranks_table(report, traffic, topology, cost, ssd, ssd_time, crit_rank)]
    if cost is not None:
        latency = cost.comm_time - sum(secs for _, secs in cost.phases.values())
        parts += [
            "<h2>Busiest directed link per collective phase</h2>",
            f'<p class="note">The collectives\' {esc(_ms(cost.comm_time))} ms in the step: the sum of these plus '
            f"{esc(_ms(max(latency, 0.0)))} ms latency (the planner's model, sharding/planner/cost/model.py).</p>",
            phase_table(cost),
        ]
    if traffic.hosts:
        parts += ["<h2>Hosts</h2>", _hosts_table(traffic)]
    parts.append('<p class="note">Generated by recsys-plan show --format html. Modeled numbers, not measurements.</p>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _tables_table(report: dict[str, Any], ssd: bool) -> str:
    """Per table: placement, kernel, cache load factor and bytes (SSD only for key_value plans)."""
    trows = []
    for t in report["tables"]:
        lf = "" if t["cache_load_factor"] is None else f"{t['cache_load_factor']:.2f}"
        shards = "; ".join(f"r{s['rank']}:{s['rows']}x{s['cols']}" for s in t["shards"][:4]) + (
            f"; +{len(t['shards']) - 4}" if len(t["shards"]) > 4 else ""
        )
        trows.append(
            [
                t["table"],
                t["module"],
                t["sharding_type"],
                t["compute_kernel"],
                _ranks(t["ranks"]),
                shards,
                lf,
                fmt_mb(t["hbm_bytes"]),
                fmt_mb(t["host_bytes"]),
            ]
            + ([fmt_mb(t.get("ssd_bytes", 0))] if ssd else [])
        )
    heads = ["table", "module", "sharding", "kernel", "ranks", "shards (rank:rows x cols)", "cache lf", "HBM", "host"] + (
        ["SSD"] if ssd else []
    )
    return _table(heads, trows, left=6)


def _ranks_table(
    report: dict[str, Any], traffic: Traffic, topology, cost: PlanCost | None, ssd: bool, ssd_time: bool, crit_rank: int | None
) -> str:
    """Per rank: memory, the traffic view's bytes (where traffic goes) and, with a cost, the
    planner's per-rank times."""
    heads = ["rank", "tables", "HBM", "host"] + (["SSD"] if ssd else []) + ["sent / step", "received / step", "lookups / step"]
    caps = cost is not None and topology is not None and topology.world_size == report["world_size"]
    heads += ["HBM cap"] if caps else []
    if cost is not None:
        heads += ["lookup ms", "host io ms"] + (["ssd io ms"] if ssd_time else []) + ["comm ms", "total ms"]
    rrows, classes = [], []
    for r in report["ranks"]:
        i = r["rank"]
        row = [i, r["tables"], fmt_mb(r["hbm_bytes"]), fmt_mb(r["host_bytes"])] + ([fmt_mb(r.get("ssd_bytes", 0))] if ssd else [])
        row += [fmt_bytes(traffic.sent[i]), fmt_bytes(traffic.received[i]), f"{traffic.lookups[i]:,.0f}"]
        if caps:
            cap = topology.gpu(i).hbm_bytes
            row.append(f"{r['hbm_bytes'] / cap:.1%} of {fmt_mb(cap)}" if cap else "-")
        if cost is not None:
            row += [_ms(cost.lookup[i]), _ms(cost.host_io[i])] + ([_ms(cost.ssd_io[i])] if ssd_time else [])
            row += [_ms(cost.comm[i]), _ms(cost.rank_time[i])]
        rrows.append(row)
        classes.append("critical" if crit_rank == i else "")
    return _table(heads, rrows, row_class=classes)


def _hosts_table(traffic: Traffic) -> str:
    """Per host: memory used against capacity (SSD where the host has an SSD tier or key_value
    shards, as plan_traffic.format_text) and each PCIe switch's bytes per step."""
    ssd = any(h.get("ssd_bytes") or h.get("ssd_capacity") for h in traffic.hosts)
    hrows = []
    for h in traffic.hosts:
        sw = ", ".join(f"{s['switch']}: {fmt_bytes(s['bytes_per_step'])}" for s in h["pcie_switches"]) or "-"
        hrows.append(
            [
                h["host"],
                h["name"],
                _ranks(h["ranks"]),
                f"{fmt_mb(h['hbm_bytes'])} / {fmt_mb(h['hbm_capacity'])}",
                f"{fmt_mb(h['host_bytes'])} / {fmt_mb(h['host_capacity'])}",
            ]
            + ([f"{fmt_mb(h.get('ssd_bytes', 0))} / {fmt_mb(h.get('ssd_capacity', 0))}"] if ssd else [])
            + [sw]
        )
    heads = ["host", "name", "ranks", "HBM used / capacity", "host memory used / capacity"] + (["SSD used / capacity"] if ssd else [])
    return _table(heads + ["PCIe switch load per step"], hrows, left=3)
