"""The inline SVG figures of the HTML plan report (sharding/plan/html.py): memory per rank, the
rank x rank traffic heatmap and the topology with the tables on each GPU.

No external JS, CSS, fonts or images: each figure is one ``<svg>`` string drawn here, sized for
a 1280 px window (:data:`WIDTH`), and every piece of text from the plan or topology goes through
:func:`esc`. Kept apart from the page assembly because the drawing (scales, legends, layout of
hosts and PCIe switches) is geometry, not report content; the byte formats the page shares with
the figures live here too, so a figure and a table cell print the same number the same way.
"""

from __future__ import annotations

import html
from typing import Any

from sharding.planner.cost.traffic import Traffic

WIDTH = 1200  # drawing width inside a 1280 px window

HBM_COLOR, HOST_COLOR, CAP_COLOR = "#3b6fb6", "#e69f00", "#b3261e"


def esc(x: Any) -> str:
    """Any value as HTML text, quotes escaped too (safe inside attributes)."""
    return html.escape(str(x), quote=True)


def fmt_mb(n: float) -> str:
    """Bytes as MB (one decimal) below 1 GB, else GB (two decimals); binary units."""
    return f"{n / 2**20:,.1f} MB" if n < 2**30 else f"{n / 2**30:,.2f} GB"


def fmt_bytes(n: float) -> str:
    """Bytes as B, KB or, from 1 MB up, as :func:`fmt_mb` does; binary units."""
    if n < 2**10:
        return f"{n:,.0f} B"
    if n < 2**20:
        return f"{n / 2**10:,.1f} KB"
    return fmt_mb(n)


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
                f"HBM capacity {fmt_mb(max(caps))} per GPU is off this scale: the fullest rank uses "
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
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{esc(fmt_mb(v))}</text>'
        )
    for i, r in enumerate(ranks):
        x = left + i * bw + bw * 0.15
        w = bw * 0.7
        hb, hh = r["hbm_bytes"], r["host_bytes"]
        out.append(
            f'<rect class="bar hbm" x="{x:.1f}" y="{y(hb):.1f}" width="{w:.1f}" height="{h - (y(hb) - tp):.1f}" fill="{HBM_COLOR}">'
            f"<title>rank {r['rank']}: HBM {esc(fmt_mb(hb))}</title></rect>"
        )
        out.append(
            f'<rect class="bar host" x="{x:.1f}" y="{y(hb + hh):.1f}" width="{w:.1f}" '
            f'height="{y(hb) - y(hb + hh):.1f}" fill="{HOST_COLOR}">'
            f"<title>rank {r['rank']}: host {esc(fmt_mb(hh))}</title></rect>"
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
            f'<text x="{lx + 16}" y="{ly + 10}" font-size="11">{esc(label)}</text>'
        )
        lx += 130
    out.append("</svg>")
    if cap_note:
        out.append(f'<p class="note">{esc(cap_note)}</p>')
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
                f"<title>rank {a} -&gt; rank {b}: {esc(fmt_bytes(v))} per step</title></rect>"
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
        out.append(f'<text x="{legend_x + 24}" y="{tp + i * lh / 4 + 4:.1f}" font-size="11">{esc(fmt_bytes(vmax * t))}</text>')
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
            f'<text x="{hx + 10:.1f}" y="{hy + 18:.1f}" font-size="13" font-weight="600">host {hi}: {esc(host.name)}</text>'
            f'<text x="{hx + 10:.1f}" y="{hy + 34:.1f}" font-size="11" fill="#444">{esc(nvtxt)}; '
            f"{esc(len(host.nics))} NICs; DDR {esc(f'{host.ddr_bytes / 2**30:,.0f}')} GB</text>"
        )
        for label, gx, gy, w, gpus in items:
            svg.append(
                f'<rect x="{hx + gx:.1f}" y="{hy + gy:.1f}" width="{w:.1f}" height="{gpu_h + 22:.1f}" rx="4" '
                f'fill="#fff" stroke="#9aa" stroke-dasharray="4 2"/>'
                f'<text x="{hx + gx + 6:.1f}" y="{hy + gy + 13:.1f}" font-size="10" fill="#566">{esc(label)}</text>'
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
                    f'<text x="{x + 5:.1f}" y="{y + 25:.1f}" font-size="9" fill="#555">{esc(g.model or topology.compute_device)}</text>'
                )
                names = tables_by_rank.get(rank, [])
                per_line = max(1, int(gpu_w // 38))
                chunks = [", ".join(names[i : i + per_line]) for i in range(0, len(names), per_line)]
                for j, line in enumerate(_abbrev(chunks, gpu_lines)):
                    svg.append(f'<text class="tables" x="{x + 5:.1f}" y="{y + 38 + 12 * j:.1f}" font-size="9.5">{esc(line)}</text>')
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
