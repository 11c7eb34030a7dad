"""The `nvidia-smi topo -m` importer (sharding/topology/nvidia_smi.py): the matrix plus capacities
read into a host, GPU models and their presets, the command line (fast: no torch).

Every sample in ../shared/data/topo/ (RECSYS_SHARED_DIR overrides ../shared) is imported as posted
and in variants made here (tabs as nvidia-smi prints them, spaces at other widths, empty affinity
cells, trailing spaces, CRLF, cut legends, model lines appended). The expected structure of each
sample (GPU count, NVLink, PCIe groups, NUMA nodes, NICs) is written below by reading the file,
not by running the importer.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from sharding.topology.bandwidth import bandwidth_matrix, host_to_gpu_bandwidth, nearest_nic, pair_bandwidth, shared_uplink_groups
from sharding.topology.cluster import GB, ClusterTopology, Gpu, Host, Network, Nic, NumaNode, NvlinkSpec, PcieSwitch, TopologyError
from sharding.topology.gpu_presets import PRESETS
from sharding.topology.nvidia_smi import GpuSpecs, import_topo, parse_topo_matrix, resolve_gpus, topology_from_matrix, yaml_header
from sharding.topology.nvidia_smi import main as import_main
from sharding.topology.topology_dump import dump_topology
from sharding.topology.topology_file import load_topology

GBs = 1e9
TOPO_DATA = Path(os.environ.get("RECSYS_SHARED_DIR") or Path(__file__).resolve().parents[5] / "shared") / "data" / "topo"
CAPS = dict(hbm_gb=80, hbm_bw_gb_s=2000, ddr_gb=512, ddr_bw_gb_s=150, nic_gbit_s=200, pcie_gen=4)


# --- what each sample says, read by hand ---------------------------------------------------------
# numa: the GPUs' NUMA ids from the affinity columns; numa_matrix: the GPU partition that the matrix
# alone gives (SYS = between NUMA nodes) when the affinity cells are empty; switches: (members, the
# members of its parent switch or None) by header names; nics: header name -> (final name, NUMA).

V100_PAIRS = {
    (0, 1): 1,
    (0, 2): 1,
    (0, 3): 2,
    (0, 4): 2,
    (1, 2): 2,
    (1, 3): 1,
    (1, 5): 2,
    (2, 3): 2,
    (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1,
    (4, 6): 1,
    (4, 7): 2,
    (5, 6): 2,
    (5, 7): 1,
    (6, 7): 2,
}
EXPECTED = {
    "2x-a100-nv12-mlx5-columns-tabs.txt": dict(
        gpus=2,
        model="NVIDIA A100-SXM4-80GB",
        hbm=(80, 2039),
        nvlink=("pairs", {(0, 1): 12}),
        numa=[1, 1],
        numa_matrix=[{0, 1}],
        # PIX pairs of NICs; GPU0/1 are PXB to mlx5_6/7: the NIC pair is a leaf inside that group
        switches={
            (("GPU0", "GPU1"), None),
            (("mlx5_6", "mlx5_7"), ("GPU0", "GPU1")),
            (("mlx5_0", "mlx5_1"), None),
            (("mlx5_2", "mlx5_3"), None),
            (("mlx5_4", "mlx5_5"), None),
        },
        # mlx5_4..7 NODE/PXB with the GPUs (NUMA 1); mlx5_0..3 SYS to both GPUs: a node of their own
        nics={
            "mlx5_0": ("mlx5_0", 0),
            "mlx5_1": ("mlx5_1", 0),
            "mlx5_2": ("mlx5_2", 0),
            "mlx5_3": ("mlx5_3", 0),
            "mlx5_4": ("mlx5_4", 1),
            "mlx5_5": ("mlx5_5", 1),
            "mlx5_6": ("mlx5_6", 1),
            "mlx5_7": ("mlx5_7", 1),
        },
    ),
    "4x-l40s-2socket-2nic-nic-legend.txt": dict(
        gpus=4,
        model="NVIDIA L40S",
        hbm=(48, 864),
        nvlink=("none", {}),
        numa=[0, 0, 1, 1],
        numa_matrix=[{0, 1}, {2, 3}],
        switches={(("GPU0",), None), (("GPU1",), None), (("GPU2",), None), (("GPU3",), None), (("NIC0", "NIC1"), None)},
        nics={"NIC0": ("mlx5_0", 1), "NIC1": ("mlx5_1", 1)},  # NODE with GPU2/3
    ),
    "4x-rtx3090-nvlink-bridge-pairs-nv4.txt": dict(
        gpus=4,
        model="NVIDIA GeForce RTX 3090",
        hbm=(24, 936),
        nvlink=("pairs", {(0, 2): 4, (1, 3): 4}),
        numa=[0, 0, 0, 0],
        numa_matrix=[{0, 1, 2, 3}],
        switches={(("GPU0",), None), (("GPU1",), None), (("GPU2",), None), (("GPU3",), None)},
        nics={},
    ),
    "8x-h100-sxm-nv18-no-nic.txt": dict(
        gpus=8,
        model="NVIDIA H100 80GB HBM3",
        hbm=(80, 3350),
        nvlink=("nvswitch", 18),
        numa=[0, 0, 0, 0, 1, 1, 1, 1],
        numa_matrix=[set(range(8))],  # NV18 everywhere: no SYS to split
        switches={((f"GPU{i}",), None) for i in range(8)},
        nics={},
    ),
    "8x-rtx4090-2socket-2nic-tabs.txt": dict(
        gpus=8,
        model="NVIDIA GeForce RTX 4090",
        hbm=(24, 1008),
        nvlink=("none", {}),
        # every GPU pair is SYS: by the legend's definition, eight nodes when no affinity is given
        numa=[0, 0, 0, 0, 1, 1, 1, 1],
        numa_matrix=[{i} for i in range(8)],
        switches={((f"GPU{i}",), None) for i in range(8)} | {(("NIC0", "NIC1"), None)},
        nics={"NIC0": ("NIC0", 1), "NIC1": ("NIC1", 1)},  # PHB with GPU6 (NUMA 1)
    ),
    "8x-v100-sxm2-hybrid-cube-mesh-nv1-nv2.txt": dict(
        gpus=8,
        model="Tesla V100-SXM2-32GB",
        hbm=(32, 900),
        nvlink=("pairs", V100_PAIRS),
        numa=[0, 0, 0, 0, 1, 1, 1, 1],
        numa_matrix=[{0, 1, 2, 3}, {4, 5, 6, 7}],  # CPU Affinity only
        switches={((f"GPU{i}",), None) for i in range(8)},
        nics={},
    ),
}


def _samples() -> list[Path]:
    if not TOPO_DATA.is_dir():
        pytest.skip(f"{TOPO_DATA} not present (set RECSYS_SHARED_DIR)")
    return sorted(TOPO_DATA.glob("*.txt"))


def _partition(values: list[int]) -> list[set[int]]:
    out: dict[int, set[int]] = {}
    for i, v in enumerate(values):
        out.setdefault(v, set()).add(i)
    return sorted(out.values(), key=min)


def _check(topo, exp: dict, *, numa: str = "numa", nic_names: dict[str, str] | None = None) -> None:
    """The imported topology against the hand-read expectations."""
    h = topo.hosts[0]
    assert topo.world_size == exp["gpus"] and len(h.gpus) == exp["gpus"]
    kind, links = exp["nvlink"]
    assert h.nvlink.kind == kind
    if kind == "nvswitch":
        assert h.nvlink.links_per_gpu == links
    elif kind == "pairs":
        assert {(a, b): n for a, b, n in h.nvlink.pairs} == links
    gpu_numa = [g.numa for g in h.gpus]
    if numa == "numa":
        assert gpu_numa == exp["numa"]
    else:
        assert _partition(gpu_numa) == exp[numa]
    names = {k: v[0] for k, v in exp["nics"].items()} if nic_names is None else nic_names
    back = {v: k for k, v in names.items()}
    got = set()
    for s in h.pcie_switches:
        members = tuple(f"GPU{g}" for g in s.gpus) + tuple(back[n] for n in s.nics)
        if not members:  # an empty parent: name it by its children
            continue
        parent = None
        if s.parent is not None:
            p = h.switch(s.parent)
            parent = tuple(f"GPU{g}" for g in p.gpus) + tuple(back[n] for n in p.nics)
        got.add((tuple(sorted(members)), parent))
    assert got == {(tuple(sorted(m)), p) for m, p in exp["switches"]}
    assert [n.name for n in h.nics] == [names[k] for k in exp["nics"]]
    if numa == "numa":
        assert {back[n.name]: n.numa for n in h.nics} == {k: v[1] for k, v in exp["nics"].items()}
    m = bandwidth_matrix(topo)
    assert np.array_equal(m, m.T)


def test_every_sample_has_expectations():
    files = _samples()
    assert [f.name for f in files] == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_as_posted(name):
    f = TOPO_DATA / name
    if not f.exists():
        pytest.skip(f"{f} not present (set RECSYS_SHARED_DIR)")
    _check(import_topo(f, **CAPS), EXPECTED[name])


# --- variants made from the samples --------------------------------------------------------------


def _table(text: str) -> tuple[list[str], list[tuple[str, list[str], dict[str, str]]], str]:
    """A simple reader for the samples as posted (every GPU row has all its affinity values):
    header names, rows (name, matrix cells, affinity column -> value), and the text after the
    matrix (legends). Not the importer's reader."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["GPU0"])
    split = (lambda ln: [c.strip() for c in ln.split("\t")]) if "\t" in lines[at] else (lambda ln: re.split(r" {2,}", ln.strip()))
    head = [c for c in split(lines[at]) if c]
    affinity = [c for c in head if " " in c]
    devices = head[: len(head) - len(affinity)]
    rows = []
    end = at + 1
    while end < len(lines) and lines[end].strip():
        cells = [c for c in split(lines[end]) if c]
        name, rest = cells[0], cells[1:]
        rows.append((name, rest[: len(devices)], dict(zip(affinity, rest[len(devices) :]))))
        end += 1
    return head, rows, "\n".join(lines[end:])


