"""Import a host's topology from ``nvidia-smi topo -m`` output, completed by capacities.

The matrix says how devices connect, not how fast or how big. GPU memory and bandwidth, NVLink
per-link speed and PCIe generation come from the GPU model's preset (``sharding/topology/gpu_presets.py``):
the model is named with ``--gpu`` or read from ``nvidia-smi -L`` lines appended to the file;
``--hbm-gb`` / ``--hbm-bw-gb-s`` override the preset and are needed only for unknown GPUs. DDR,
NIC speeds and the socket link always come from arguments. Text format: ``sharding/topology/topo_matrix.py``.
What is read from the matrix:

- NVLink: ``NV#`` cells give pairs with link counts; when every pair of 3+ GPUs has the same
  ``NV#`` it is one NVSwitch domain (``kind: nvswitch``).
- PCIe, two levels: devices joined by ``PIX`` (at most one bridge) sit behind one leaf switch;
  leaves and devices joined by ``PXB`` (several bridges, no host bridge) sit below one parent
  switch. A group with a single leaf is one switch; a GPU with no such peer gets a switch of its
  own (its root port). ``NV#`` cells hide the PCIe relation of two GPUs, so a group can only be
  seen through a shared NIC.
- NUMA: the ``NUMA Affinity`` column; without it (or ``N/A``), GPUs with the same ``CPU Affinity``
  share a node, numbered by their lowest CPU; without either, the matrix: ``SYS`` crosses NUMA
  nodes (the legend's definition), so devices joined by ``PIX``/``PXB``/``PHB``/``NODE`` share a
  node, and groups with no ``SYS`` between them are merged (``NV#`` alone says nothing). A NIC
  takes its switch's node, else the node of a GPU it is ``PHB``/``NODE`` with, else (``SYS`` to
  every GPU) a node of its own.
- NIC names: ``NICn`` columns are renamed by the ``NIC Legend`` block when present (``mlx5_0``).

Command line::

    nvidia-smi topo -m > topo.txt; nvidia-smi -L >> topo.txt     # the model comes with the file
    python -m sharding.topology.nvidia_smi topo.txt --ddr-gb 1024 --nic-gbit-s 200 -o mine.yaml
    python -m sharding.topology.nvidia_smi topo.txt --gpu A100-SXM4-80GB -o mine.yaml  # or name it
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from sharding.topology.gpu_presets import PRESETS, GpuPreset, UnknownGpuError, find_preset, normalize, preset_names
from sharding.topology.topo_matrix import GPU, NV, TopoMatrix, parse_topo_matrix
from sharding.topology.cluster import (
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
)
from sharding.topology.topology_dump import dump_topology

__all__ = ["PCIE_X16_GB_S", "TopoMatrix", "import_topo", "main", "parse_topo_matrix", "resolve_gpus", "topology_from_matrix"]

# Effective x16 bandwidth per PCIe generation (GB/s, one direction); raw is 15.75 / 31.5 / 63.
PCIE_X16_GB_S = {3: 12.5, 4: 25.0, 5: 50.0, 6: 100.0}
DEFAULT_PCIE_GEN = 4
DEFAULT_NVLINK_LINK_GB_S = 25.0


@dataclass(frozen=True)
class GpuSpecs:
    """What the importer gives every GPU, and where it came from (for the YAML header)."""

    models: tuple[str, ...]  # per GPU index
    hbm_gb: tuple[float, ...]
    hbm_bw_gb_s: tuple[float, ...]
    nvlink_link_gb_s: float
    pcie_gen: int
    origin: str


def resolve_gpus(
    mx: TopoMatrix,
    *,
    gpu_model: str = "",
    hbm_gb: float | None = None,
    hbm_bw_gb_s: float | None = None,
    nvlink_link_gb_s: float | None = None,
    pcie_gen: int | None = None,
    source: str = "",
) -> GpuSpecs:
    """Capacities per GPU: explicit values win, then the preset of the model named by ``gpu_model``
    or by the file's ``nvidia-smi -L`` lines; an unknown model needs both explicit values."""
    n = len(mx.gpus)
    models = [gpu_model] * n if gpu_model else [mx.gpu_models.get(i, ("", 0))[0] for i in range(n)]
    if gpu_model and mx.gpu_models:
        for i, (named, line) in sorted(mx.gpu_models.items()):
            if not _same_model(named, gpu_model, source):
                raise TopologyError(f"{source}: --gpu '{gpu_model}' but line {line} names GPU {i} '{named}'")
    explicit = hbm_gb is not None and hbm_bw_gb_s is not None
    presets: list[GpuPreset | None] = []
    for m in models:
        try:
            presets.append(find_preset(m) if m else None)
        except UnknownGpuError as e:
            if not explicit:  # with both capacities given the name is only a label
                raise TopologyError(f"{source}: {e}") from None
            presets.append(None)
    if not explicit:
        if not any(models):
            raise TopologyError(
                f"{source}: no GPU model: name it with --gpu (as `nvidia-smi --query-gpu=name --format=csv,noheader` "
                "prints it), append `nvidia-smi -L` output to the file, or give --hbm-gb and --hbm-bw-gb-s"
            )
        unknown = next((m for m, p in zip(models, presets) if p is None), None)
        if unknown is not None:
            raise TopologyError(
                f"{source}: no preset for GPU model '{unknown}' (known: {', '.join(preset_names())}); give --hbm-gb and --hbm-bw-gb-s"
            )
    # here either both capacities are given or every GPU has a preset
    hbm = [hbm_gb if hbm_gb is not None else p.hbm_gb for p in presets]
    bw = [hbm_bw_gb_s if hbm_bw_gb_s is not None else p.hbm_bw_gb_s for p in presets]
    names = [p.name if p else m for m, p in zip(models, presets)]
    known = [p for p in presets if p is not None]

    nv_cells = sorted({c for (a, b), c in mx.cells.items() if NV.match(c) and a in mx.gpus and b in mx.gpus})
    no_nvlink = next((p for p in known if p.nvlink_link_gb_s == 0), None)
    if nv_cells and no_nvlink is not None and nvlink_link_gb_s is None:
        raise TopologyError(f"{source}: the matrix has NVLink ({nv_cells[0]}) but the {no_nvlink.name} has none: wrong GPU model?")
    if nvlink_link_gb_s is None:
        speeds = {p.nvlink_link_gb_s for p in known if p.nvlink_link_gb_s}
        nvlink_link_gb_s = speeds.pop() if len(speeds) == 1 else DEFAULT_NVLINK_LINK_GB_S
    if pcie_gen is None:
        gens = {p.pcie_gen for p in known if p.pcie_gen is not None}
        pcie_gen = gens.pop() if len(gens) == 1 else DEFAULT_PCIE_GEN
    if pcie_gen not in PCIE_X16_GB_S:
        raise TopologyError(f"{source}: pcie_gen {pcie_gen}: expected one of {sorted(PCIE_X16_GB_S)}")

    if explicit:
        origin = "GPU capacities from the command line"
    else:
        kinds = sorted({p.name for p in known}, key=preset_names().index)
        origin = (
            "GPU capacities from the preset"
            + ("s " if len(kinds) > 1 else " ")
            + ", ".join(f"{p} ({_preset(p).hbm_gb:g} GB, {_preset(p).hbm_bw_gb_s:g} GB/s)" for p in kinds)
        )
        if hbm_gb is not None or hbm_bw_gb_s is not None:
            origin += ", overridden by the command line"
    return GpuSpecs(tuple(names), tuple(hbm), tuple(bw), nvlink_link_gb_s, pcie_gen, origin)


