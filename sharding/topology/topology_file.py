"""The topology file format: YAML in the units people write (capacities in GB = 2**30 bytes, as
memory is sold: an "80 GB" A100 has 80 GiB; bandwidths in GB/s = 10**9 bytes/s, as spec sheets
quote them; NIC speeds in Gb/s), read into the dataclasses of ``sharding/topology/cluster.py``.
The shipped files are package data in ``sharding/topologies/`` (documented in docs/topology.md);
a file may take hosts ``from:`` another and ``repeat:`` them.

This module reads a file as a whole: the YAML, the top-level keys and the network, ``from:`` /
``repeat:`` host entries, and the checks across hosts. A host written out in full is read by
``host_section.py``, the typed fields by ``file_fields.py``; ``topology_dump.py`` writes the
format back.

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

from sharding.topology.cluster import COMPUTE_DEVICES, GBIT_S, ClusterTopology, Host, Network, TopologyError
from sharding.topology.file_fields import _Ctx, _choice, _int, _list, _mapping, _number, _str
from sharding.topology.host_section import HOST_KEYS, parse_host, parse_ssd


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
            ssd = parse_ssd(ctx, f"{key}.ssd", d["ssd"])
            templates = [dataclasses.replace(t, ssd=ssd) for t in templates]
    else:
        d = _mapping(ctx, key, value, ["gpus", "numa_nodes"], ["name", "repeat"] + HOST_KEYS[2:])
        templates = [parse_host(ctx, key, d, device, d.get("name", "host"))]
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
