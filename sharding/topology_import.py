"""Import a host's topology from ``nvidia-smi topo -m`` output, completed by capacities.

The matrix says how devices connect, not how fast or how big: HBM, DDR, NIC speeds and PCIe
generation come from arguments. What is read from the matrix:

- NVLink: ``NV#`` cells give pairs with link counts; when every pair of 3+ GPUs has the same
  ``NV#`` it is one NVSwitch domain (``kind: nvswitch``).
- PCIe switches: devices joined by ``PIX``/``PXB`` cells (connected components) sit behind one
  switch; a GPU with no such peer gets a switch of its own (its root port). ``NV#`` cells hide the
  PCIe relation of two GPUs, so a component can only be seen through a shared NIC.
- NUMA: the ``NUMA Affinity`` column; without it (or ``N/A``), GPUs with the same ``CPU Affinity``
  share a node, numbered by their lowest CPU. A NIC takes its switch's node, else the node of a
  GPU it is ``PHB``/``NODE`` with, else (``SYS`` to every GPU) a node of its own.
- NIC names: ``NICn`` columns are renamed by the ``NIC Legend`` block when present (``mlx5_0``).

Format: the header row names GPU0..N and NICs (``NIC0`` or, from older drivers, ``mlx5_0``), then
``CPU Affinity``, ``NUMA Affinity``, ``GPU NUMA ID`` (any subset). Cells are separated by tabs or
spaces; empty cells are ignored. NIC rows may carry only the matrix cells. Errors name the line
and the column (1-based character column of the cell).

Command line::

    python -m sharding.topology_import topo.txt --hbm-gb 80 --hbm-bw-gb-s 2039 \\
        --ddr-gb 1024 --ddr-bw-gb-s 204.8 --nic-gbit-s 200 --pcie-gen 4 -o configs/topologies/mine.yaml
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from sharding.topology import (
    GB,
    GB_S,
    GBIT_S,
    ClusterTopology,
    Gpu,
    Host,
    Network,
    Nic,
    NumaNode,
    NvlinkSpec,
    PcieSwitch,
    TopologyError,
    dump_topology,
)

# Effective x16 bandwidth per PCIe generation (GB/s, one direction); raw is 15.75 / 31.5 / 63.
PCIE_X16_GB_S = {3: 12.5, 4: 25.0, 5: 50.0, 6: 100.0}
PCIE_TOKENS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_AFFINITY = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_NV = re.compile(r"NV(\d+)$")
_GPU = re.compile(r"GPU(\d+)$")


@dataclass(frozen=True)
class TopoMatrix:
    """The parsed matrix: device names (GPUs first as in the header), cells, affinity columns."""

    devices: tuple[str, ...]  # header names, e.g. GPU0.., NIC0.. / mlx5_0..
    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    cells: dict[tuple[str, str], str]  # (row, col) -> X / NV# / PIX / ... (SOC read as SYS)
    cpu_affinity: dict[str, str]
    numa_affinity: dict[str, str]
    nic_legend: dict[str, str]  # NIC0 -> mlx5_0


def _cells(line: str) -> list[tuple[int, str]]:
    """(1-based column, text) of each non-empty cell; cells are tab- or space-separated."""
    return [(m.start() + 1, m.group()) for m in re.finditer(r"\S+", line)]


def _header_names(line: str) -> list[str]:
    parts = line.split("\t") if "\t" in line else re.split(r" {2,}", line)
    return [p.strip() for p in parts if p.strip()]


def parse_topo_matrix(text: str, source: str = "topo.txt") -> TopoMatrix:
    lines = text.splitlines()
    header_at = next(
        (i for i, ln in enumerate(lines) if _header_names(ln) and _header_names(ln)[0] == "GPU0"), None
    )
    if header_at is None:
        raise TopologyError(f"{source}: no header row naming GPU0 (is this `nvidia-smi topo -m` output?)")
    names = _header_names(lines[header_at])
    devices: list[str] = []
    extra: list[str] = []
    for n in names:
        if n in _AFFINITY or extra:
            extra.append(n)
        elif " " in n:
            raise TopologyError(f"{source}: line {header_at + 1}: unknown header column '{n}'")
        else:
            devices.append(n)
    if len(set(devices)) != len(devices):
        raise TopologyError(f"{source}: line {header_at + 1}: a device is named twice in the header")
    gpus = tuple(d for d in devices if _GPU.match(d))
    nics = tuple(d for d in devices if not _GPU.match(d))
    n_dev = len(devices)

    cells: dict[tuple[str, str], str] = {}
    where: dict[tuple[str, str], tuple[int, int]] = {}
    cpu_aff: dict[str, str] = {}
    numa_aff: dict[str, str] = {}
    legend: dict[str, str] = {}
    seen_rows: set[str] = set()
    in_matrix, in_nic_legend = True, False
    for ln_no, line in enumerate(lines[header_at + 1 :], start=header_at + 2):
        stripped = line.strip()
        if not stripped:
            in_matrix = in_matrix and not seen_rows
            continue
        if stripped.startswith("NIC Legend"):
            in_matrix, in_nic_legend = False, True
            continue
        if stripped.startswith("Legend"):
            in_matrix, in_nic_legend = False, False
            continue
        if in_nic_legend:
            m = re.match(r"(\S+)\s*:\s*(\S+)$", stripped)
            if m:
                legend[m.group(1)] = m.group(2)
            continue
        if not in_matrix:
            continue
        row = _cells(line)
        name = row[0][1]
        if name not in devices:
            raise TopologyError(f"{source}: line {ln_no}, column {row[0][0]}: unknown row '{name}' (header names {', '.join(devices)})")
        if name in seen_rows:
            raise TopologyError(f"{source}: line {ln_no}: row '{name}' appears twice")
        seen_rows.add(name)
        rest = row[1:]
        full = n_dev + len(extra)
        allowed = (full,) if name in gpus else (n_dev, full)
        if len(rest) not in allowed:
            raise TopologyError(f"{source}: line {ln_no}: {len(rest)} cells after '{name}', expected {full}")
        for (col, tok), other in zip(rest[:n_dev], devices):
            tok_n = "SYS" if tok == "SOC" else tok
            ok = tok_n in PCIE_TOKENS or tok_n == "X" or (_NV.match(tok_n) and int(_NV.match(tok_n).group(1)) > 0)
            if not ok:
                raise TopologyError(f"{source}: line {ln_no}, column {col}: unknown token '{tok}' ({name} to {other})")
            if (tok_n == "X") != (other == name):
                want = "'X' only on the diagonal" if tok_n == "X" else "'X' on the diagonal"
                raise TopologyError(f"{source}: line {ln_no}, column {col}: got '{tok}' for {name} to {other}, expected {want}")
            back = cells.get((other, name))
            if back is not None and back != tok_n:
                raise TopologyError(
                    f"{source}: line {ln_no}, column {col}: {name} to {other} is '{tok}' but {other} to {name} "
                    f"(line {where[(other, name)][0]}) is '{back}'"
                )
            cells[(name, other)] = tok_n
            where[(name, other)] = (ln_no, col)
        for (col, val), key in zip(rest[n_dev:], extra):
            if key == "CPU Affinity":
                cpu_aff[name] = val
            elif key == "NUMA Affinity":
                numa_aff[name] = val
    missing = [d for d in devices if d not in seen_rows]
    if missing:
        raise TopologyError(f"{source}: no row for {missing[0]} (the header names {n_dev} devices)")
    return TopoMatrix(tuple(devices), gpus, nics, cells, cpu_aff, numa_aff, legend)


def _first_cpu(aff: str) -> int:
    m = re.match(r"(\d+)", aff)
    return int(m.group(1)) if m else 10**9


def _gpu_numa(mx: TopoMatrix) -> dict[str, int]:
    numa: dict[str, int] = {}
    if mx.numa_affinity and all(re.match(r"\d+", mx.numa_affinity.get(g, "")) for g in mx.gpus):
        for g in mx.gpus:
            numa[g] = int(re.match(r"\d+", mx.numa_affinity[g]).group())
        return numa
    if mx.cpu_affinity and all(g in mx.cpu_affinity for g in mx.gpus):
        groups = sorted({mx.cpu_affinity[g] for g in mx.gpus}, key=_first_cpu)
        return {g: groups.index(mx.cpu_affinity[g]) for g in mx.gpus}
    return {g: 0 for g in mx.gpus}


def topology_from_matrix(
    mx: TopoMatrix,
    *,
    hbm_gb: float,
    hbm_bw_gb_s: float,
    ddr_gb: float = 512,
    ddr_bw_gb_s: float = 150,
    nic_gbit_s: float = 200,
    pcie_gen: int = 4,
    nvlink_link_gb_s: float = 25,
    inter_socket_gb_s: float = 64,
    host_name: str = "host",
    gpu_model: str = "",
    name: str = "",
    source: str = "",
) -> ClusterTopology:
    """The matrix plus capacities -> a one-host :class:`ClusterTopology`."""
    if pcie_gen not in PCIE_X16_GB_S:
        raise TopologyError(f"{source}: pcie_gen {pcie_gen}: expected one of {sorted(PCIE_X16_GB_S)}")
    pcie_bw = PCIE_X16_GB_S[pcie_gen] * GB_S
    gidx = {g: int(_GPU.match(g).group(1)) for g in mx.gpus}
    if sorted(gidx.values()) != list(range(len(mx.gpus))):
        raise TopologyError(f"{source}: GPUs must be numbered 0..{len(mx.gpus) - 1}, got {', '.join(mx.gpus)}")
    cell = mx.cells.__getitem__

    # NUMA: GPUs from the affinity columns
    numa = _gpu_numa(mx)

    # PCIe switches: connected components of PIX/PXB over all devices (union-find)
    parent = {d: d for d in mx.devices}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (a, b), tok in mx.cells.items():
        if tok in ("PIX", "PXB"):
            parent[find(a)] = find(b)
    comps: dict[str, list[str]] = {}
    for d in mx.devices:
        comps.setdefault(find(d), []).append(d)

    def nic_numa_from_gpus(members: list[str]) -> int | None:
        for n in members:
            for g in mx.gpus:
                if cell((n, g)) in ("PHB", "NODE", "PIX", "PXB"):
                    return numa[g]
        return None

    # NICs SYS to every GPU: a NUMA node of their own per group of NICs that are not SYS to each other
    comp_numa: dict[str, int] = {}
    orphan: list[str] = []
    for root, members in comps.items():
        gs = [m for m in members if m in gidx]
        if gs:
            comp_numa[root] = numa[gs[0]]
        else:
            found = nic_numa_from_gpus(members)
            if found is None:
                orphan.append(root)
            else:
                comp_numa[root] = found
    # orphans (SYS to every GPU) that are not SYS to each other share a node: one new node per group
    used = set(numa.values()) | set(comp_numa.values())
    groups: list[list[str]] = []
    for root in orphan:
        for grp in groups:
            if any(cell((a, b)) != "SYS" for a in comps[root] for o in grp for b in comps[o]):
                grp.append(root)
                break
        else:
            groups.append([root])
    for grp in groups:
        new = next(i for i in range(len(used) + 1) if i not in used)
        used.add(new)
        for root in grp:
            comp_numa[root] = new

    nic_name = {n: mx.nic_legend.get(n, n) for n in mx.nics}
    switches: list[PcieSwitch] = []
    gpu_switch: dict[int, str] = {}
    nic_switch: dict[str, PcieSwitch] = {}
    for root, members in sorted(comps.items(), key=lambda kv: mx.devices.index(kv[1][0])):
        gs = sorted(gidx[m] for m in members if m in gidx)
        ns = [nic_name[m] for m in members if m in mx.nics]
        if not gs and len(ns) == 1:
            continue  # a lone NIC on a root port: no switch, attached to its NUMA node
        sname = f"sw{len(switches)}" if len(members) > 1 else f"rp{len(switches)}"
        sw = PcieSwitch(sname, comp_numa[root], pcie_bw, pcie_bw, tuple(gs), tuple(ns))
        switches.append(sw)
        for g in gs:
            gpu_switch[g] = sname
        for n in ns:
            nic_switch[n] = sw
    nics = []
    for n in mx.nics:
        nn = nic_name[n]
        sw = nic_switch.get(nn)
        nics.append(Nic(nn, nic_gbit_s * GBIT_S, sw.name if sw else None, sw.numa if sw else comp_numa[find(n)]))

    # NVLink: NV# pairs; all pairs of 3+ GPUs equal -> one NVSwitch domain
    pairs = []
    for i, a in enumerate(mx.gpus):
        for b in mx.gpus[i + 1 :]:
            m = _NV.match(cell((a, b)))
            if m:
                pairs.append((gidx[a], gidx[b], int(m.group(1))))
    n = len(mx.gpus)
    link_bw = nvlink_link_gb_s * GB_S
    if not pairs:
        nvlink = NvlinkSpec()
    elif n >= 3 and len(pairs) == n * (n - 1) // 2 and len({p[2] for p in pairs}) == 1:
        nvlink = NvlinkSpec("nvswitch", link_bw, pairs[0][2])
    else:
        nvlink = NvlinkSpec("pairs", link_bw, pairs=tuple(sorted(pairs)))

    numa_ids = sorted(set(numa.values()) | set(comp_numa.values()) | {x.numa for x in nics})
    numa_nodes = tuple(NumaNode(i, round(ddr_gb * GB), ddr_bw_gb_s * GB_S) for i in numa_ids)
    gpus = tuple(
        Gpu(i, round(hbm_gb * GB), hbm_bw_gb_s * GB_S, gpu_switch[i], numa[g], gpu_model)
        for g, i in sorted(gidx.items(), key=lambda kv: kv[1])
    )
    inter = inter_socket_gb_s * GB_S if len(numa_nodes) > 1 else math.inf
    host = Host(host_name, gpus, nvlink, tuple(switches), numa_nodes, inter, tuple(nics))
    return ClusterTopology((host,), Network(), "cuda", name or host_name, source)


def import_topo(path: str | Path, **capacities) -> ClusterTopology:
    """Reads an ``nvidia-smi topo -m`` file; ``capacities`` as in :func:`topology_from_matrix`."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TopologyError(f"{p.name}: cannot read: {e.strerror or e}") from None
    capacities.setdefault("name", p.stem)
    return topology_from_matrix(parse_topo_matrix(text, p.name), source=p.name, **capacities)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="nvidia-smi topo -m output -> topology YAML")
    ap.add_argument("topo", help="a file with `nvidia-smi topo -m` output ('-' for stdin)")
    ap.add_argument("--hbm-gb", type=float, required=True, help="GPU memory per GPU, GB")
    ap.add_argument("--hbm-bw-gb-s", type=float, required=True, help="GPU memory bandwidth, GB/s")
    ap.add_argument("--ddr-gb", type=float, default=512, help="host memory per NUMA node, GB")
    ap.add_argument("--ddr-bw-gb-s", type=float, default=150, help="DDR bandwidth per NUMA node, GB/s")
    ap.add_argument("--nic-gbit-s", type=float, default=200, help="NIC line rate, Gb/s")
    ap.add_argument("--pcie-gen", type=int, default=4, choices=sorted(PCIE_X16_GB_S))
    ap.add_argument("--nvlink-link-gb-s", type=float, default=25, help="one NVLink link, one direction, GB/s")
    ap.add_argument("--inter-socket-gb-s", type=float, default=64)
    ap.add_argument("--host-name", default="host")
    ap.add_argument("--gpu-model", default="")
    ap.add_argument("--name", default=None)
    ap.add_argument("-o", "--output", help="write the YAML here (default: stdout)")
    a = ap.parse_args(argv)
    caps = dict(
        hbm_gb=a.hbm_gb, hbm_bw_gb_s=a.hbm_bw_gb_s, ddr_gb=a.ddr_gb, ddr_bw_gb_s=a.ddr_bw_gb_s,
        nic_gbit_s=a.nic_gbit_s, pcie_gen=a.pcie_gen, nvlink_link_gb_s=a.nvlink_link_gb_s,
        inter_socket_gb_s=a.inter_socket_gb_s, host_name=a.host_name, gpu_model=a.gpu_model,
    )
    try:
        if a.topo == "-":
            topo = topology_from_matrix(parse_topo_matrix(sys.stdin.read(), "<stdin>"), name=a.name or "imported", source="<stdin>", **caps)
        else:
            if a.name:
                caps["name"] = a.name
            topo = import_topo(a.topo, **caps)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = dump_topology(topo, header=f"imported from {a.topo} by sharding.topology_import; capacities from the command line")
    if a.output:
        Path(a.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
