"""One host of a topology file: a ``hosts:`` entry written out in full (GPUs, NUMA nodes, NICs,
the PCIe tree, NVLink, an SSD tier) read into a :class:`Host`.

A host is most of the format and holds all of its cross-references: a switch's GPUs and NICs
exist and sit on one switch only, NUMA nodes exist and agree between a switch, its parent and its
NICs, NVLink names real GPUs once. Those checks live here; ``topology_file.py`` reads the file
around the hosts (the YAML, ``from:`` / ``repeat:`` entries, the network, the checks across hosts).
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from sharding.topology.cluster import (
    GB,
    GB_S,
    GBIT_S,
    NVLINK_KINDS,
    Gpu,
    Host,
    Nic,
    NumaNode,
    NvlinkSpec,
    PcieSwitch,
    SsdSpec,
)
from sharding.topology.file_fields import _Ctx, _choice, _fmt, _int, _list, _mapping, _number, _str

# the keys of a host written out in full; a ``from:`` entry takes only "ssd" of them
HOST_KEYS = ["gpus", "numa_nodes", "nvlink", "pcie", "inter_socket_gb_s", "nics", "ssd"]


def parse_host(ctx: _Ctx, key: str, d: dict, device: str, name: str) -> Host:
    """The host entry ``d`` found at ``key`` (its top-level keys already checked) as a :class:`Host`
    named ``name``; ``device`` (cuda or cpu) decides which keys a GPU and a host need."""
    _str(ctx, f"{key}.name", name)
    # NUMA nodes (host memory is per NUMA node, not per rank)
    numa_nodes = _parse_numa(ctx, f"{key}.numa_nodes", d["numa_nodes"])
    numa_ids = {n.index for n in numa_nodes}
    if len(numa_nodes) > 1:
        if "inter_socket_gb_s" not in d:
            raise ctx.fail(f"{key}.inter_socket_gb_s", f"missing required key ({len(numa_nodes)} NUMA nodes)")
        inter = _number(ctx, f"{key}.inter_socket_gb_s", d["inter_socket_gb_s"]) * GB_S
    else:
        inter = _number(ctx, f"{key}.inter_socket_gb_s", d["inter_socket_gb_s"]) * GB_S if "inter_socket_gb_s" in d else math.inf

    gpu_specs = _parse_gpu_specs(ctx, f"{key}.gpus", d["gpus"], device)
    n = len(gpu_specs)

    # NICs
    nic_specs: dict[str, tuple[str, float, int | None]] = {}
    for j, raw in enumerate(_list(ctx, f"{key}.nics", d.get("nics", []))):
        k = f"{key}.nics[{j}]"
        nd = _mapping(ctx, k, raw, ["name", "speed_gbit_s"], ["numa"])
        nname = _str(ctx, f"{k}.name", nd["name"])
        if nname in nic_specs:
            raise ctx.fail(f"{k}.name", f"NIC '{nname}' is listed twice")
        numa = _int(ctx, f"{k}.numa", nd["numa"]) if "numa" in nd else None
        if numa is not None and numa not in numa_ids:
            raise ctx.fail(f"{k}.numa", f"NUMA node {numa} does not exist (have {sorted(numa_ids)})")
        nic_specs[nname] = (k, _number(ctx, f"{k}.speed_gbit_s", nd["speed_gbit_s"]) * GBIT_S, numa)

    # PCIe tree
    gpu_switch: dict[int, str] = {}
    nic_switch: dict[str, PcieSwitch] = {}
    switches: list[PcieSwitch] = []
    if "pcie" in d:
        if device == "cpu":
            raise ctx.fail(f"{key}.pcie", "not used for compute_device cpu (CPU ranks have no PCIe path)")
        pk = f"{key}.pcie"
        pd = _mapping(ctx, pk, d["pcie"], ["switches"], ["port_gb_s"])
        default_port = _number(ctx, f"{pk}.port_gb_s", pd["port_gb_s"]) * GB_S if "port_gb_s" in pd else None
        for s, raw in enumerate(_list(ctx, f"{pk}.switches", pd["switches"])):
            sk = f"{pk}.switches[{s}]"
            sd = _mapping(ctx, sk, raw, ["name", "numa", "uplink_gb_s"], ["port_gb_s", "gpus", "nics", "parent"])
            sname = _str(ctx, f"{sk}.name", sd["name"])
            if any(x.name == sname for x in switches):
                raise ctx.fail(f"{sk}.name", f"switch '{sname}' is listed twice")
            numa = _int(ctx, f"{sk}.numa", sd["numa"])
            if numa not in numa_ids:
                raise ctx.fail(f"{sk}.numa", f"NUMA node {numa} does not exist (have {sorted(numa_ids)})")
            parent = _str(ctx, f"{sk}.parent", sd["parent"]) if "parent" in sd else None
            if parent is not None:
                up = next((x for x in switches if x.name == parent), None)
                if up is None:
                    raise ctx.fail(f"{sk}.parent", f"'{parent}' is not a switch listed before '{sname}'")
                if up.numa != numa:
                    raise ctx.fail(f"{sk}.numa", f"NUMA {numa} disagrees with its parent switch '{parent}' (NUMA {up.numa})")
            uplink = _number(ctx, f"{sk}.uplink_gb_s", sd["uplink_gb_s"]) * GB_S
            if "port_gb_s" in sd:
                port = _number(ctx, f"{sk}.port_gb_s", sd["port_gb_s"]) * GB_S
            elif default_port is not None:
                port = default_port
            else:
                raise ctx.fail(f"{sk}.port_gb_s", f"missing required key (or set {pk}.port_gb_s)")
            gl: list[int] = []
            for q, g in enumerate(_list(ctx, f"{sk}.gpus", sd.get("gpus", []))):
                gk = f"{sk}.gpus[{q}]"
                g = _int(ctx, gk, g)
                if g >= n:
                    raise ctx.fail(gk, f"GPU {g} does not exist (host has {n} GPUs: 0..{n - 1})")
                if g in gpu_switch:
                    raise ctx.fail(gk, f"GPU {g} is already on switch '{gpu_switch[g]}'")
                gpu_switch[g] = sname
                gl.append(g)
            nl: list[str] = []
            for q, nn in enumerate(_list(ctx, f"{sk}.nics", sd.get("nics", []))):
                nk = f"{sk}.nics[{q}]"
                nn = _str(ctx, nk, nn)
                if nn not in nic_specs:
                    close = difflib.get_close_matches(nn, list(nic_specs), n=1)
                    hint = f" (did you mean '{close[0]}'?)" if close else ""
                    raise ctx.fail(nk, f"NIC '{nn}' is not in {key}.nics{hint}")
                if nn in nic_switch:
                    raise ctx.fail(nk, f"NIC '{nn}' is already on switch '{nic_switch[nn].name}'")
                nl.append(nn)
            sw = PcieSwitch(sname, numa, uplink, port, tuple(gl), tuple(nl), parent)
            for nn in nl:
                nic_switch[nn] = sw
            switches.append(sw)
    elif device == "cuda":
        raise ctx.fail(f"{key}.pcie", "missing required key (every GPU hangs from a PCIe switch or root port)")
    if device == "cuda":
        missing = [g for g in range(n) if g not in gpu_switch]
        if missing:
            raise ctx.fail(f"{key}.pcie.switches", f"GPU {missing[0]} is on no switch (list every GPU once)")

    nics: list[Nic] = []
    for nname, (k, bw, numa) in nic_specs.items():
        sw = nic_switch.get(nname)
        if sw is not None:
            if numa is not None and numa != sw.numa:
                raise ctx.fail(f"{k}.numa", f"NUMA {numa} disagrees with its switch '{sw.name}' (NUMA {sw.numa})")
            numa = sw.numa
        elif numa is None:
            raise ctx.fail(f"{k}.numa", "missing required key (the NIC is on no PCIe switch)")
        nics.append(Nic(nname, bw, sw.name if sw else None, numa))

    gpus = []
    for i, (model, hbm, hbm_bw, numa) in enumerate(gpu_specs):
        if device == "cuda":
            numa = next(s.numa for s in switches if s.name == gpu_switch[i])
        elif numa not in numa_ids:
            raise ctx.fail(f"{key}.gpus", f"device {i}: NUMA node {numa} does not exist (have {sorted(numa_ids)})")
        gpus.append(Gpu(i, hbm, hbm_bw, gpu_switch.get(i), numa, model))

    nvlink = _parse_nvlink(ctx, f"{key}.nvlink", d.get("nvlink", {"kind": "none"}), n, device)
    ssd = parse_ssd(ctx, f"{key}.ssd", d["ssd"]) if "ssd" in d else None
    return Host(name, tuple(gpus), nvlink, tuple(switches), tuple(numa_nodes), inter, tuple(nics), ssd)


def parse_ssd(ctx: _Ctx, key: str, value: Any) -> SsdSpec:
    """``{capacity_gb, read_gb_s, write_gb_s}``: the host's SSD tier, all three required."""
    d = _mapping(ctx, key, value, ["capacity_gb", "read_gb_s", "write_gb_s"], [])
    return SsdSpec(
        capacity=round(_number(ctx, f"{key}.capacity_gb", d["capacity_gb"]) * GB),
        read_bw=_number(ctx, f"{key}.read_gb_s", d["read_gb_s"]) * GB_S,
        write_bw=_number(ctx, f"{key}.write_gb_s", d["write_gb_s"]) * GB_S,
    )