def _preset(name: str) -> GpuPreset:
    p = find_preset(name)
    assert p is not None
    return p


def _same_model(a: str, b: str, source: str) -> bool:
    try:
        pa, pb = find_preset(a), find_preset(b)
    except UnknownGpuError as e:
        raise TopologyError(f"{source}: {e}") from None
    return (pa is not None and pa == pb) or normalize(a) == normalize(b)


def _first_cpu(aff: str) -> int:
    m = re.match(r"(\d+)", aff)
    return int(m.group(1)) if m else 10**9


class _Groups:
    """Union-find over device names."""

    def __init__(self, items: tuple[str, ...]):
        self.parent = {d: d for d in items}

    def find(self, x: str) -> str:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)

    def groups(self, order: tuple[str, ...]) -> list[list[str]]:
        out: dict[str, list[str]] = {}
        for d in order:
            out.setdefault(self.find(d), []).append(d)
        return list(out.values())


def _gpu_numa(mx: TopoMatrix) -> dict[str, int]:
    """NUMA node per GPU: NUMA Affinity, else CPU Affinity groups, else the matrix's SYS cells."""
    numa: dict[str, int] = {}
    if mx.numa_affinity and all(re.match(r"\d+", mx.numa_affinity.get(g, "")) for g in mx.gpus):
        for g in mx.gpus:
            numa[g] = int(re.match(r"\d+", mx.numa_affinity[g]).group())
        return numa
    if mx.cpu_affinity and all(re.match(r"\d+", mx.cpu_affinity.get(g, "")) for g in mx.gpus):
        groups = sorted({mx.cpu_affinity[g] for g in mx.gpus}, key=_first_cpu)
        return {g: groups.index(mx.cpu_affinity[g]) for g in mx.gpus}
    # the matrix alone: non-SYS PCIe cells join devices of one node, SYS separates nodes
    uf = _Groups(mx.devices)
    for (a, b), tok in mx.cells.items():
        if tok in ("PIX", "PXB", "PHB", "NODE"):
            uf.union(a, b)
    nodes: list[list[str]] = []
    for grp in uf.groups(mx.devices):
        for node in nodes:
            if not any(mx.cells[(a, b)] == "SYS" for a in grp for b in node):
                node.extend(grp)
                break
        else:
            nodes.append(list(grp))
    nodes = [nd for nd in nodes if any(d in mx.gpus for d in nd)]
    return {g: i for i, nd in enumerate(nodes) for g in nd if g in mx.gpus}


