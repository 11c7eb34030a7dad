"""What a plan puts where: per-table placement and bytes, per-rank memory, and plan diffs.

Memory model (the same one torchrec's planner uses for storage, with the optimizer state the
table really has): a shard of R rows x C columns holds R*C weights of its data type (4 bytes for
FP32) plus its optimizer state, ``bytes_per_weight * R*C + bytes_per_row * R`` as the plan file
records it per table (sharding/optimizer_state.py: CowClip-Adam 8 + 8, Adam 8 + 0, row-wise
Adagrad 0 + 4, SGD 0 + 0). A table whose optimizer the file does not record (version-1 files,
`optimizer_state: null`, or no entry) is shown as optimizer `unknown` and counted by its weights
alone, a lower bound the report says it is (``optimizer_unknown``: those tables); nothing is
assumed. Kernels decide where it lives: `fused`/`dense` on the
device (HBM on GPUs, host memory on CPU ranks), `fused_uvm` in host memory, `fused_uvm_caching`
in host memory plus an HBM cache of load_factor x the shard's weights, `key_value` (FBGEMM's SSD
kernels, CUDA only) on the host's SSD plus the same HBM cache. The text report shows an SSD
column only for plans with key_value tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchrec.distributed.types import ShardingPlan

from sharding.optimizer_state import weight_bytes

BYTES_PER_WEIGHT = 4  # FP32 weights (plan_traffic: bytes of pooled embeddings sent)
UNKNOWN_OPTIMIZER = "unknown"  # a table whose optimizer the plan file does not record
DEFAULT_CACHE_LOAD_FACTOR = 0.2  # torchrec's default when a plan leaves it unset


@dataclass
class ShardInfo:
    rank: int
    rows: int
    cols: int
    hbm_bytes: int
    host_bytes: int
    ssd_bytes: int = 0


@dataclass
class TableInfo:
    module: str
    table: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]
    cache_load_factor: float | None
    optimizer: str = UNKNOWN_OPTIMIZER
    shards: list[ShardInfo] = field(default_factory=list)
    shape: tuple[int, int] | None = None  # (rows, dim) of the whole table, from its shards or the file's tables

    @property
    def hbm_bytes(self) -> int:
        return sum(s.hbm_bytes for s in self.shards)

    @property
    def host_bytes(self) -> int:
        return sum(s.host_bytes for s in self.shards)

    @property
    def ssd_bytes(self) -> int:
        return sum(s.ssd_bytes for s in self.shards)


def _shard_bytes(rows: int, cols: int, kernel: str, load_factor: float | None, table: dict[str, Any], device: str) -> tuple[int, int, int]:
    """(HBM, host, SSD) bytes of a rows x cols shard of ``table`` (a plan header's table entry)."""
    weights = weight_bytes(table.get("data_type") or "FP32", rows, cols)
    st = table.get("optimizer_state") or {"bytes_per_weight": 0, "bytes_per_row": 0}  # unknown: weights only
    total = weights + rows * cols * st["bytes_per_weight"] + rows * st["bytes_per_row"]
    if device != "cuda":  # CPU ranks: everything is host memory
        return 0, total, 0
    lf = DEFAULT_CACHE_LOAD_FACTOR if load_factor is None else load_factor
    if kernel == "fused_uvm":
        return 0, total, 0
    if kernel == "fused_uvm_caching":
        return int(weights * lf), total, 0
    if kernel == "key_value":  # rows and optimizer state on SSD, hot rows cached in HBM
        return int(weights * lf), 0, total
    return total, 0, 0


def table_infos(plan: ShardingPlan, header: dict[str, Any]) -> list[TableInfo]:
    """Per table: placement and (HBM, host) bytes per shard, with the optimizer state the plan
    file records for it (`unknown` where it records none: counted by weights only)."""
    device = header.get("compute_device", "cuda")
    tables = header.get("tables", {})
    out = []
    for module, mplan in plan.plan.items():
        for name, ps in mplan.items():
            t = tables.get(name, {})
            lf = ps.cache_params.load_factor if ps.cache_params is not None else None
            kind = (t.get("optimizer_state") or {}).get("kind", UNKNOWN_OPTIMIZER)
            info = TableInfo(module, name, ps.sharding_type, ps.compute_kernel, list(ps.ranks or []), lf, kind)
            if ps.sharding_spec is not None:
                for s in ps.sharding_spec.shards:
                    rows, cols = s.shard_sizes
                    hbm, host, ssd = _shard_bytes(rows, cols, ps.compute_kernel, lf, t, device)
                    info.shards.append(ShardInfo(s.placement.rank(), rows, cols, hbm, host, ssd))
                specs = ps.sharding_spec.shards
                info.shape = (
                    max(x.shard_offsets[0] + x.shard_sizes[0] for x in specs),
                    max(x.shard_offsets[1] + x.shard_sizes[1] for x in specs),
                )
            else:  # data-parallel: a full replica on every rank
                rows, cols = t.get("num_embeddings", 0), t.get("embedding_dim", 0)
                info.shape = (rows, cols) if "num_embeddings" in t else None
                for r in info.ranks:
                    hbm, host, ssd = _shard_bytes(rows, cols, ps.compute_kernel, lf, t, device)
                    info.shards.append(ShardInfo(r, rows, cols, hbm, host, ssd))
            out.append(info)
    return out


def rank_memory(infos: list[TableInfo], world_size: int) -> list[dict[str, int]]:
    ranks = [{"rank": r, "hbm_bytes": 0, "host_bytes": 0, "ssd_bytes": 0, "tables": 0} for r in range(world_size)]
    for t in infos:
        for s in t.shards:
            if 0 <= s.rank < world_size:
                ranks[s.rank]["hbm_bytes"] += s.hbm_bytes
                ranks[s.rank]["host_bytes"] += s.host_bytes
                ranks[s.rank]["ssd_bytes"] += s.ssd_bytes
                ranks[s.rank]["tables"] += 1
    return ranks


def report(plan: ShardingPlan, header: dict[str, Any]) -> dict[str, Any]:
    infos = table_infos(plan, header)
    tables = header.get("tables", {})
    return {
        "world_size": header["world_size"],
        "compute_device": header["compute_device"],
        "optimizer_unknown": sorted(t.table for t in infos if not (tables.get(t.table) or {}).get("optimizer_state")),
        "meta": header.get("meta", {}),
        "tables": [dict(asdict(t), hbm_bytes=t.hbm_bytes, host_bytes=t.host_bytes, ssd_bytes=t.ssd_bytes) for t in infos],
        "ranks": rank_memory(infos, header["world_size"]),
    }


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def has_ssd(rep: dict) -> bool:
    """Some table keeps rows on SSD (key_value): only then do reports show an SSD column, so plans
    without an SSD tier read as before."""
    return any(t.get("ssd_bytes") for t in rep["tables"])


def format_text(rep: dict[str, Any]) -> str:
    lines = [f"plan for {rep['world_size']} ranks ({rep['compute_device']})"]
    unknown = rep.get("optimizer_unknown") or []
    if unknown:
        lines.append(
            f"optimizer state: not recorded for {len(unknown)} of {len(rep['tables'])} tables (optimizer "
            "'unknown'): their memory counts weights only, a lower bound (save the plan with the model, "
            "sharding.plan.io.save_plan(..., model=...))"
        )
    lines.append("")
    tw = max([12] + [len(t["table"]) + 1 for t in rep["tables"]])
    mw = max([18] + [len(t["module"]) + 1 for t in rep["tables"]])
    ssd = has_ssd(rep)
    lines.append(
        f"{'table':<{tw}} {'module':<{mw}} {'sharding':<18} {'kernel':<18} {'optimizer':<16} {'ranks':<14} {'cache lf':>8} "
        f"{'HBM':>12} {'host':>12}" + (f" {'SSD':>15}" if ssd else "")
    )
    for t in rep["tables"]:
        ranks = ",".join(map(str, t["ranks"])) if len(t["ranks"]) <= 4 else f"{t['ranks'][0]}..{t['ranks'][-1]} ({len(t['ranks'])})"
        lf = "" if t["cache_load_factor"] is None else f"{t['cache_load_factor']:.2f}"
        lines.append(
            f"{t['table']:<{tw}} {t['module']:<{mw}} {t['sharding_type']:<18} {t['compute_kernel']:<18} {t['optimizer']:<16} "
            f"{ranks:<14} {lf:>8} {_mb(t['hbm_bytes']):>12} {_mb(t['host_bytes']):>12}" + (f" {_mb(t['ssd_bytes']):>15}" if ssd else "")
        )
    lines += ["", f"{'rank':<6} {'tables':>6} {'HBM':>12} {'host':>12}" + (f" {'SSD':>15}" if ssd else "")]
    for r in rep["ranks"]:
        lines.append(
            f"{r['rank']:<6} {r['tables']:>6} {_mb(r['hbm_bytes']):>12} {_mb(r['host_bytes']):>12}"
            + (f" {_mb(r.get('ssd_bytes', 0)):>15}" if ssd else "")
        )
    key = "hbm_bytes" if rep["compute_device"] == "cuda" else "host_bytes"
    top = max(rep["ranks"], key=lambda r: r[key])
    lines.append(f"largest: rank {top['rank']} with {_mb(top[key])} of {'HBM' if key == 'hbm_bytes' else 'host memory'}")
    if ssd:
        top = max(rep["ranks"], key=lambda r: r.get("ssd_bytes", 0))
        lines.append(f"largest SSD: rank {top['rank']} with {_mb(top['ssd_bytes'])} (key_value tables: FBGEMM's SSD kernels, CUDA only)")
    return "\n".join(lines)


def diff(a_plan: ShardingPlan, a_header: dict, b_plan: ShardingPlan, b_header: dict) -> dict[str, Any]:
    """Tables that moved or changed sharding/kernel/cache, and per-rank memory deltas (b - a)."""
    a = {(t.module, t.table): t for t in table_infos(a_plan, a_header)}
    b = {(t.module, t.table): t for t in table_infos(b_plan, b_header)}
    changes = []
    for key in sorted(set(a) | set(b)):
        ta, tb = a.get(key), b.get(key)
        if ta is None or tb is None:
            changes.append({"table": key[1], "module": key[0], "change": "added" if ta is None else "removed"})
            continue
        what = {}
        if ta.shape != tb.shape and ta.shape is not None and tb.shape is not None:  # another model, not another plan
            what["shape"] = [f"{ta.shape[0]:,} x {ta.shape[1]}", f"{tb.shape[0]:,} x {tb.shape[1]}"]
        for attr in ("sharding_type", "compute_kernel", "ranks", "cache_load_factor", "optimizer"):
            if getattr(ta, attr) != getattr(tb, attr):
                what[attr] = [getattr(ta, attr), getattr(tb, attr)]
        if [(s.rank, s.rows, s.cols) for s in ta.shards] != [(s.rank, s.rows, s.cols) for s in tb.shards] and "ranks" not in what:
            what["shards"] = "resized"
        if what:
            changes.append({"table": key[1], "module": key[0], **what})
    world = max(a_header["world_size"], b_header["world_size"])
    ma = rank_memory(list(a.values()), world)
    mb = rank_memory(list(b.values()), world)
    ranks = [
        {
            "rank": r,
            "hbm_bytes_delta": mb[r]["hbm_bytes"] - ma[r]["hbm_bytes"],
            "host_bytes_delta": mb[r]["host_bytes"] - ma[r]["host_bytes"],
            "ssd_bytes_delta": mb[r]["ssd_bytes"] - ma[r]["ssd_bytes"],
        }
        for r in range(world)
    ]
    plans = {k: [a_header.get(k), b_header.get(k)] for k in PLAN_FIELDS if a_header.get(k) != b_header.get(k)}
    meta_a, meta_b = a_header.get("meta") or {}, b_header.get("meta") or {}
    plans.update({k: [meta_a.get(k), meta_b.get(k)] for k in META_FIELDS if meta_a.get(k) != meta_b.get(k)})
    return {"plans": plans, "changes": changes, "ranks": ranks}


# What the two plans were made for: a difference here explains every table difference below it.
PLAN_FIELDS = ("world_size", "compute_device")
META_FIELDS = ("batch_size_per_rank", "planner", "topology")


def format_diff(d: dict[str, Any]) -> str:
    head = []
    if d.get("plans"):
        head = ["the plans are for different setups: " + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in d["plans"].items())]
    if not d["changes"]:
        lines = head + ["no table changed"]
    else:
        lines = head + [f"{len(d['changes'])} table(s) changed:"]
        for c in d["changes"]:
            detail = ", ".join(
                f"{k}: {v[0]} -> {v[1]}" if isinstance(v, list) and len(v) == 2 else f"{k}: {v}"
                for k, v in c.items()
                if k not in ("table", "module")
            )
            lines.append(f"  {c['table']} ({c['module']}): {detail}")
    lines.append("memory per rank (b - a):")
    ssd = any(r.get("ssd_bytes_delta") for r in d["ranks"])
    for r in d["ranks"]:
        lines.append(
            f"  rank {r['rank']}: HBM {r['hbm_bytes_delta'] / 2**20:+,.1f} MB, host {r['host_bytes_delta'] / 2**20:+,.1f} MB"
            + (f", SSD {r['ssd_bytes_delta'] / 2**20:+,.1f} MB" if ssd else "")
        )
    return "\n".join(lines)