def _count_or_list(ctx: _Ctx, key: str, value: Any, fields: list[str], required: list[str]) -> list[tuple[str, dict]]:
    """``{count: N, <fields>}`` (N identical entries) or a list of ``{<fields>}``."""
    if isinstance(value, dict):
        d = _mapping(ctx, key, value, ["count"] + required, [f for f in fields if f not in required])
        count = _int(ctx, f"{key}.count", d["count"], minimum=1)
        return [(key, d)] * count
    items = _list(ctx, key, value)
    if not items:
        raise ctx.fail(key, "expected at least one entry")
    return [
        (f"{key}[{i}]", _mapping(ctx, f"{key}[{i}]", v, required, [f for f in fields if f not in required])) for i, v in enumerate(items)
    ]


def _parse_numa(ctx: _Ctx, key: str, value: Any) -> list[NumaNode]:
    entries = _count_or_list(ctx, key, value, ["index", "ddr_gb", "ddr_bw_gb_s"], ["ddr_gb", "ddr_bw_gb_s"])
    out: list[NumaNode] = []
    for pos, (k, d) in enumerate(entries):
        idx = _int(ctx, f"{k}.index", d["index"]) if "index" in d else pos
        if "index" in d and isinstance(value, dict):
            raise ctx.fail(f"{k}.index", "not allowed with 'count' (nodes are numbered 0..count-1)")
        if any(x.index == idx for x in out):
            raise ctx.fail(f"{k}.index", f"NUMA node {idx} is listed twice")
        out.append(
            NumaNode(
                idx,
                round(_number(ctx, f"{k}.ddr_gb", d["ddr_gb"]) * GB),
                _number(ctx, f"{k}.ddr_bw_gb_s", d["ddr_bw_gb_s"]) * GB_S,
            )
        )
    return out