def _switch_groups(mx: TopoMatrix) -> list[list[list[str]]]:
    """PCIe groups (joined by PIX or PXB), each a list of leaves (joined by PIX), in header order."""
    pix, both = _Groups(mx.devices), _Groups(mx.devices)
    for (a, b), tok in mx.cells.items():
        if tok == "PIX":
            pix.union(a, b)
        if tok in ("PIX", "PXB"):
            both.union(a, b)
    leaves = pix.groups(mx.devices)
    return [[leaf for leaf in leaves if both.find(leaf[0]) == both.find(grp[0])] for grp in both.groups(mx.devices)]


def topology_from_matrix(
    mx: TopoMatrix,
    *,
    hbm_gb: float | None = None,
    hbm_bw_gb_s: float | None = None,
    gpu_model: str = "",
    ddr_gb: float = 512,
    ddr_bw_gb_s: float = 150,
    nic_gbit_s: float = 200,
    pcie_gen: int | None = None,
    nvlink_link_gb_s: float | None = None,
    inter_socket_gb_s: float = 64,
    host_name: str = "host",
    name: str = "",
    source: str = "",
) -> ClusterTopology:
    """The matrix plus capacities -> a one-host :class:`ClusterTopology` (capacities per
    :func:`resolve_gpus`)."""
    specs = resolve_gpus(
        mx,
        gpu_model=gpu_model,
        hbm_gb=hbm_gb,
        hbm_bw_gb_s=hbm_bw_gb_s,
        nvlink_link_gb_s=nvlink_link_gb_s,
        pcie_gen=pcie_gen,
        source=source,
    )
    return _build(mx, specs, ddr_gb, ddr_bw_gb_s, nic_gbit_s, inter_socket_gb_s, host_name, name or host_name, source)