def _render_tabs(head: list[str], rows, tail: str) -> str:
    """As nvidia-smi prints: tab-separated, extra tabs so each value starts under its header
    (tab stops every 8 columns)."""
    n_dev = len([h for h in head if " " not in h])
    starts, pos = [], 8
    for h in head:
        starts.append(pos)
        pos = (pos + len(h)) // 8 * 8 + 8
    out = ["\t" + "\t".join(head)]
    for name, cells, aff in rows:
        line = name
        values = [f" {c} " if c == "X" else c for c in cells] + [aff.get(h, "") for h in head[n_dev:]]
        while values and not values[-1]:
            values.pop()
        for start, v in zip(starts, values):
            line += "\t"
            while len(line.expandtabs(8)) < start:
                line += "\t"
            line += v
        out.append(line)
    return "\n".join(out) + "\n" + tail


def _render_spaces(head, rows, tail: str, width: int) -> str:
    """Space-aligned: columns every ``width`` characters, a wider header pushes its successors
    right; values start under their header (a wider value pushes the rest of its row right)."""
    n_dev = len([h for h in head if " " not in h])
    starts, pos = [], width
    for h in head:
        starts.append(pos)
        pos = max(pos + width, pos + len(h) + 2)

    def fmt(first: str, cells: list[str]) -> str:
        line = first
        for start, c in zip(starts, cells):
            if c:
                line = line.ljust(start) if len(line) < start - 1 else line + "  "
                line += c
        return line.rstrip()

    out = [fmt("", head)]
    for name, cells, aff in rows:
        out.append(fmt(name, [f" {c}" if c == "X" else c for c in cells] + [aff.get(h, "") for h in head[n_dev:]]))
    return "\n".join(out) + "\n" + tail


