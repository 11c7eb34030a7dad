"""Where a sharding plan's bytes go in one training step: between ranks, by link kind, through
each PCIe switch, and into each host's memory.

What it is for: reading a plan (`recsys-plan show`), not planning. Every number is bytes per step
and comes from the plan file alone (plus a topology for the link kinds and hosts); nothing is
measured, and no time is computed here: the step's times in every report are the planner's model
(``sharding/planner/cost/plan_cost.py``), so that a plan has one step time wherever it is read.

Inputs: the plan's tables and shards (:func:`sharding.plan.report.table_infos`), ``B`` = the
batch size per rank (the plan's ``meta.batch_size_per_rank``, default 512) and a pooling factor of
1 (one id per feature per sample, as in our Criteo-like data). Pooled embeddings are fp32 (4
bytes), ids int64 (8 bytes). ``W`` is the world size.

Bytes between ranks (``fwd[a, b]`` = bytes rank ``a`` sends to rank ``b`` in the forward pass):

- input-id distribution, every model-parallel type (TW, CW, TWCW, RW, TWRW): every rank ``a``
  sends the ids of its ``B`` samples for the table's feature to each shard owner ``o != a``:
  ``B * 8`` bytes per column shard (TW, CW, TWCW: every column shard needs every id) and
  ``B * 8 * rows_s / rows`` for a row shard of ``rows_s`` rows (RW, TWRW: ids spread uniformly
  over the rows, each id goes to the one shard holding its row).
- pooled output, TW / CW / TWCW: the owner ``o`` of a shard of ``c`` columns sends
  ``B * c * 4`` bytes of pooled output to every other rank (each rank's local batch).
- pooled output, RW / TWRW: every shard owner ``o`` sends partial pooled sums of ``B * c * 4``
  bytes to every other rank (the reduce-scatter; for TWRW the intra-host pre-reduction is not
  modeled, so this is an upper bound).
- DP (``data_parallel``): no forward traffic.

Backward: for the model-parallel types the gradient of the pooled output goes back the way the
output came, ``bwd = fwd_pooled.T`` (the ids are not sent again). DP tables all-reduce their whole
gradient (``rows * cols * 4`` bytes) in a ring over their ranks: each rank sends
``2 * (n - 1) / n * table bytes`` to its ring successor.

Lookups: a shard owner looks up every id routed to it, ``lookups * c * 4`` bytes read forward
and the same written backward (``compute_bytes = 2 * lookups * c * 4``), from host memory for
``fused_uvm`` (``uvm_bytes``). Lookups per step: ``W * B`` for a column shard,
``W * B * rows_s / rows`` for a row shard, ``B`` for a DP replica.

With a topology (:func:`apply_topology`): each rank's sent bytes split by the link kind of the
pair's route (:func:`sharding.topology.paths.route`): NVLink, PCIe, network (another host),
or shared memory (CPU ranks); the bytes crossing each PCIe switch (peer traffic and UVM reads);
each host's memory against its capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sharding.constants import ID_BYTES
from sharding.plan.report import BYTES_PER_WEIGHT, TableInfo

DEFAULT_BATCH_SIZE_PER_RANK = 512
OUT_BYTES = 4

COLUMN_TYPES = ("table_wise", "column_wise", "table_column_wise")
ROW_TYPES = ("row_wise", "table_row_wise", "grid_shard")
DP_TYPES = ("data_parallel",)
LINK_KINDS = ("nvlink", "pcie", "network", "shm")
LINK_LABELS = {"nvlink": "NVLink", "pcie": "PCIe", "network": "network", "shm": "shared memory"}


@dataclass
class Traffic:
    world_size: int
    batch_size_per_rank: int
    fwd: np.ndarray  # [W, W] bytes a -> b, forward
    bwd: np.ndarray  # [W, W] bytes a -> b, backward
    lookups: np.ndarray  # [W] ids looked up per step (forward)
    compute_bytes: np.ndarray  # [W] embedding bytes read + written per step (fwd + bwd)
    uvm_bytes: np.ndarray  # [W] of compute_bytes, those read from / written to host memory (fused_uvm)
    # filled by apply_topology
    topology: str | None = None
    bytes_by_kind: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> [W] bytes sent
    hosts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> np.ndarray:
        return self.fwd + self.bwd

    @property
    def sent(self) -> np.ndarray:
        return self.total.sum(axis=1)

    @property
    def received(self) -> np.ndarray:
        return self.total.sum(axis=0)

    def to_dict(self) -> dict[str, Any]:
        ranks = []
        for r in range(self.world_size):
            d: dict[str, Any] = {
                "rank": r,
                "sent_bytes": int(self.sent[r]),
                "received_bytes": int(self.received[r]),
                "lookups": int(self.lookups[r]),
                "compute_bytes": int(self.compute_bytes[r]),
            }
            if self.bytes_by_kind:
                d["sent_bytes_by_link"] = {k: int(v[r]) for k, v in self.bytes_by_kind.items()}
            ranks.append(d)
        out: dict[str, Any] = {
            "model": "see sharding/planner/cost/traffic.py",
            "batch_size_per_rank": self.batch_size_per_rank,
            "forward_bytes": self.fwd.astype(np.int64).tolist(),
            "backward_bytes": self.bwd.astype(np.int64).tolist(),
            "ranks": ranks,
        }
        if self.topology is not None:
            out["topology"] = self.topology
            out["hosts"] = self.hosts
        return out


def batch_size_of(header: dict[str, Any]) -> int:
    b = (header.get("meta") or {}).get("batch_size_per_rank")
    return int(b) if isinstance(b, int) and b > 0 else DEFAULT_BATCH_SIZE_PER_RANK


def traffic(infos: list[TableInfo], world_size: int, batch_size_per_rank: int = DEFAULT_BATCH_SIZE_PER_RANK) -> Traffic:
    """Bytes per step between every pair of ranks (module docstring), without a topology."""
    W, B = world_size, batch_size_per_rank
    fwd = np.zeros((W, W), dtype=np.float64)
    bwd = np.zeros((W, W), dtype=np.float64)
    lookups = np.zeros(W, dtype=np.float64)
    compute = np.zeros(W, dtype=np.float64)
    uvm = np.zeros(W, dtype=np.float64)
    for t in infos:
        shards = [s for s in t.shards if 0 <= s.rank < W]
        if not shards:
            continue
        if t.sharding_type in DP_TYPES:
            members = sorted({s.rank for s in shards})
            n = len(members)
            s0 = shards[0]
            for s in shards:
                lookups[s.rank] += B
                compute[s.rank] += 2 * B * s.cols * BYTES_PER_WEIGHT
            if n > 1:
                per_rank = 2 * (n - 1) / n * s0.rows * s0.cols * BYTES_PER_WEIGHT
                for i, r in enumerate(members):
                    bwd[r, members[(i + 1) % n]] += per_rank
            continue
        row_sharded = t.sharding_type in ROW_TYPES
        total_rows = sum(s.rows for s in shards) if row_sharded else None
        for s in shards:
            o = s.rank
            frac = (s.rows / total_rows if total_rows else 0.0) if row_sharded else 1.0
            # ids: every other rank -> owner
            ids = np.full(W, B * ID_BYTES * frac)
            ids[o] = 0
            fwd[:, o] += ids
            # pooled output (or partial sums): owner -> every other rank; backward the reverse
            out = np.full(W, float(B * s.cols * OUT_BYTES))
            out[o] = 0
            fwd[o, :] += out
            bwd[:, o] += out
            n_lookups = W * B * frac
            lookups[o] += n_lookups
            compute[o] += 2 * n_lookups * s.cols * BYTES_PER_WEIGHT
            if t.compute_kernel == "fused_uvm":
                uvm[o] += 2 * n_lookups * s.cols * BYTES_PER_WEIGHT
    return Traffic(W, B, fwd, bwd, lookups, compute, uvm)


def link_kind(topo, a: int, b: int, hops=None) -> str:
    """NVLink, PCIe, network or shm (CPU ranks) for the route between two different ranks
    (``hops``: its ``sharding.topology.paths.route``, if already known)."""
    from sharding.topology.paths import route

    hops = route(topo, a, b) if hops is None else hops
    if topo.locate(a)[0] != topo.locate(b)[0] or any(h.kind == "fabric" for h in hops):
        return "network"
    if topo.compute_device == "cpu":
        return "shm"
    if any(h.kind == "nvlink" for h in hops):
        return "nvlink"
    return "pcie"


def apply_topology(tr: Traffic, topo, infos: list[TableInfo] | None = None, rank_memory: list[dict] | None = None) -> Traffic:
    """Bytes per rank by link kind, per PCIe switch and per host (memory against capacity)."""
    from sharding.topology.paths import route

    W = tr.world_size
    if topo.world_size != W:
        raise ValueError(f"topology {topo.name or topo.source}: {topo.world_size} ranks, the plan has {W}")
    tr.topology = topo.name or topo.source
    tr.bytes_by_kind = {k: np.zeros(W) for k in LINK_KINDS}
    switch_bytes: dict[tuple[int, str], float] = {}
    total = tr.total
    for a in range(W):
        for b in range(W):
            if a == b or total[a, b] == 0:
                continue
            hops = route(topo, a, b)
            tr.bytes_by_kind[link_kind(topo, a, b, hops)][a] += total[a, b]
            for sw in {(h.host, h.switch) for h in hops if h.switch is not None}:
                switch_bytes[sw] = switch_bytes.get(sw, 0.0) + total[a, b]
    for r in range(W):
        h, i = topo.locate(r)
        g = topo.hosts[h].gpus[i]
        if tr.uvm_bytes[r] and g.pcie_switch is not None:
            switch_bytes[(h, g.pcie_switch)] = switch_bytes.get((h, g.pcie_switch), 0.0) + tr.uvm_bytes[r]
    tr.hosts = []
    for h, host in enumerate(topo.hosts):
        rs = [topo.rank(h, i) for i in range(len(host.gpus))]
        mem = {"hbm_bytes": 0, "host_bytes": 0, "ssd_bytes": 0}
        if rank_memory is not None:
            for r in rs:
                mem["hbm_bytes"] += rank_memory[r]["hbm_bytes"]
                mem["host_bytes"] += rank_memory[r]["host_bytes"]
                mem["ssd_bytes"] += rank_memory[r].get("ssd_bytes", 0)
        tr.hosts.append(
            {
                "host": h,
                "name": host.name,
                "ranks": rs,
                "hbm_bytes": mem["hbm_bytes"],
                "hbm_capacity": sum(g.hbm_bytes for g in host.gpus),
                "host_bytes": mem["host_bytes"],
                "host_capacity": host.ddr_bytes,
                "ssd_bytes": mem["ssd_bytes"],
                "ssd_capacity": host.ssd_bytes,
                "pcie_switches": [
                    {
                        "switch": s.name,
                        "numa": s.numa,
                        "gpus": [topo.rank(h, i) for i in s.gpus],
                        "bytes_per_step": int(switch_bytes.get((h, s.name), 0.0)),
                    }
                    for s in host.pcie_switches
                ],
            }
        )
    return tr


def format_text(tr: Traffic) -> str:
    """Bytes per rank by link kind, per host and per PCIe switch (needs :func:`apply_topology`)."""
    lines = [
        f"traffic by link kind on {tr.topology} (MB per step, forward + backward, batch {tr.batch_size_per_rank} "
        "per rank; sharding/planner/cost/traffic.py; the step's times are the planner's, above)",
        f"{'rank':<6} {'sent MB':>10} " + " ".join(f"{LINK_LABELS[k]:>13}" for k in LINK_KINDS) + f" {'lookups':>10}",
    ]
    for r in range(tr.world_size):
        lines.append(
            f"{r:<6} {tr.sent[r] / 2**20:>10,.2f} "
            + " ".join(f"{tr.bytes_by_kind[k][r] / 2**20:>13,.2f}" for k in LINK_KINDS)
            + f" {tr.lookups[r]:>10,.0f}"
        )
    for h in tr.hosts:
        loads = ", ".join(f"{s['switch']} {s['bytes_per_step'] / 2**20:,.1f} MB" for s in h["pcie_switches"])
        ssd = (
            f", SSD {h['ssd_bytes'] / 2**30:,.2f} / {h['ssd_capacity'] / 2**30:,.0f} GB"
            if h.get("ssd_bytes") or h.get("ssd_capacity")
            else ""
        )  # hosts with an SSD tier or key_value shards
        lines.append(
            f"host {h['host']} ({h['name']}): HBM {h['hbm_bytes'] / 2**30:,.2f} / {h['hbm_capacity'] / 2**30:,.0f} GB, "
            f"host {h['host_bytes'] / 2**30:,.2f} / {h['host_capacity'] / 2**30:,.0f} GB{ssd}"
            + (f"; PCIe switch load per step: {loads}" if loads else "")
        )
    return "\n".join(lines)