def _build(
    mx: TopoMatrix,
    specs: GpuSpecs,
    ddr_gb: float,
    ddr_bw_gb_s: float,
    nic_gbit_s: float,
    inter_socket_gb_s: float,
    host_name: str,
    name: str,
    source: str,
) -> ClusterTopology:
    pcie_bw = PCIE_X16_GB_S[specs.pcie_gen] * GB_S
    gidx = {g: int(GPU.match(g).group(1)) for g in mx.gpus}
    if sorted(gidx.values()) != list(range(len(mx.gpus))):
        raise TopologyError(f"{source}: GPUs must be numbered 0..{len(mx.gpus) - 1}, got {', '.join(mx.gpus)}")
    cell = mx.cells.__getitem__
    numa = _gpu_numa(mx)
    groups = _switch_groups(mx)

    # NUMA of each PCIe group: its GPUs', else a GPU it is PHB/NODE with, else a node of its own
    group_numa: dict[int, int] = {}
    orphans: list[int] = []
    for k, grp in enumerate(groups):
        members = [d for leaf in grp for d in leaf]
        gs = [m for m in members if m in gidx]
        near = gs or [g for m in members for g in mx.gpus if cell((m, g)) in ("PHB", "NODE")]
        if near:
            group_numa[k] = numa[near[0]]
        else:
            orphans.append(k)
    # groups SYS to every GPU that are not SYS to each other share a node: one new node per set
    used = set(numa.values()) | set(group_numa.values())
    sets: list[list[int]] = []
    for k in orphans:
        mine = [d for leaf in groups[k] for d in leaf]
        for st in sets:
            if any(cell((a, b)) != "SYS" for a in mine for o in st for leaf in groups[o] for b in leaf):
                st.append(k)
                break
        else:
            sets.append([k])
    for st in sets:
        new = next(i for i in range(len(used) + 1) if i not in used)
        used.add(new)
        for k in st:
            group_numa[k] = new

    nic_name = {n: mx.nic_legend.get(n, n) for n in mx.nics}
    switches: list[PcieSwitch] = []
    dev_switch: dict[str, str] = {}

    def add(members: list[str], k: int, sname: str, parent: str | None) -> None:
        gs = tuple(sorted(gidx[m] for m in members if m in gidx))
        ns = tuple(nic_name[m] for m in members if m in nic_name)
        switches.append(PcieSwitch(sname, group_numa[k], pcie_bw, pcie_bw, gs, ns, parent))
        for m in members:
            dev_switch[m] = sname

    top = 0
    for k, grp in enumerate(groups):
        members = [d for leaf in grp for d in leaf]
        if len(members) == 1 and members[0] in nic_name:
            continue  # a lone NIC on a root port: no switch, attached to its NUMA node
        sname = f"sw{top}" if len(members) > 1 else f"rp{top}"
        top += 1
        inner = [leaf for leaf in grp if len(leaf) > 1]
        if len(grp) == 1 or not inner:
            add(members, k, sname, None)  # one switch: all PIX, or all PXB with no PIX pair inside
            continue
        # two levels: PIX leaves below a parent that holds the devices with no PIX peer
        add([leaf[0] for leaf in grp if len(leaf) == 1], k, sname, None)
        for j, leaf in enumerate(inner):
            add(leaf, k, f"{sname}-{j}", sname)
    nics = []
    for n in mx.nics:
        sw = dev_switch.get(n)
        k = next(i for i, grp in enumerate(groups) if any(n in leaf for leaf in grp))
        nics.append(Nic(nic_name[n], nic_gbit_s * GBIT_S, sw, group_numa[k]))
    gpu_switch = {gidx[g]: dev_switch[g] for g in mx.gpus}

    # NVLink: NV# pairs; all pairs of 3+ GPUs equal -> one NVSwitch domain
    pairs = []
    for i, a in enumerate(mx.gpus):
        for b in mx.gpus[i + 1 :]:
            m = NV.match(cell((a, b)))
            if m:
                pairs.append((min(gidx[a], gidx[b]), max(gidx[a], gidx[b]), int(m.group(1))))
    n = len(mx.gpus)
    link_bw = specs.nvlink_link_gb_s * GB_S
    if not pairs:
        nvlink = NvlinkSpec()
    elif n >= 3 and len(pairs) == n * (n - 1) // 2 and len({p[2] for p in pairs}) == 1:
        nvlink = NvlinkSpec("nvswitch", link_bw, pairs[0][2])
    else:
        nvlink = NvlinkSpec("pairs", link_bw, pairs=tuple(sorted(pairs)))

    # a GPU's NUMA node is its switch's (as the loader reads it back)
    sw_numa = {s.name: s.numa for s in switches}
    numa_ids = sorted(set(sw_numa.values()) | {x.numa for x in nics})
    numa_nodes = tuple(NumaNode(i, round(ddr_gb * GB), ddr_bw_gb_s * GB_S) for i in numa_ids)
    gpus = tuple(
        Gpu(i, round(specs.hbm_gb[i] * GB), specs.hbm_bw_gb_s[i] * GB_S, gpu_switch[i], sw_numa[gpu_switch[i]], specs.models[i])
        for i in range(n)
    )
    inter = inter_socket_gb_s * GB_S if len(numa_nodes) > 1 else math.inf
    host = Host(host_name, gpus, nvlink, tuple(switches), numa_nodes, inter, tuple(nics))
    return ClusterTopology((host,), Network(), "cuda", name, source)


def import_topo(path: str | Path, **capacities) -> ClusterTopology:
    """Reads an ``nvidia-smi topo -m`` file; ``capacities`` as in :func:`topology_from_matrix`."""
    topo, _ = _import(path, capacities)
    return topo


