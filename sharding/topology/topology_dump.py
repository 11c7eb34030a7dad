"""A ``ClusterTopology`` back to the topology file's YAML (``dump_topology``): what
`recsys-plan` writes for a topology read from ``nvidia-smi topo -m``, and what loads back to the
same topology."""

from __future__ import annotations

import math
from typing import Any

import yaml

from sharding.topology.cluster import (
    GB,
    GB_S,
    GBIT_S,
    ClusterTopology,
    Host,
    NvlinkSpec,
)


def _num(x: float) -> float | int:
    """Round-trippable, readable numbers: 80.0 -> 80, 14.0625 stays."""
    r = round(x, 6)
    return int(r) if r == int(r) else r


def topology_to_dict(topo: ClusterTopology) -> dict[str, Any]:
    def gpus(h: Host) -> Any:
        rows = []
        for g in h.gpus:
            d: dict[str, Any] = {"model": g.model} if g.model else {}
            if topo.compute_device == "cuda":
                d.update(hbm_gb=_num(g.hbm_bytes / GB), hbm_bw_gb_s=_num(g.hbm_bw / GB_S))
            else:
                d["numa"] = g.numa
            rows.append(d)
        if all(r == rows[0] for r in rows):
            return {"count": len(rows), **rows[0]}
        return rows

    def nvlink(nv: NvlinkSpec) -> dict[str, Any]:
        if nv.kind == "none":
            return {"kind": "none"}
        d: dict[str, Any] = {"kind": nv.kind, "link_gb_s": _num(nv.link_bw / GB_S)}
        if nv.kind in ("nvswitch", "islands"):
            d["links_per_gpu"] = nv.links_per_gpu
        if nv.kind == "islands":
            d["islands"] = [list(i) for i in nv.islands]
        if nv.kind == "pairs":
            d["pairs"] = [list(p) for p in nv.pairs]
        return d

    hosts = []
    for h in topo.hosts:
        hd: dict[str, Any] = {"name": h.name, "gpus": gpus(h), "nvlink": nvlink(h.nvlink)}
        if h.pcie_switches:
            hd["pcie"] = {
                "switches": [
                    {
                        "name": s.name,
                        "numa": s.numa,
                        "uplink_gb_s": _num(s.uplink_bw / GB_S),
                        "port_gb_s": _num(s.port_bw / GB_S),
                        "gpus": list(s.gpus),
                        "nics": list(s.nics),
                        **({"parent": s.parent} if s.parent else {}),
                    }
                    for s in h.pcie_switches
                ]
            }
        hd["numa_nodes"] = [
            {"index": m.index, "ddr_gb": _num(m.ddr_bytes / GB), "ddr_bw_gb_s": _num(m.ddr_bw / GB_S)} for m in h.numa_nodes
        ]
        if math.isfinite(h.inter_socket_bw):
            hd["inter_socket_gb_s"] = _num(h.inter_socket_bw / GB_S)
        if h.nics:
            hd["nics"] = [
                {"name": x.name, "speed_gbit_s": _num(x.bw / GBIT_S), **({} if x.pcie_switch else {"numa": x.numa})} for x in h.nics
            ]
        if h.ssd is not None:
            hd["ssd"] = {
                "capacity_gb": _num(h.ssd.capacity / GB),
                "read_gb_s": _num(h.ssd.read_bw / GB_S),
                "write_gb_s": _num(h.ssd.write_bw / GB_S),
            }
        hosts.append(hd)
    out: dict[str, Any] = {"name": topo.name, "compute_device": topo.compute_device, "hosts": hosts}
    net: dict[str, Any] = {}
    if math.isfinite(topo.network.bw_per_nic):
        net["bw_per_nic_gbit_s"] = _num(topo.network.bw_per_nic / GBIT_S)
    if topo.network.latency:
        net["latency_us"] = _num(topo.network.latency * 1e6)
    if topo.network.nvlink_domain_hosts > 1:
        net["nvlink_domain_hosts"] = topo.network.nvlink_domain_hosts
    if net:
        out["network"] = net
    return out


def dump_topology(topo: ClusterTopology, header: str = "") -> str:
    """The topology as YAML text in the file format (``load_topology`` reads it back)."""
    body = yaml.safe_dump(topology_to_dict(topo), sort_keys=False, default_flow_style=None, width=110)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body
