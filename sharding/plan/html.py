"""One self-contained HTML report of a sharding plan (`recsys-plan show --format html`).

No external JS, CSS, fonts or images: the charts are inline SVG generated here. Every piece of
text from the plan or topology goes through :func:`html.escape`. Laid out for a 1280 px window.

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

import html
from typing import Any

import numpy as np

from sharding.planner.cost.model import PlanCost
from sharding.planner.cost.plan_cost import step_line
from sharding.plan.report import has_ssd
from sharding.planner.cost.traffic import Traffic

WIDTH = 1200  # drawing width inside a 1280 px window

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:20px 32px;color:#222;max-width:1216px}
h1{font-size:22px;margin:0 0 8px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ccc;padding-bottom:3px}
.summary{background:#f4f6fa;border:1px solid #d5dbe5;padding:10px 14px;border-radius:4px;line-height:1.5}
.crit{color:#b3261e;font-weight:600}
table{border-collapse:collapse;font-size:12px;margin:6px 0} th,td{border:1px solid #ddd;padding:2px 6px;text-align:right}
th{background:#eef1f6} td.l,th.l{text-align:left} tr.critical td{background:#fde8e6}
.note{color:#666;font-size:12px} svg{display:block;margin:6px 0} svg text{font-family:inherit}
"""

HBM_COLOR, HOST_COLOR, CAP_COLOR = "#3b6fb6", "#e69f00", "#b3261e"
KIND_COLORS = {"nvlink": "#76b900", "pcie": "#3b6fb6", "network": "#b3261e", "shm": "#888888"}


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB" if n < 2**30 else f"{n / 2**30:,.2f} GB"


def _bytes(n: float) -> str:
    if n < 2**10:
        return f"{n:,.0f} B"
    if n < 2**20:
        return f"{n / 2**10:,.1f} KB"
    return _mb(n)


# -- charts ---------------------------------------------------------------------------------------


def memory_chart(ranks: list[dict], topology=None) -> str:
    """Stacked bars: HBM (blue) and host memory (orange) per rank; HBM capacity line if known."""
    W = len(ranks)
    used = [r["hbm_bytes"] + r["host_bytes"] for r in ranks]
    caps = [topology.gpu(r["rank"]).hbm_bytes for r in ranks] if topology is not None and topology.world_size == W else None
    top = max(max(used, default=0), 1)
    cap_note = ""
    if caps and max(caps) > 0:
        if max(caps) <= 4 * top:
            top = max(top, max(caps))
        else:
            cap_note = (
                f"HBM capacity {_mb(max(caps))} per GPU is off this scale: the fullest rank uses "
                f"{max(r['hbm_bytes'] / c for r, c in zip(ranks, caps) if c):.2%} of it"
            )
    left, right, h, tp = 70, 20, 220, 20
    pw = WIDTH - left - right
    bw = pw / max(W, 1)
    y = lambda v: tp + h - v / top * h  # noqa: E731
    out = [
        f'<svg class="chart" id="memory-chart" width="{WIDTH}" height="{h + tp + 60}" viewBox="0 0 {WIDTH} {h + tp + 60}" '
        f'role="img" aria-label="memory per rank">'
    ]
    for i in range(5):  # grid + axis labels
        v = top * i / 4
        out.append(
            f'<line x1="{left}" x2="{WIDTH - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e5e5"/>'
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{_e(_mb(v))}</text>'
        )
    for i, r in enumerate(ranks):
        x = left + i * bw + bw * 0.15
        w = bw * 0.7
        hb, hh = r["hbm_bytes"], r["host_bytes"]
        out.append(
            f'<rect class="bar hbm" x="{x:.1f}" y="{y(hb):.1f}" width="{w:.1f}" height="{h - (y(hb) - tp):.1f}" fill="{HBM_COLOR}">'
            f"<title>rank {r['rank']}: HBM {_e(_mb(hb))}</title></rect>"
        )
        out.append(
            f'<rect class="bar host" x="{x:.1f}" y="{y(hb + hh):.1f}" width="{w:.1f}" '
            f'height="{y(hb) - y(hb + hh):.1f}" fill="{HOST_COLOR}">'
            f"<title>rank {r['rank']}: host {_e(_mb(hh))}</title></rect>"
        )
        if caps and not cap_note:
            out.append(
                f'<line x1="{x - 2:.1f}" x2="{x + w + 2:.1f}" y1="{y(caps[i]):.1f}" y2="{y(caps[i]):.1f}" '
                f'stroke="{CAP_COLOR}" stroke-width="2"/>'
            )
        if W <= 64 or i % max(1, W // 32) == 0:
            out.append(f'<text x="{x + w / 2:.1f}" y="{tp + h + 14}" font-size="10" text-anchor="middle">{i}</text>')
    ly = tp + h + 36
    out.append(f'<text x="{left}" y="{ly + 10}" font-size="11">rank</text>')
    lx = left + 60
    for color, label in ((HBM_COLOR, "HBM"), (HOST_COLOR, "host memory")) + (
        ((CAP_COLOR, "HBM capacity"),) if caps and not cap_note else ()
    ):
        out.append(
            f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{color}"/>'
            f'<text x="{lx + 16}" y="{ly + 10}" font-size="11">{_e(label)}</text>'
        )
        lx += 130
    out.append("</svg>")
    if cap_note:
        out.append(f'<p class="note">{_e(cap_note)}</p>')
    return "\n".join(out)


def _ramp(t: float) -> str:
    """0..1 -> white -> light blue -> dark blue -> dark red (sequential)."""
    stops = [(0.0, (255, 255, 255)), (0.33, (158, 202, 225)), (0.66, (33, 102, 172)), (1.0, (103, 0, 13))]
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0) if t1 > t0 else 0
            return "#%02x%02x%02x" % tuple(round(a + (b - a) * f) for a, b in zip(c0, c1))
    return "#67000d"


