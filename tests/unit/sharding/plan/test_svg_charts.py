"""sharding/plan/svg_charts.py: bar heights, heatmap colours and labels against hand-computed
geometry, the capacity line or note, and the topology figure's text."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from sharding import load_topology
from sharding.plan import svg_charts
from sharding.planner.cost.traffic import Traffic

MiB = 2**20


@pytest.mark.parametrize(
    "n, mb, text",
    [
        (512, "0.0 MB", "512 B"),
        (1536, "0.0 MB", "1.5 KB"),
        (1.5 * MiB, "1.5 MB", "1.5 MB"),
        (2**30 - 1, "1,024.0 MB", "1,024.0 MB"),
        (3 * 2**30, "3.00 GB", "3.00 GB"),
    ],
)
def test_byte_formats(n, mb, text):
    assert svg_charts.fmt_mb(n) == mb and svg_charts.fmt_bytes(n) == text


def test_esc_makes_any_value_safe_in_text_and_attributes():
    assert svg_charts.esc('<a href="x">&\'') == "&lt;a href=&quot;x&quot;&gt;&amp;&#x27;"
    assert svg_charts.esc(3) == "3"


def _attrs(svg: str, cls: str) -> list[dict[str, str]]:
    return [dict(re.findall(r'(\w[\w-]*)="([^"]*)"', m)) for m in re.findall(rf'<rect class="{cls}"([^>]*)>', svg)]


RANKS = [{"rank": 0, "hbm_bytes": 3 * MiB, "host_bytes": 1 * MiB}, {"rank": 1, "hbm_bytes": 1 * MiB, "host_bytes": 0}]


def test_memory_bars_scale_to_the_fullest_rank():
    svg = svg_charts.memory_chart(RANKS)
    hbm, host = _attrs(svg, "bar hbm"), _attrs(svg, "bar host")
    # 220 px for the fullest rank's 4 MiB, from y = 20; bars 70% of a 555 px slot, starting 15% into it at x = 70
    assert [(b["x"], b["y"], b["width"], b["height"]) for b in hbm] == [
        ("153.2", "75.0", "388.5", "165.0"),
        ("708.2", "185.0", "388.5", "55.0"),
    ]
    assert [(b["y"], b["height"]) for b in host] == [("20.0", "55.0"), ("185.0", "0.0")]
    assert "<title>rank 0: HBM 3.0 MB</title>" in svg and "<title>rank 0: host 1.0 MB</title>" in svg
    assert [f"{v}.0 MB" for v in range(5)] == re.findall(r'text-anchor="end">([^<]*)</text>', svg)  # the axis
    assert "HBM capacity" not in svg


def _gpus(hbm: int, world: int = 2):
    return SimpleNamespace(world_size=world, gpu=lambda r: SimpleNamespace(hbm_bytes=hbm))


def test_memory_chart_draws_the_hbm_capacity_when_it_fits_the_scale():
    svg = svg_charts.memory_chart(RANKS, _gpus(8 * MiB))
    assert [(b["y"], b["height"]) for b in _attrs(svg, "bar hbm")] == [("157.5", "82.5"), ("212.5", "27.5")]  # scale: 8 MiB
    assert svg.count('stroke="#b3261e" stroke-width="2"') == 2 and 'y1="20.0" y2="20.0" stroke="#b3261e"' in svg
    assert ">HBM capacity</text>" in svg


def test_memory_chart_states_a_capacity_far_off_its_scale():
    svg = svg_charts.memory_chart(RANKS, _gpus(100 * MiB))
    assert svg.endswith(
        '<p class="note">HBM capacity 100.0 MB per GPU is off this scale: the fullest rank uses 3.00% of it</p>'
    )  # 3 MiB of 100 MiB
    assert 'stroke-width="2"' not in svg and ">HBM capacity</text>" not in svg


def _traffic(fwd: list[list[float]]) -> Traffic:
    w = len(fwd)
    z = np.zeros(w)
    return Traffic(
        world_size=w, batch_size_per_rank=8, fwd=np.array(fwd, dtype=float), bwd=np.zeros((w, w)), lookups=z, compute_bytes=z, uvm_bytes=z
    )


def test_heatmap_colours_cells_by_their_share_of_the_busiest():
    svg = svg_charts.heatmap(_traffic([[0, 300], [99, 0]]))
    cells = _attrs(svg, "hm-cell")
    # 160 px for 2 ranks from (60, 30): 80 px cells; white for nothing, dark red for the most, 0.33 of it light blue
    assert [(c["x"], c["y"], c["width"], c["fill"]) for c in cells] == [
        ("60.00", "30.00", "80.00", "#ffffff"),
        ("140.00", "30.00", "80.00", "#67000d"),
        ("60.00", "110.00", "80.00", "#9ecae1"),
        ("140.00", "110.00", "80.00", "#ffffff"),
    ]
    assert "<title>rank 0 -&gt; rank 1: 300 B per step</title>" in svg and "<title>rank 1 -&gt; rank 0: 99 B per step</title>" in svg
    assert [f"{v} B" for v in (300, 225, 150, 75, 0)] == re.findall(r'font-size="11">(\d+ B)</text>', svg)  # the legend


def test_heatmap_marks_host_boundaries():
    hosts = SimpleNamespace(world_size=4, hosts=[0, 1], local_world_size=2)
    svg = svg_charts.heatmap(_traffic([[0] * 4] * 4), hosts)
    # 4 ranks: 160 px, 40 px cells; host 1 starts at rank 2, 80 px in
    assert '<line x1="140.0" x2="140.0" y1="30" y2="190" stroke="#222"' in svg
    assert '<line x1="60" x2="220" y1="110.0" y2="110.0" stroke="#222"' in svg
    assert {c["fill"] for c in _attrs(svg, "hm-cell")} == {"#ffffff"}  # no traffic at all: every cell white


def test_topology_diagram_lists_each_gpus_tables_and_marks_the_critical_rank():
    topo = load_topology("workstation-4gpu-nvlink-pairs")
    names = [f"t{i}" for i in range(60)]
    svg = svg_charts.topology_diagram(topo, {0: ["a<b", "c"], 2: names}, critical=2)
    assert "host 0: workstation</text>" in svg and "NVLink islands {0,1} {2,3}; 1 NICs; DDR 256 GB</text>" in svg
    assert [f"rp{i} (NUMA 0)" for i in range(4)] == re.findall(r'fill="#566">([^<]*)</text>', svg)
    gpus = re.findall(r'<g class="gpu">(.*?)</g>', svg, re.S)
    assert [re.search(r">(rank \d+ · gpu\d+)<", g).group(1) for g in gpus] == [f"rank {i} · gpu{i}" for i in range(4)]
    assert ">a&lt;b, c</text>" in gpus[0] and ">(no tables)</text>" in gpus[1] and ">(no tables)</text>" in gpus[3]
    assert 'stroke="#b3261e" stroke-width="2"' in gpus[2] and "#b3261e" not in gpus[0] + gpus[1] + gpus[3]
    lines = re.findall(r'<text class="tables"[^>]*>([^<]*)</text>', gpus[2])
    assert len(lines) == 7 and lines[-1].startswith("+") and lines[-1].endswith(" more")  # 60 names, abbreviated to 7 lines
    assert lines[0].startswith("t0, t1, ")