def _blank(rows, *columns: str):
    return [(n, c, {k: ("" if k in columns else v) for k, v in a.items()}) for n, c, a in rows]


VARIANTS = ["tabs", "spaces8", "spaces10", "spaces14", "trailing", "crlf", "nbsp"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_variants(name, variant):
    f = TOPO_DATA / name
    if not f.exists():
        pytest.skip(f"{f} not present (set RECSYS_SHARED_DIR)")
    head, rows, tail = _table(f.read_text())
    text = {
        "tabs": lambda: _render_tabs(head, rows, tail),
        "spaces8": lambda: _render_tabs(head, rows, tail).expandtabs(8),
        "spaces10": lambda: _render_spaces(head, rows, tail, 10),
        "spaces14": lambda: _render_spaces(head, rows, tail, 14),
        "trailing": lambda: "\n".join(ln + "   " for ln in f.read_text().splitlines()) + "\n",
        "crlf": lambda: f.read_text().replace("\n", "\r\n"),
        "nbsp": lambda: f.read_text().replace("    ", "\xa0   "),
    }[variant]()
    _check(_import_text(text, name), EXPECTED[name])


def _import_text(text: str, name: str, **kw):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        p.write_text(text)
        return import_topo(p, **{**CAPS, **kw})


EMPTY = {
    "cpu": ("CPU Affinity",),
    "cpu+numa": ("CPU Affinity", "NUMA Affinity"),
    "all": ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID"),
}


@pytest.mark.parametrize("render", ["tabs", "spaces8", "spaces14"])
@pytest.mark.parametrize("empty", sorted(EMPTY))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_with_empty_affinity_cells(name, empty, render):
    """Empty affinity cells (VMs, containers): values are placed by their column under the header;
    without NUMA Affinity, CPU Affinity; without either, the matrix gives the NUMA nodes."""
    f = TOPO_DATA / name
    if not f.exists():
        pytest.skip(f"{f} not present (set RECSYS_SHARED_DIR)")
    head, rows, tail = _table(f.read_text())
    blanked = _blank(rows, *EMPTY[empty])
    text = _render_tabs(head, blanked, tail)
    if render == "spaces8":
        text = text.expandtabs(8)
    elif render == "spaces14":
        text = _render_spaces(head, blanked, tail, 14)
    mx = parse_topo_matrix(text, name)
    for g, _, aff in blanked:
        for col, key in (("CPU Affinity", "cpu_affinity"), ("NUMA Affinity", "numa_affinity")):
            assert getattr(mx, key).get(g, "") == aff.get(col, ""), (g, col)
    has_numa = "NUMA Affinity" in head and "NUMA Affinity" not in EMPTY[empty]
    has_cpu = "CPU Affinity" not in EMPTY[empty]
    _check(_import_text(text, name), EXPECTED[name], numa="numa" if has_numa or has_cpu else "numa_matrix")


def test_space_aligned_empty_affinity_as_reported():
    """An output seen in the field: space-aligned, CPU and NUMA Affinity empty, GPU NUMA ID present
    (it used to fail with "11 cells after 'GPU0', expected 13")."""
    head = ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4", "GPU5", "GPU6", "GPU7", "NIC0", "NIC1", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    text = "        " + "".join(h.ljust(8) for h in head[:10]) + "CPU Affinity    NUMA Affinity   GPU NUMA ID   \n"
    for i in range(10):
        cells = ["X" if j == i else ("PIX" if {i, j} == {8, 9} else "NV18" if i < 8 and j < 8 else "SYS") for j in range(10)]
        row = (f"GPU{i}" if i < 8 else f"NIC{i - 8}").ljust(8) + "".join((f" {c}" if c == "X" else c).ljust(8) for c in cells)
        if i < 8:
            row += " " * 32 + "N/A"
        text += row + "   \n"
    mx = parse_topo_matrix(text, "vm.txt")
    assert mx.cpu_affinity == {} and mx.numa_affinity == {} and len(mx.devices) == 10
    t = _import_text(text, "vm.txt")
    assert t.hosts[0].nvlink.kind == "nvswitch" and [g.numa for g in t.hosts[0].gpus] == [0] * 8


CUTS = {
    "no-legend": lambda t: t.split("\nLegend:")[0] + "\n",
    "legend-cut-midline": lambda t: t[: t.index("PHB  = Connection") + 10] if "PHB  = Connection" in t else t,
    "no-nic-legend": lambda t: t.split("\nNIC Legend:")[0] + "\n",
    "nic-legend-first-only": lambda t: t[: t.index("  NIC1: ")] if "  NIC1: " in t else t,
    "no-blank-before-legend": lambda t: re.sub(r"\n\n+Legend:", "\nLegend:", t),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_with_cut_legends(name, cut):
    f = TOPO_DATA / name
    if not f.exists():
        pytest.skip(f"{f} not present (set RECSYS_SHARED_DIR)")
    text = CUTS[cut](f.read_text())
    names = {k: v[0] for k, v in EXPECTED[name]["nics"].items()}
    if "NIC Legend" in f.read_text():  # NICs keep the names the legend no longer gives
        if cut in ("no-legend", "no-nic-legend", "legend-cut-midline"):
            names = {k: k for k in names}
        elif cut == "nic-legend-first-only":
            names = {k: (v if k == "NIC0" else k) for k, v in names.items()}
    _check(_import_text(text, name), EXPECTED[name], nic_names=names)


# --- GPU models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_model_from_appended_nvidia_smi_L(name, tmp_path):
    """`nvidia-smi topo -m > f; nvidia-smi -L >> f`: no capacity flag needed; the spec-sheet
    figures (written here, not read from the presets) land in the YAML."""
    f = TOPO_DATA / name
    if not f.exists():
        pytest.skip(f"{f} not present (set RECSYS_SHARED_DIR)")
    exp = EXPECTED[name]
    lines = "".join(f"GPU {i}: {exp['model']} (UUID: GPU-{i:08x}-0000-0000-0000-000000000000)\n" for i in range(exp["gpus"]))
    p = tmp_path / name
    p.write_text(f.read_text().rstrip("\n") + "\n\n" + lines)
    out = tmp_path / "out.yaml"
    assert import_main([str(p), "-o", str(out)]) == 0
    t = load_topology(out)
    _check(t, exp)
    hbm_gb, bw = exp["hbm"]
    assert all(g.hbm_bytes == hbm_gb * GB and g.hbm_bw == pytest.approx(bw * GBs) for g in t.hosts[0].gpus)
    first = out.read_text().splitlines()[0]
    assert first.startswith(f"# imported from {name} by sharding.topology.nvidia_smi; GPU capacities from the preset ")
    assert str(tmp_path) not in out.read_text()


def test_model_from_query_gpu_name_lines(tmp_path):
    text = SMALL + "\nname\nNVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3\n"
    t = _import_text(text, "q.txt", hbm_gb=None, hbm_bw_gb_s=None, pcie_gen=None)
    g = t.hosts[0].gpus
    assert [x.model for x in g] == ["H100-SXM5-80GB"] * 2 and g[0].hbm_bytes == 80 * GB and g[0].hbm_bw == 3350 * GBs
    # the preset's NVLink and PCIe: 25 GB/s per NVLink 4 link per direction, Gen5 x16 = 50 GB/s
    assert t.hosts[0].nvlink.link_bw == 25 * GBs and t.hosts[0].pcie_switches[0].port_bw == 50 * GBs


def test_two_models_from_nvidia_smi_L(tmp_path):
    """GPUs of different models get their own capacities; the YAML lists them one by one."""
    f = tmp_path / "mixed.txt"
    f.write_text(SMALL + "GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-a)\nGPU 1: NVIDIA RTX A6000 (UUID: GPU-b)\n")
    out = tmp_path / "mixed.yaml"
    assert import_main([str(f), "-o", str(out)]) == 0
    g = load_topology(out).hosts[0].gpus
    assert [(x.model, x.hbm_bytes / GB, x.hbm_bw / GBs) for x in g] == [("RTX 3090", 24, 936), ("RTX A6000", 48, 768)]
    assert out.read_text().splitlines()[0].endswith("from the presets RTX A6000 (48 GB, 768 GB/s), RTX 3090 (24 GB, 936 GB/s)")


def test_gpu_flag_presets_and_overrides(tmp_path):
    f = tmp_path / "r.txt"
    f.write_text(SMALL)
    out = tmp_path / "r.yaml"
    assert import_main([str(f), "--gpu", "NVIDIA RTX A6000", "-o", str(out)]) == 0
    h = load_topology(out).hosts[0]
    assert h.gpus[0].hbm_bytes == 48 * GB and h.gpus[0].hbm_bw == 768 * GBs
    assert h.nvlink.bandwidth(0, 1) == pytest.approx(4 * 14.0625 * GBs)  # NV4 bridge: 112.5 GB/s both ways
    # an explicit capacity beats the preset, the rest stays the preset's
    assert import_main([str(f), "--gpu", "a6000", "--hbm-gb", "40", "-o", str(out)]) == 0
    h = load_topology(out).hosts[0]
    assert h.gpus[0].hbm_bytes == 40 * GB and h.gpus[0].hbm_bw == 768 * GBs
    assert "overridden by the command line" in out.read_text().splitlines()[0]
    # an unknown GPU with both capacities: fine, the name is a label
    assert import_main([str(f), "--gpu", "Some GPU 9000", "--hbm-gb", "12", "--hbm-bw-gb-s", "345", "-o", str(out)]) == 0
    h = load_topology(out).hosts[0]
    assert h.gpus[0].model == "Some GPU 9000" and h.gpus[0].hbm_bw == 345 * GBs


SMALL = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\t0-7\t0\nGPU1\tNV4\t X \t0-7\t0\n"


@pytest.mark.parametrize(
    "args, text, needle",
    [
        ([], SMALL, "no GPU model: name it with --gpu"),
        (
            ["--gpu", "A100"],
            SMALL,
            "GPU model 'A100' fits several presets: A100-SXM4-40GB, A100-SXM4-80GB, A100-PCIE-40GB, A100-PCIE-80GB; name one",
        ),
        (["--gpu", "L4"], SMALL, "no preset for GPU model 'L4' (known: A100-SXM4-40GB"),
        (["--gpu", "l40s"], SMALL, "the matrix has NVLink (NV4) but the L40S has none: wrong GPU model?"),
        (
            ["--gpu", "rtx3090"],
            SMALL + "GPU 0: NVIDIA RTX A6000 (UUID: GPU-1)\nGPU 1: NVIDIA RTX A6000 (UUID: GPU-2)\n",
            "--gpu 'rtx3090' but line 4 names GPU 0 'NVIDIA RTX A6000'",
        ),
        (["--hbm-gb", "80"], SMALL, "no GPU model"),
    ],
)
def test_gpu_model_errors(tmp_path, capsys, args, text, needle):
    f = tmp_path / "t.txt"
    f.write_text(text)
    out = tmp_path / "t.yaml"
    assert import_main([str(f), *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: t.txt: {needle}") and err.count("\n") == 1, err
    assert not out.exists()


def test_list_gpus(capsys):
    assert import_main(["--list-gpus"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(PRESETS) and out[0].startswith("A100-SXM4-40GB   40 GB, 1555 GB/s, NVLink 25 GB/s per link, PCIe Gen4")


# --- the two-level PCIe tree --------------------------------------------------------------------


# two sockets; on each, two leaf switches (2 GPUs + 1 NIC, PIX) inside one PXB group
def _two_level() -> str:
    names = [f"GPU{i}" for i in range(8)] + ["NIC0", "NIC1", "NIC2", "NIC3"]
    leaf = {**{f"GPU{i}": i // 2 for i in range(8)}, "NIC0": 0, "NIC1": 1, "NIC2": 2, "NIC3": 3}

    def rel(a: str, b: str) -> str:
        if a == b:
            return " X "
        if leaf[a] == leaf[b]:
            return "PIX"
        if leaf[a] // 2 == leaf[b] // 2:
            return "PXB"
        return "SYS"

    lines = ["\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity"]
    for a in names:
        aff = f"\t{'0-31' if leaf[a] < 2 else '32-63'}\t{leaf[a] // 2}" if a.startswith("GPU") else ""
        lines.append(a + "\t" + "\t".join(rel(a, b) for b in names) + aff)
    return "\n".join(lines) + "\n"


def test_pix_inside_pxb_is_two_levels(tmp_path):
    t = _import_text(_two_level(), "two.txt", nic_gbit_s=200)
    h = t.hosts[0]
    leaves = {(s.gpus, s.nics): s.parent for s in h.pcie_switches if s.gpus}
    parents = {s.name: s for s in h.pcie_switches if not s.gpus}
    assert set(leaves) == {((0, 1), ("NIC0",)), ((2, 3), ("NIC1",)), ((4, 5), ("NIC2",)), ((6, 7), ("NIC3",))}
    assert len(parents) == 2 and all(p in parents for p in leaves.values())
    assert leaves[((0, 1), ("NIC0",))] == leaves[((2, 3), ("NIC1",))] != leaves[((4, 5), ("NIC2",))]
    assert [g.numa for g in h.gpus] == [0] * 4 + [1] * 4
    pcie = 25 * GBs
    # same leaf: the two ports; across leaves of one group: each leaf's uplink, shared by its 2 GPUs,
    # not the group's uplink; across sockets: the group's uplink too (4 GPUs) and the socket link
    assert pair_bandwidth(t, 0, 1) == pytest.approx(pcie)
    assert pair_bandwidth(t, 0, 2) == pytest.approx(pcie / 2)
    assert pair_bandwidth(t, 0, 2, shared=False) == pytest.approx(pcie)
    assert pair_bandwidth(t, 0, 4) == pytest.approx(min(pcie / 4, 64 * GBs / 4))
    assert host_to_gpu_bandwidth(t, 0) == pytest.approx(pcie / 4)  # through the group's uplink
    groups = {g.switch: g.ranks for g in shared_uplink_groups(t)}
    assert sorted(len(r) for r in groups.values()) == [2, 2, 2, 2, 4, 4]
    assert [nearest_nic(h, i).name for i in range(8)] == ["NIC0", "NIC0", "NIC1", "NIC1", "NIC2", "NIC2", "NIC3", "NIC3"]
    # the YAML keeps the tree
    back = tmp_path / "two.yaml"
    back.write_text(dump_topology(t))
    assert load_topology(back).hosts[0].pcie_switches == h.pcie_switches


def test_a100_nic_pair_inside_the_gpu_group():
    f = TOPO_DATA / "2x-a100-nv12-mlx5-columns-tabs.txt"
    if not f.exists():
        pytest.skip(f"{f} not present (set RECSYS_SHARED_DIR)")
    t = import_topo(f, **CAPS)
    h = t.hosts[0]
    sw = h.switch(h.gpus[0].pcie_switch)
    assert sw.gpus == (0, 1) and sw.nics == () and sw.parent is None
    leaf = h.switch(h.nic("mlx5_6").pcie_switch)
    assert leaf.nics == ("mlx5_6", "mlx5_7") and leaf.parent == sw.name
    assert nearest_nic(h, 0).name == "mlx5_6" and nearest_nic(h, 1).name == "mlx5_7"


def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    f = tmp_path / "bad.txt"
    f.write_text(SMALL.replace("NV4\t0-7", "NVX\t0-7", 1))
    out = tmp_path / "bad.yaml"
    assert import_main([str(f), "--gpu", "rtx3090", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "error: bad.txt: line 2, column 10: unknown token 'NVX' (GPU0 to GPU1)\n"
    assert not out.exists() and list(tmp_path.iterdir()) == [f]
    assert import_main([str(tmp_path / "missing.txt"), "--gpu", "t4"]) == 2
    assert capsys.readouterr().err == "error: missing.txt: cannot read: No such file or directory\n"


# --- the pieces: capacities, the host built from a matrix, the command line ----------------------


def test_resolve_gpus_from_a_preset_or_the_command_line():
    mx = parse_topo_matrix(SMALL, "t.txt")
    assert resolve_gpus(mx, gpu_model="rtx3090", source="t.txt") == GpuSpecs(
        ("RTX 3090", "RTX 3090"), (24, 24), (936, 936), 14.0625, 4, "GPU capacities from the preset RTX 3090 (24 GB, 936 GB/s)"
    )
    # both capacities given: the name is only a label, NVLink and PCIe take the defaults
    assert resolve_gpus(mx, gpu_model="Mystery", hbm_gb=12, hbm_bw_gb_s=300) == GpuSpecs(
        ("Mystery", "Mystery"), (12, 12), (300, 300), 25.0, 4, "GPU capacities from the command line"
    )
    # an NVLink speed given explicitly is not checked against the model
    assert resolve_gpus(mx, gpu_model="l40s", nvlink_link_gb_s=10).nvlink_link_gb_s == 10
    with pytest.raises(TopologyError, match=r"^t\.txt: pcie_gen 7: expected one of \[3, 4, 5, 6\]$"):
        resolve_gpus(mx, gpu_model="rtx3090", pcie_gen=7, source="t.txt")


def _matrix(cells: dict[tuple[str, str], str], devices: list[str], affinity: dict[str, str]) -> str:
    lines = ["\t" + "\t".join(devices) + "\tCPU Affinity"]
    for a in devices:
        row = [" X " if a == b else cells.get((a, b)) or cells[(b, a)] for b in devices]
        lines.append("\t".join([a, *row] + ([affinity[a]] if a in affinity else [])))
    return "\n".join(lines) + "\n"


def test_topology_from_matrix_worked_by_hand():
    """Four GPUs, NV2 between every pair (one NVSwitch domain), each on its own root port, two
    sockets by CPU Affinity; a NIC SYS to every GPU: on no switch, a NUMA node of its own."""
    gpus = [f"GPU{i}" for i in range(4)]
    cells = {(a, b): "NV2" for a in gpus for b in gpus if a != b} | {(g, "NIC0"): "SYS" for g in gpus}
    text = _matrix(cells, gpus + ["NIC0"], {"GPU0": "0-7", "GPU1": "0-7", "GPU2": "8-15", "GPU3": "8-15"})
    caps = dict(ddr_gb=64, ddr_bw_gb_s=40, nic_gbit_s=100, pcie_gen=3, nvlink_link_gb_s=20, inter_socket_gb_s=30)
    t = topology_from_matrix(parse_topo_matrix(text), hbm_gb=16, hbm_bw_gb_s=500, host_name="box", name="mine", source="m.txt", **caps)
    numa = [0, 0, 1, 1]
    port = 12.5 * GBs  # Gen3 x16
    assert t == ClusterTopology(
        (
            Host(
                "box",
                tuple(Gpu(i, 16 * GB, 500 * GBs, f"rp{i}", numa[i], "") for i in range(4)),
                NvlinkSpec("nvswitch", 20 * GBs, 2),
                tuple(PcieSwitch(f"rp{i}", numa[i], port, port, (i,)) for i in range(4)),
                tuple(NumaNode(i, 64 * GB, 40 * GBs) for i in range(3)),
                30 * GBs,
                (Nic("NIC0", 12.5 * GBs, None, 2),),
            ),
        ),
        Network(),
        "cuda",
        "mine",
        "m.txt",
    )


def test_gpus_must_be_numbered_from_zero():
    text = "\tGPU0\tGPU2\nGPU0\t X \tPIX\nGPU2\tPIX\t X \n"
    with pytest.raises(TopologyError, match=r"^g\.txt: GPUs must be numbered 0\.\.1, got GPU0, GPU2$"):
        topology_from_matrix(parse_topo_matrix(text, "g.txt"), gpu_model="t4", source="g.txt")


def test_import_topo_refuses_unknown_arguments(tmp_path):
    f = tmp_path / "r.txt"
    f.write_text(SMALL)
    t = import_topo(f, gpu_model="rtx3090", ddr_gb=32)
    assert (t.name, t.source, t.hosts[0].name, t.hosts[0].numa_nodes[0].ddr_bytes) == ("r", "r.txt", "host", 32 * GB)
    with pytest.raises(TypeError, match=r"^import_topo\(\) got unexpected keyword arguments: colour, size$"):
        import_topo(f, gpu_model="rtx3090", size=1, colour="red")


def test_yaml_header_names_the_file_not_its_path():
    assert yaml_header("/home/me/topo.txt", "GPU capacities from the command line") == (
        "imported from topo.txt by sharding.topology.nvidia_smi; GPU capacities from the command line"
    )


def test_cli_writes_yaml_to_stdout_and_reads_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(SMALL))
    assert import_main(["-", "--gpu", "rtx3090", "--host-name", "ws", "--name", "desk"]) == 0
    out = capsys.readouterr().out
    assert (
        out.splitlines()[0]
        == "# imported from <stdin> by sharding.topology.nvidia_smi; GPU capacities from the preset RTX 3090 (24 GB, 936 GB/s)"
    )
    d = yaml.safe_load(out)
    assert (d["name"], d["hosts"][0]["name"], d["hosts"][0]["nvlink"]) == (
        "desk",
        "ws",
        {"kind": "pairs", "link_gb_s": 14.0625, "pairs": [[0, 1, 4]]},
    )


def test_cli_needs_a_file(capsys):
    with pytest.raises(SystemExit, match="^2$"):
        import_main([])
    assert capsys.readouterr().err.endswith("error: the topo file is required (or --list-gpus)\n")