def _parse_gpu_specs(ctx: _Ctx, key: str, value: Any, device: str) -> list[tuple[str, int, float, int]]:
    if device == "cuda":
        entries = _count_or_list(ctx, key, value, ["model", "hbm_gb", "hbm_bw_gb_s"], ["hbm_gb", "hbm_bw_gb_s"])
    else:
        entries = _count_or_list(ctx, key, value, ["model", "numa"], [])
    out = []
    for k, d in entries:
        model = _str(ctx, f"{k}.model", d["model"]) if "model" in d else ""
        if device == "cuda":
            hbm = round(_number(ctx, f"{k}.hbm_gb", d["hbm_gb"]) * GB)
            bw = _number(ctx, f"{k}.hbm_bw_gb_s", d["hbm_bw_gb_s"]) * GB_S
            out.append((model, hbm, bw, -1))
        else:
            out.append((model, 0, 0.0, _int(ctx, f"{k}.numa", d.get("numa", 0))))
    return out


def _gpu_ref(ctx: _Ctx, key: str, value: Any, n: int) -> int:
    g = _int(ctx, key, value)
    if g >= n:
        raise ctx.fail(key, f"GPU {g} does not exist (host has {n} GPUs: 0..{n - 1})")
    return g


def _parse_nvlink(ctx: _Ctx, key: str, value: Any, n: int, device: str) -> NvlinkSpec:
    if not isinstance(value, dict):
        raise ctx.fail(key, f"expected a mapping, got {_fmt(value)}")
    kind = _choice(ctx, f"{key}.kind", value.get("kind"), NVLINK_KINDS)
    if kind == "none":
        _mapping(ctx, key, value, ["kind"], [])
        return NvlinkSpec()
    if device == "cpu":
        raise ctx.fail(f"{key}.kind", "NVLink needs compute_device cuda")
    if kind == "nvswitch":
        d = _mapping(ctx, key, value, ["kind", "link_gb_s", "links_per_gpu"], [])
    elif kind == "islands":
        d = _mapping(ctx, key, value, ["kind", "link_gb_s", "links_per_gpu", "islands"], [])
    else:
        d = _mapping(ctx, key, value, ["kind", "link_gb_s", "pairs"], [])
    link_bw = _number(ctx, f"{key}.link_gb_s", d["link_gb_s"]) * GB_S
    if kind == "nvswitch":
        return NvlinkSpec(kind, link_bw, _int(ctx, f"{key}.links_per_gpu", d["links_per_gpu"], minimum=1))
    if kind == "islands":
        seen: dict[int, int] = {}
        islands = []
        for i, isl in enumerate(_list(ctx, f"{key}.islands", d["islands"])):
            members = []
            for j, g in enumerate(_list(ctx, f"{key}.islands[{i}]", isl)):
                g = _gpu_ref(ctx, f"{key}.islands[{i}][{j}]", g, n)
                if g in seen:
                    raise ctx.fail(f"{key}.islands[{i}][{j}]", f"GPU {g} is already in island {seen[g]}")
                seen[g] = i
                members.append(g)
            if len(members) < 2:
                raise ctx.fail(f"{key}.islands[{i}]", "an island needs at least two GPUs")
            islands.append(tuple(members))
        links = _int(ctx, f"{key}.links_per_gpu", d["links_per_gpu"], minimum=1)
        return NvlinkSpec(kind, link_bw, links, islands=tuple(islands))
    pairs = []
    for i, p in enumerate(_list(ctx, f"{key}.pairs", d["pairs"])):
        pk = f"{key}.pairs[{i}]"
        if not isinstance(p, list) or len(p) != 3:
            raise ctx.fail(pk, f"expected [gpu_a, gpu_b, links], got {_fmt(p)}")
        a, b = _gpu_ref(ctx, f"{pk}[0]", p[0], n), _gpu_ref(ctx, f"{pk}[1]", p[1], n)
        links = _int(ctx, f"{pk}[2]", p[2], minimum=1)
        if a == b:
            raise ctx.fail(pk, f"a pair needs two different GPUs, got {a} twice")
        if any({x, y} == {a, b} for x, y, _ in pairs):
            raise ctx.fail(pk, f"pair ({a}, {b}) is listed twice")
        pairs.append((a, b, links))
    return NvlinkSpec(kind, link_bw, pairs=tuple(pairs))
