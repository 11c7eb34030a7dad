"""The topology file format: YAML in the units people write (capacities in GB = 2**30 bytes, as
memory is sold: an "80 GB" A100 has 80 GiB; bandwidths in GB/s = 10**9 bytes/s, as spec sheets
quote them; NIC speeds in Gb/s), read into and written from the dataclasses of
``sharding/topology/cluster.py``. The shipped files are package data in ``sharding/topologies/``
(documented in docs/topology.md); a file may take hosts ``from:`` another and ``repeat:`` them.

Every problem is a :class:`TopologyError` with one line naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from sharding.topology.cluster import (
    COMPUTE_DEVICES,
    GB,
    GB_S,
    GBIT_S,
    NVLINK_KINDS,
    ClusterTopology,
    Gpu,
    Host,
    Network,
    Nic,
    NumaNode,
    NvlinkSpec,
    PcieSwitch,
    SsdSpec,
    TopologyError,
)
from sharding.topology.file_fields import _Ctx, _choice, _fmt, _int, _list, _mapping, _number, _str


def _shipped_dir() -> Path:
    """The shipped topologies (package data ``sharding/topologies/*.yaml``, read through
    importlib.resources so a wheel install works from any directory; configs/topologies in the
    repository links here). Installs (wheel, editable) and the source tree hold them as files, which
    ``from:`` references between topologies need."""
    return Path(str(resources.files("sharding").joinpath("topologies")))


TOPOLOGY_DIR = _shipped_dir()


def load_topology(path: str | Path) -> ClusterTopology:
    """Reads and validates a topology YAML file. A bare name (``dgx-a100``) that is not a file in
    the current directory is a shipped topology (``shipped_topologies()``)."""
    p = Path(path)
    if not p.exists() and not p.suffix and (TOPOLOGY_DIR / f"{p}.yaml").exists():
        p = TOPOLOGY_DIR / f"{p}.yaml"
    if not p.exists():
        names = [s.stem for s in shipped_topologies()]
        close = difflib.get_close_matches(Path(path).stem, names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise TopologyError(f"{path}: no such topology file, nor a shipped topology name (shipped: {', '.join(names)}){hint}")
    return _load(p, stack=())


def shipped_topologies() -> list[Path]:
    """The topology files that ship with the package; their stems are the names ``load_topology`` takes."""
    return sorted(TOPOLOGY_DIR.glob("*.yaml"))


def _read_yaml(p: Path, source: str) -> Any:
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise TopologyError(f"{source}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TopologyError(
            f"{source}: not a UTF-8 text file (byte 0x{e.object[e.start]:02x} at offset {e.start}); is it a topology YAML?"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TopologyError(f"{source}: invalid YAML: {where}{problem}") from None


def _load(p: Path, stack: tuple[Path, ...]) -> ClusterTopology:
    source = p.name
    ctx = _Ctx(source)
    resolved = p.resolve()
    if resolved in stack:
        raise TopologyError(f"{source}: 'from' cycle: {' -> '.join(s.name for s in stack + (resolved,))}")
    doc = _read_yaml(p, source)
    top = _mapping(ctx, "", doc, ["hosts"], ["name", "description", "compute_device", "network"])
    device = _choice(ctx, "compute_device", top.get("compute_device", "cuda"), COMPUTE_DEVICES)
    name = _str(ctx, "name", top["name"]) if "name" in top else p.stem
    if "description" in top:
        _str(ctx, "description", top["description"])
    hosts: list[Host] = []
    for i, h in enumerate(_list(ctx, "hosts", top["hosts"])):
        hosts.extend(_parse_host_entry(ctx, f"hosts[{i}]", h, device, p, stack + (resolved,)))
    if not hosts:
        raise ctx.fail("hosts", "expected at least one host")
    names: dict[str, int] = {}
    for i, h in enumerate(hosts):
        if h.name in names:
            raise ctx.fail("hosts", f"host name '{h.name}' appears twice (use 'repeat' to number copies)")
        names[h.name] = i
        if len(h.gpus) != len(hosts[0].gpus):
            raise ctx.fail(
                "hosts",
                f"host '{h.name}' has {len(h.gpus)} devices but '{hosts[0].name}' has {len(hosts[0].gpus)}; "
                "ranks are numbered host-major, so every host needs the same count",
            )
        if len(hosts) > 1 and not h.nics:
            raise ctx.fail("hosts", f"host '{h.name}' has no NICs but the cluster has {len(hosts)} hosts")
    network = Network()
    if "network" in top:
        net = _mapping(ctx, "network", top["network"], [], ["bw_per_nic_gbit_s", "latency_us", "nvlink_domain_hosts"])
        domain = _int(ctx, "network.nvlink_domain_hosts", net.get("nvlink_domain_hosts", 1), minimum=1)
        if len(hosts) % domain:
            raise ctx.fail("network.nvlink_domain_hosts", f"{domain} does not divide the {len(hosts)} hosts into whole NVLink domains")
        if domain > 1:
            for h in hosts:
                if h.nvlink.kind != "nvswitch":
                    raise ctx.fail(
                        "network.nvlink_domain_hosts",
                        f"an NVLink domain across hosts needs NVSwitch hosts, but host '{h.name}' has nvlink kind '{h.nvlink.kind}'",
                    )
        network = Network(
            bw_per_nic=_number(ctx, "network.bw_per_nic_gbit_s", net["bw_per_nic_gbit_s"]) * GBIT_S
            if "bw_per_nic_gbit_s" in net
            else math.inf,
            latency=_number(ctx, "network.latency_us", net.get("latency_us", 0), positive=False) * 1e-6,
            nvlink_domain_hosts=domain,
        )
    return ClusterTopology(hosts=tuple(hosts), network=network, compute_device=device, name=name, source=source)


_HOST_KEYS = ["gpus", "numa_nodes", "nvlink", "pcie", "inter_socket_gb_s", "nics", "ssd"]


def _parse_host_entry(ctx: _Ctx, key: str, value: Any, device: str, path: Path, stack: tuple[Path, ...]) -> list[Host]:
    if isinstance(value, dict) and "from" in value:
        d = _mapping(ctx, key, value, ["from"], ["name", "repeat", "ssd"])
        ref = path.parent / _str(ctx, f"{key}.from", d["from"])
        if not ref.exists():
            raise ctx.fail(f"{key}.from", f"no such file '{d['from']}' (relative to {path.parent.name}/)")
        sub = _load(ref, stack)
        if sub.compute_device != device:
            raise ctx.fail(f"{key}.from", f"'{d['from']}' is a {sub.compute_device} topology, this file is {device}")
        templates = list(sub.hosts)
        if len(templates) != 1 and "name" in d:
            raise ctx.fail(f"{key}.name", f"'{d['from']}' has {len(templates)} hosts; 'name' needs exactly one")
        if "ssd" in d:  # the same hosts with an SSD tier (replacing theirs, if any)
            ssd = _parse_ssd(ctx, f"{key}.ssd", d["ssd"])
            templates = [dataclasses.replace(t, ssd=ssd) for t in templates]
    else:
        d = _mapping(ctx, key, value, ["gpus", "numa_nodes"], ["name", "repeat"] + _HOST_KEYS[2:])
        templates = [_parse_host(ctx, key, d, device, d.get("name", "host"))]
    repeat = _int(ctx, f"{key}.repeat", d.get("repeat", 1), minimum=1)
    base = _str(ctx, f"{key}.name", d["name"]) if "name" in d else None
    out = []
    for t in templates:
        stem = base or t.name
        for r in range(repeat):
            out.append(_renamed(t, f"{stem}-{r}" if repeat > 1 else stem))
    return out


def _renamed(h: Host, name: str) -> Host:
    return dataclasses.replace(h, name=name)


def _parse_host(ctx: _Ctx, key: str, d: dict, device: str, name: str) -> Host:
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
    ssd = _parse_ssd(ctx, f"{key}.ssd", d["ssd"]) if "ssd" in d else None
    return Host(name, tuple(gpus), nvlink, tuple(switches), tuple(numa_nodes), inter, tuple(nics), ssd)


def _parse_ssd(ctx: _Ctx, key: str, value: Any) -> SsdSpec:
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


# ----------------------------------------------------------------------------------------------
# Writing (the importer's output; load_topology reads it back)
# ----------------------------------------------------------------------------------------------