def heatmap(tr: Traffic, topology=None) -> str:
    """Rank x rank bytes per step (forward + backward), sender on rows, receiver on columns."""
    W = tr.world_size
    m = tr.total
    vmax = float(m.max()) if m.size else 0.0
    size = min(640, max(160, 16 * W))
    cell = size / max(W, 1)
    left, tp = 60, 30
    legend_x = left + size + 40
    height = size + tp + 50
    out = [
        f'<svg class="chart" id="traffic-heatmap" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'role="img" aria-label="rank by rank traffic">'
    ]
    for a in range(W):
        for b in range(W):
            v = float(m[a, b])
            out.append(
                f'<rect class="hm-cell" x="{left + b * cell:.2f}" y="{tp + a * cell:.2f}" width="{cell:.2f}" height="{cell:.2f}" '
                f'fill="{_ramp(v / vmax if vmax else 0)}" stroke="#fff" stroke-width="{0.5 if W <= 64 else 0}">'
                f"<title>rank {a} -&gt; rank {b}: {_e(_bytes(v))} per step</title></rect>"
            )
    step = max(1, W // 16)
    for i in range(0, W, step):
        out.append(f'<text x="{left - 4}" y="{tp + (i + 0.5) * cell + 4:.1f}" font-size="10" text-anchor="end">{i}</text>')
        out.append(f'<text x="{left + (i + 0.5) * cell:.1f}" y="{tp - 4}" font-size="10" text-anchor="middle">{i}</text>')
    if topology is not None and topology.world_size == W and len(topology.hosts) > 1:  # host boundaries
        L = topology.local_world_size
        for h in range(1, len(topology.hosts)):
            p = h * L * cell
            out.append(
                f'<line x1="{left + p:.1f}" x2="{left + p:.1f}" y1="{tp}" y2="{tp + size}" stroke="#222" stroke-width="1.5"/>'
                f'<line x1="{left}" x2="{left + size}" y1="{tp + p:.1f}" y2="{tp + p:.1f}" stroke="#222" stroke-width="1.5"/>'
            )
    out.append(f'<text x="{left + size / 2}" y="{tp + size + 20}" font-size="11" text-anchor="middle">receiving rank</text>')
    out.append(
        f'<text x="16" y="{tp + size / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 16 {tp + size / 2})">sending rank</text>'
    )
    # legend: a vertical colour ramp with ticks
    steps = 50
    lh = min(size, 300)
    out.append(f'<text x="{legend_x}" y="{tp - 8}" font-size="11">bytes per step</text>')
    for i in range(steps):
        t = 1 - i / steps
        out.append(
            f'<rect class="legend" x="{legend_x}" y="{tp + i * lh / steps:.2f}" width="18" '
            f'height="{lh / steps + 0.5:.2f}" fill="{_ramp(t)}"/>'
        )
    for i in range(5):
        t = 1 - i / 4
        out.append(f'<text x="{legend_x + 24}" y="{tp + i * lh / 4 + 4:.1f}" font-size="11">{_e(_bytes(vmax * t))}</text>')
    out.append(f'<rect x="{legend_x}" y="{tp}" width="18" height="{lh}" fill="none" stroke="#999"/>')
    out.append("</svg>")
    return "\n".join(out)


def _abbrev(names: list[str], n: int) -> list[str]:
    return names if len(names) <= n else names[: n - 1] + [f"+{len(names) - n + 1} more"]


def topology_diagram(topology, tables_by_rank: dict[int, list[str]], critical: int | None = None) -> str:
    """Hosts as boxes; inside, GPUs grouped by PCIe switch (NUMA node for CPU ranks), each listing
    its tables; the NVLink domain is named in each host's title."""
    hosts = topology.hosts
    cols = 1 if len(hosts) == 1 else 2
    host_w = (WIDTH - 20 * (cols - 1)) / cols
    gpu_lines = 7
    gpu_h = 28 + 12 * gpu_lines
    out_parts, heights = [], []
    for hi, host in enumerate(hosts):
        if host.pcie_switches:
            groups = [
                (f"{s.name} (NUMA {s.numa}" + (f", NICs {', '.join(s.nics)})" if s.nics else ")"), list(s.gpus)) for s in host.pcie_switches
            ]
            seen = {g for _, gs in groups for g in gs}
            rest = [g.index for g in host.gpus if g.index not in seen]
            if rest:
                groups.append(("no PCIe switch", rest))
        else:
            groups = [(f"NUMA {n.index}", list(host.gpus_on_numa(n.index))) for n in host.numa_nodes]
            groups = [g for g in groups if g[1]]
        gpu_w = min(200.0, (host_w - 70) / 4)  # two switches of two GPUs side by side
        # lay groups out left to right, wrapping
        items = []  # (group label, x, y, w, gpus)
        gx, gy, row_h = 10.0, 44.0, 0.0
        for label, gpus in groups:
            n = max(1, len(gpus))
            w = n * gpu_w + (n - 1) * 10 + 12
            if gx + w > host_w - 6 and gx > 10:
                gx, gy = 10.0, gy + row_h + 10
            items.append((label, gx, gy, w, gpus))
            gx += w + 6
            row_h = gpu_h + 28
        hh = gy + row_h + 8
        heights.append(hh)
        out_parts.append((hi, host, items, hh, gpu_w))
    rows = [max(heights[i : i + cols]) for i in range(0, len(hosts), cols)]
    total_h = sum(rows) + 16 * len(rows) + 30
    svg = [
        f'<svg class="chart" id="topology-diagram" width="{WIDTH}" height="{total_h:.0f}" viewBox="0 0 {WIDTH} {total_h:.0f}" '
        f'role="img" aria-label="topology with tables">'
    ]
    nv = {"nvswitch": "NVSwitch: all GPUs", "islands": "NVLink islands", "pairs": "NVLink pairs", "none": "no NVLink"}
    for hi, host, items, hh, gpu_w in out_parts:
        r, c = divmod(hi, cols)
        hx = c * (host_w + 20)
        hy = sum(rows[:r]) + 16 * r
        nvk = host.nvlink.kind
        nvtxt = nv.get(nvk, nvk)
        if nvk == "islands":
            nvtxt += " " + " ".join("{" + ",".join(map(str, isl)) + "}" for isl in host.nvlink.islands)
        elif nvk == "pairs":
            nvtxt += " " + " ".join(f"{a}-{b}x{n}" for a, b, n in host.nvlink.pairs)
        svg.append(
            f'<g class="host"><rect x="{hx:.1f}" y="{hy:.1f}" width="{host_w:.1f}" height="{hh:.1f}" rx="6" fill="#f7f7f7" stroke="#555"/>'
            f'<text x="{hx + 10:.1f}" y="{hy + 18:.1f}" font-size="13" font-weight="600">host {hi}: {_e(host.name)}</text>'
            f'<text x="{hx + 10:.1f}" y="{hy + 34:.1f}" font-size="11" fill="#444">{_e(nvtxt)}; '
            f"{_e(len(host.nics))} NICs; DDR {_e(f'{host.ddr_bytes / 2**30:,.0f}')} GB</text>"
        )
        for label, gx, gy, w, gpus in items:
            svg.append(
                f'<rect x="{hx + gx:.1f}" y="{hy + gy:.1f}" width="{w:.1f}" height="{gpu_h + 22:.1f}" rx="4" '
                f'fill="#fff" stroke="#9aa" stroke-dasharray="4 2"/>'
                f'<text x="{hx + gx + 6:.1f}" y="{hy + gy + 13:.1f}" font-size="10" fill="#566">{_e(label)}</text>'
            )
            for k, li in enumerate(gpus):
                rank = topology.rank(hi, li)
                x = hx + gx + 6 + k * (gpu_w + 10)
                y = hy + gy + 18
                g = host.gpus[li]
                crit = rank == critical
                svg.append(
                    f'<g class="gpu"><rect x="{x:.1f}" y="{y:.1f}" width="{gpu_w:.1f}" height="{gpu_h:.1f}" rx="3" '
                    f'fill="{"#fde8e6" if crit else "#eaf1fb"}" stroke="{"#b3261e" if crit else "#3b6fb6"}" '
                    f'stroke-width="{2 if crit else 1}"/>'
                    f'<text x="{x + 5:.1f}" y="{y + 13:.1f}" font-size="11" font-weight="600">rank {rank} · gpu{li}</text>'
                    f'<text x="{x + 5:.1f}" y="{y + 25:.1f}" font-size="9" fill="#555">{_e(g.model or topology.compute_device)}</text>'
                )
                names = tables_by_rank.get(rank, [])
                per_line = max(1, int(gpu_w // 38))
                chunks = [", ".join(names[i : i + per_line]) for i in range(0, len(names), per_line)]
                for j, line in enumerate(_abbrev(chunks, gpu_lines)):
                    svg.append(f'<text class="tables" x="{x + 5:.1f}" y="{y + 38 + 12 * j:.1f}" font-size="9.5">{_e(line)}</text>')
                if not names:
                    svg.append(f'<text x="{x + 5:.1f}" y="{y + 38:.1f}" font-size="9.5" fill="#999">(no tables)</text>')
                svg.append("</g>")
        svg.append("</g>")
    svg.append(
        f'<text x="0" y="{total_h - 8:.0f}" font-size="11" fill="#555">dashed boxes: PCIe switches (NUMA nodes for CPU ranks); '
        f"red: the critical rank; tables listed per GPU (abbreviated when many)</text>"
    )
    svg.append("</svg>")
    return "\n".join(svg)


# -- tables ---------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[Any]], left: int = 1, row_class: list[str] | None = None) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(headers))
    body = []
    for k, row in enumerate(rows):
        cls = f' class="{_e(row_class[k])}"' if row_class and row_class[k] else ""
        body.append(f"<tr{cls}>" + "".join(f'<td class="{"l" if i < left else ""}">{_e(v)}</td>' for i, v in enumerate(row)) + "</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _ranks(rs: list[int]) -> str:
    return ",".join(map(str, rs)) if len(rs) <= 6 else f"{rs[0]}..{rs[-1]} ({len(rs)})"


def ssd_note(report: dict[str, Any]) -> str:
    """One line for the memory section: the rank with the most SSD bytes. Kept out of the
    HBM / host chart on purpose: TBs of SSD would flatten the GB-sized bars."""
    top = max(report["ranks"], key=lambda r: r.get("ssd_bytes", 0))
    total = sum(r.get("ssd_bytes", 0) for r in report["ranks"])
    return (
        f"largest SSD use: rank {top['rank']} with {_mb(top.get('ssd_bytes', 0))} ({_mb(total)} on all ranks; "
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
        f"<b>{_e(len(report['tables']))}</b> tables on <b>{_e(W)}</b> ranks, compute device <b>{_e(report['compute_device'])}</b>; "
        f"batch {_e(traffic.batch_size_per_rank)} per rank, pooling factor 1."
    ]
    if meta:
        summary.append("plan: " + _e(", ".join(f"{k}={v}" for k, v in meta.items() if v not in (None, "", [], 0.0))))
    if topology is not None:
        summary.append(
            f"topology <b>{_e(topology.name or topology.source)}</b>: "
            f"{_e(len(topology.hosts))} host(s) x {_e(topology.local_world_size)} GPUs."
        )
    if cost is not None:
        summary.append(
            f'<span class="step">{_e(step_line(cost))}</span>, batch {_e(traffic.batch_size_per_rank)} per rank '
            "(the planner's model, sharding/planner/cost/model.py: the step it minimised)"
        )
        summary.append(f'<span class="crit">critical rank: {_e(critical_why(cost, ssd_time))}</span>')
    else:
        busiest = int(np.argmax(traffic.sent)) if W else 0
        why = "no topology given (use --topology)" if topology is None else "no modeled step given"
        summary.append(
            f"{why}: no modeled times; rank {busiest} sends the most, {_e(_bytes(float(traffic.sent[busiest]) if W else 0))} per step."
        )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=1280">',
        f"<title>sharding plan: {_e(W)} ranks</title><style>{CSS}</style></head><body>",
        f"<h1>Sharding plan report: {_e(len(report['tables']))} tables on {_e(W)} ranks</h1>",
        '<div class="summary">' + "<br>".join(summary) + "</div>",
        "<h2>Memory per rank</h2>",
        memory_chart(report["ranks"], topology),
    ]
    if ssd:
        parts.append(f'<p class="note" id="ssd-note">{_e(ssd_note(report))}</p>')
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
            f'<p class="note">The collectives\' {_e(_ms(cost.comm_time))} ms in the step: the sum of these plus '
            f"{_e(_ms(max(latency, 0.0)))} ms latency (the planner's model, sharding/planner/cost/model.py).</p>",
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
                _mb(t["hbm_bytes"]),
                _mb(t["host_bytes"]),
            ]
            + ([_mb(t.get("ssd_bytes", 0))] if ssd else [])
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
        row = [i, r["tables"], _mb(r["hbm_bytes"]), _mb(r["host_bytes"])] + ([_mb(r.get("ssd_bytes", 0))] if ssd else [])
        row += [_bytes(traffic.sent[i]), _bytes(traffic.received[i]), f"{traffic.lookups[i]:,.0f}"]
        if caps:
            cap = topology.gpu(i).hbm_bytes
            row.append(f"{r['hbm_bytes'] / cap:.1%} of {_mb(cap)}" if cap else "-")
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
        sw = ", ".join(f"{s['switch']}: {_bytes(s['bytes_per_step'])}" for s in h["pcie_switches"]) or "-"
        hrows.append(
            [
                h["host"],
                h["name"],
                _ranks(h["ranks"]),
                f"{_mb(h['hbm_bytes'])} / {_mb(h['hbm_capacity'])}",
                f"{_mb(h['host_bytes'])} / {_mb(h['host_capacity'])}",
            ]
            + ([f"{_mb(h.get('ssd_bytes', 0))} / {_mb(h.get('ssd_capacity', 0))}"] if ssd else [])
            + [sw]
        )
    heads = ["host", "name", "ranks", "HBM used / capacity", "host memory used / capacity"] + (["SSD used / capacity"] if ssd else [])
    return _table(heads + ["PCIe switch load per step"], hrows, left=3)