def _import(path: str | Path, capacities: dict) -> tuple[ClusterTopology, str]:
    """The topology and the origin of its GPU capacities (for the YAML header)."""
    if str(path) == "-":
        text, source, stem = sys.stdin.read(), "<stdin>", "imported"
    else:
        p = Path(path)
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise TopologyError(f"{p.name}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        source, stem = p.name, p.stem
    caps = dict(capacities)
    caps.setdefault("name", stem)
    mx = parse_topo_matrix(text, source)
    gpu_keys = ("gpu_model", "hbm_gb", "hbm_bw_gb_s", "nvlink_link_gb_s", "pcie_gen")
    specs = resolve_gpus(mx, source=source, **{k: caps.pop(k) for k in gpu_keys if k in caps})
    defaults = dict(ddr_gb=512, ddr_bw_gb_s=150, nic_gbit_s=200, inter_socket_gb_s=64, host_name="host")
    unknown = set(caps) - set(defaults) - {"name"}
    if unknown:
        raise TypeError(f"import_topo() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    args = {**defaults, **caps}
    return _build(
        mx,
        specs,
        args["ddr_gb"],
        args["ddr_bw_gb_s"],
        args["nic_gbit_s"],
        args["inter_socket_gb_s"],
        args["host_name"],
        args["name"] or args["host_name"],
        source,
    ), specs.origin


def yaml_header(source: str, origin: str, tool: str = "sharding.topology.nvidia_smi") -> str:
    """The comment on top of an imported topology: the input's file name only (never its path, so
    the YAML is the same on every machine) and where the GPU capacities came from."""
    return f"imported from {Path(source).name} by {tool}; {origin}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="nvidia-smi topo -m output -> topology YAML")
    ap.add_argument(
        "topo", nargs="?", help="a file with `nvidia-smi topo -m` output ('-' for stdin); `nvidia-smi -L` lines in it name the GPUs"
    )
    ap.add_argument(
        "--gpu",
        "--gpu-model",
        dest="gpu",
        default="",
        help="GPU model as `nvidia-smi --query-gpu=name --format=csv,noheader` prints it (e.g. 'NVIDIA A100-SXM4-80GB') "
        "or short (a100-80gb-sxm, h100-sxm, l40s, rtx4090): capacities from its preset",
    )
    ap.add_argument("--hbm-gb", type=float, default=None, help="GPU memory per GPU, GB (default: the model's preset)")
    ap.add_argument("--hbm-bw-gb-s", type=float, default=None, help="GPU memory bandwidth, GB/s (default: the model's preset)")
    ap.add_argument("--ddr-gb", type=float, default=512, help="host memory per NUMA node, GB")
    ap.add_argument("--ddr-bw-gb-s", type=float, default=150, help="DDR bandwidth per NUMA node, GB/s")
    ap.add_argument("--nic-gbit-s", type=float, default=200, help="NIC line rate, Gb/s")
    ap.add_argument(
        "--pcie-gen", type=int, default=None, choices=sorted(PCIE_X16_GB_S), help=f"default: the model's, else {DEFAULT_PCIE_GEN}"
    )
    ap.add_argument(
        "--nvlink-link-gb-s",
        type=float,
        default=None,
        help=f"one NVLink link, one direction, GB/s (default: the model's, else {DEFAULT_NVLINK_LINK_GB_S:g})",
    )
    ap.add_argument("--inter-socket-gb-s", type=float, default=64)
    ap.add_argument("--host-name", default="host")
    ap.add_argument("--name", default=None)
    ap.add_argument("--list-gpus", action="store_true", help="print the GPU presets and exit")
    ap.add_argument("-o", "--output", help="write the YAML here (default: stdout)")
    a = ap.parse_args(argv)
    if a.list_gpus:
        for p in PRESETS:
            nv = f"NVLink {p.nvlink_link_gb_s:g} GB/s per link" if p.nvlink_link_gb_s else "no NVLink"
            gen = f"PCIe Gen{p.pcie_gen}" if p.pcie_gen else "no PCIe host link"
            print(f"{p.name:16s} {p.hbm_gb:g} GB, {p.hbm_bw_gb_s:g} GB/s, {nv}, {gen}")
        return 0
    if not a.topo:
        ap.error("the topo file is required (or --list-gpus)")
    caps = dict(
        gpu_model=a.gpu,
        hbm_gb=a.hbm_gb,
        hbm_bw_gb_s=a.hbm_bw_gb_s,
        ddr_gb=a.ddr_gb,
        ddr_bw_gb_s=a.ddr_bw_gb_s,
        nic_gbit_s=a.nic_gbit_s,
        pcie_gen=a.pcie_gen,
        nvlink_link_gb_s=a.nvlink_link_gb_s,
        inter_socket_gb_s=a.inter_socket_gb_s,
        host_name=a.host_name,
    )
    if a.name:
        caps["name"] = a.name
    try:
        topo, origin = _import(a.topo, caps)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = dump_topology(topo, header=yaml_header(topo.source, origin))
    if a.output:
        out = Path(a.output)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
