"""Experiment: eval AUC vs the merge interval k of hierarchical training (docs/kstep.md).

2 simulated hosts x 2 ranks: every run is two `torchrun --nnodes 2 --nproc_per_node 2` launches
joined on loopback (c10d rendezvous), as the slow tests do. Grid: k in {1, 4, 16, 64} x
(optimizer moments merged or not), on generated Criteo-like data (configs/experiments/kstep.yaml;
one epoch, so every run sees the same rows). Per run: final eval AUC and logloss, the oracle AUC
(the data's teacher), cross-host bytes per training sample (the merger's model of the traffic,
summed over all ranks; docs/kstep.md), and wall time (launch to exit, start-up and eval included).

    .venv/bin/python tools/experiments/kstep.py                 # the full grid, ~15 minutes on 2 cores
    .venv/bin/python tools/experiments/kstep.py --quick         # tiny data, to check the script (~2 min)
    .venv/bin/python tools/experiments/kstep.py --ks 1,16 --moments on --set train.max_steps=100
    .venv/bin/python tools/experiments/kstep.py --quick --ks 1,16 --net rate=100mbit   # root: a real, shaped link
    .venv/bin/python tools/experiments/kstep.py --quick --ks 16,64 --moments off --outer average,nesterov --compress none,bf16

`--net rate=R[,delay=D][,loss=P%]` runs each host in its own network namespace behind a tc-shaped
veth (tools/experiments/simnet.py; root, `ip` and `tc` needed, refused in one line otherwise): gloo between
hosts goes over the link, inside a host over that host's loopback, and each row also gets the
bytes the hosts sent into the link (veth counters, launch to exit) next to the modelled bytes,
plus training time and samples/s. Without --net both hosts share loopback (the default).

`--outer average,nesterov` and `--compress none,bf16` cross the grid with the merge's outer step
(DiLoCo's Nesterov, train.merge_outer) and bf16 parameter deltas (train.merge_compress); rows carry
`merge_outer` and `merge_compress`, and their labels and keys a suffix (`16 nesterov bf16`).

The network experiment (docs/kstep.md, "Measured: time vs k on a shaped link") adds
`--sync`, a synchronous baseline arm (one torchrec DMP sharded over all 4 ranks, `train.hosts=1`,
no merges; its cross-host bytes are modelled from its plan, `sync_cross_host_bytes`), and
`--eval-every N` for AUC-vs-training-time curves (time to reach the synchronous run's AUC). One
invocation per rate, all merged into one file with a per-link summary (epoch time per k,
speed-ups vs k=1 and vs sync, crossovers) and a time-vs-k plot:

    .venv/bin/python tools/experiments/kstep.py --ks 1,4,16,64 --moments off --sync --eval-every 64 \
        --net rate=1gbit --results benchmarks/results/DATE-kstep-network.json \
        --network-plot benchmarks/results/DATE-kstep-network.png \
        --dmpcollection

`--dmpcollection` tries torchrec's own 2D parallelism (DMPCollection) here and records the outcome.

Progress lines go to stderr; results to <out>/results.json, a plot to --plot (PNG) and a markdown
table to stdout. The last line of stdout is one JSON object with the headline figures: AUC per k,
the AUC gap k=16 vs k=1, the cross-host bytes ratio k=1 / k=16 and whether the target
(k=16 within 0.001 AUC of k=1 with 16x fewer cross-host bytes) is met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "experiments" / "kstep.yaml"
QUICK_CONFIG = REPO / "configs" / "experiments" / "kstep_quick.yaml"
TARGET_AUC_GAP = 0.001  # k=16 vs k=1 (the target; do not weaken)
TARGET_BYTES_RATIO = 16.0
HOSTS, RANKS_PER_HOST = 2, 2
SYNC = 0  # k of the synchronous baseline arm (no merges: one DMP over every rank of every host)
TIME_AUC_TOL = 0.001  # "reached the synchronous AUC": within this of its final AUC (also reported exact)
STOPS_PAYING = 0.10  # merges stop paying at the smallest k within 10% of the fastest k's epoch time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(msg: str) -> None:
    print(f"[exp_kstep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _forward(stream, sink: list[str], prefix: str) -> None:
    """Keeps a node's output; echoes rank 0's progress lines (step / eval / errors) to stderr."""
    for line in stream:
        sink.append(line)
        if line.startswith("[rank0]") and any(w in line for w in (" step ", "eval ", "summary", "Error")):
            print(f"{prefix} {line.rstrip()}", file=sys.stderr, flush=True)


def _stop_nodes(procs: list[subprocess.Popen], grace: float = 30.0) -> None:
    """Stops launched nodes that still run: SIGTERM first, so each torchrun agent stops its workers
    (torchrun starts them in sessions of their own, out of reach of the agent's group), then
    SIGKILL to each node's process group after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_one(
    config: Path,
    run_dir: Path,
    k: int,
    moments: bool,
    overrides: list[str],
    timeout: float,
    net: Any = None,
    rows: str = "touched",
    outer: str = "average",
    compress: str = "none",
) -> dict[str, Any]:
    """One 2 x 2 run; returns its summary plus the wall time. Raises on failure.

    `net` (a tools/experiments/simnet.py SimNet, up): node i runs in host namespace i, gloo on its veth
    (GLOO_SOCKET_IFNAME), the workers' store on host 0's veth address (`--local_addr`), the
    rendezvous store here on the bridge address; the row gets the bytes the hosts sent into the
    link (veth counters) next to the merger's model. None: both nodes on loopback."""
    port = _free_port()
    addr = net.bridge_addr if net is not None else "127.0.0.1"
    # The rendezvous store lives in this process, not in one of the agents (`is_host=false`): an
    # agent hosting it may exit first and leave the other's last store calls with a broken pipe.
    import torch.distributed

    store = torch.distributed.TCPStore(addr, port, is_master=True, multi_tenant=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if k == SYNC:  # the synchronous baseline: one DMP over all 4 ranks, sharded across both hosts
        arm_args = ["train.hosts=1", "train.merge_every=0", "train.merge_moments=false"]
        prefix = "  [sync]"
    else:
        arm_args = [f"train.merge_every={k}", f"train.merge_moments={str(moments).lower()}", f"train.merge_rows={rows}"]
        # the outer step / bf16 deltas only where the arm asks for them (the default arms' commands as before)
        arm_args += [f"train.merge_outer={outer}"] if outer != "average" else []
        arm_args += [f"train.merge_compress={compress}"] if compress != "none" else []
        prefix = f"  [k={k} moments={'on' if moments else 'off'} rows={rows}{_variant_of(outer, compress, ' ')}]"
    if run_dir.exists():  # this tool's own output from an earlier invocation: the run starts afresh
        shutil.rmtree(run_dir)
    args = [f"run_dir={run_dir}", "train.threads_per_rank=1", *arm_args, *overrides]
    procs, outs, threads = [], [], []
    before = net.counters() if net is not None else None
    t0 = time.perf_counter()
    try:
        for node in range(HOSTS):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(HOSTS),
                "--nproc_per_node",
                str(RANKS_PER_HOST),
                "--node_rank",
                str(node),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"{addr}:{port}",
                "--rdzv_id",
                f"kstep{port}",
                "--rdzv_conf",
                "is_host=false",
            ]
            node_env = env
            if net is not None:
                cmd = [*net.exec_prefix(node), *cmd, "--local_addr", net.host_addr(node)]
                node_env = dict(env, **net.host_env(node))
            cmd += ["-m", "recsys.train", "--config", str(config), *args]
            p = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=node_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            sink: list[str] = []
            th = threading.Thread(target=_forward, args=(p.stdout, sink, prefix), daemon=True)
            th.start()
            procs.append(p)
            outs.append(sink)
            threads.append(th)
        try:
            for p in procs:
                p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"run k={k} moments={moments} exceeded {timeout:.0f} s") from None
    finally:
        _stop_nodes(procs)  # a timeout, Ctrl-C or SIGTERM: no node outlives this run
    wall = time.perf_counter() - t0
    after = net.counters() if net is not None else None
    del store  # every agent has exited
    for th in threads:
        th.join(timeout=10)
    for p, sink in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"run k={k} moments={moments} failed (exit {p.returncode}):\n{''.join(sink)[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    curve = eval_curve(run_dir / "metrics.jsonl")
    per_epoch = steps_per_epoch_of(run_dir / "metrics.jsonl") or s["steps"]
    train_s = s.get("train_s_no_eval_this_run", s["train_wall_s_this_run"])
    row = {
        "arm": "sync" if k == SYNC else "kstep",
        "k": k,
        "moments": moments,
        "overrides": list(overrides),
        "auc": s["auc"],
        "logloss": s["logloss"],
        "oracle_auc": s.get("oracle_auc"),
        "steps": s["steps"],
        "samples": s["samples"],
        "steps_per_epoch": per_epoch,
        "wall_s": wall,
        "train_wall_s": s["train_wall_s_this_run"],
        "train_s": train_s,
        "epoch_s": train_s * per_epoch / s["steps"],
        "samples_per_s": s["samples"] / train_s,
        "eval_curve": curve,
    }
    if k == SYNC:
        row.update(merges=0, merge_route=None, **sync_cross_host_bytes(run_dir / "plan.json", dict(s, evals=len(curve))))
    else:
        row.update(
            merges=s["merges"],
            merge_route=s.get("merge_route"),
            cross_host_bytes_total=s["cross_host_bytes_total"],
            merge_payload_bytes_per_rank=s["merge_payload_bytes_per_rank"],
            replica_divergence=s["replica_divergence"],
            merge_rows=s.get("merge_rows", "all"),
            merge_outer=outer,
            merge_compress=compress,
            rows_merged_last=s.get("rows_merged_last"),
            rows_tracked=s.get("rows_tracked"),
            merge_seconds=s.get("merge_seconds"),
            merge_outer_state_bytes=s.get("merge_outer_state_bytes"),  # all ranks: anchors, momentum, residuals
        )
    row["cross_host_bytes_per_sample"] = row["cross_host_bytes_total"] / s["samples"]
    row["net"] = str(net.link) if net is not None else "loopback"
    if net is not None:
        sent = {h: after[h] - before[h] for h in after}
        row.update(
            veth_cross_host_bytes=sent["sent_total"],  # launch to exit: rendezvous, planning, eval included
            veth_bytes={h: v for h, v in sent.items() if h != "sent_total"},
            veth_vs_model=sent["sent_total"] / (row["cross_host_bytes_total"] + row.get("cross_host_bytes_evals", 0))
            if row["cross_host_bytes_total"]
            else None,
        )
    return row


def eval_curve(metrics: Path) -> list[dict[str, float]]:
    """(step, training seconds without evals, AUC) of every eval of a run: its AUC-vs-time curve."""
    out = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "eval" and "train_s" in rec:
            out.append({"step": rec["step"], "train_s": rec["train_s"], "auc": rec["auc"]})
    return out


def steps_per_epoch_of(metrics: Path) -> int | None:
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("epoch"):
            return round(rec["step"] / rec["epoch"])
    return None


def time_to_auc(curve: list[dict[str, float]], target: float) -> float | None:
    """Training seconds (evals not counted) until the first eval at or above `target`; None: never."""
    return next((p["train_s"] for p in curve if p["auc"] >= target), None)


def sync_cross_host_bytes(plan_json: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Modelled cross-host bytes of the synchronous run (it has no merger to count them): the
    plan's embedding traffic per step (sharding/planner/cost/traffic.py: ids, pooled outputs and their
    gradients between ranks, batch per rank = global batch / world) between ranks of different
    hosts (host-major ranks), plus DDP's all-reduce of the dense parameters modelled as a ring in
    rank order (each rank sends 2(W-1)/W x P to its successor; the H edges between hosts carry it
    across), times the steps."""
    sys.path.insert(0, str(REPO))
    from sharding.plan.io import read_plan_file
    from sharding.plan.report import table_infos
    from sharding.planner.cost.traffic import traffic

    plan, header = read_plan_file(plan_json)
    world = summary["world_size"]
    tr = traffic(table_infos(plan, header), world, summary["global_batch"] // world)
    host = [r // RANKS_PER_HOST for r in range(world)]
    emb = sum(float(tr.total[a, b]) for a in range(world) for b in range(world) if host[a] != host[b])
    dense = HOSTS * 2 * (world - 1) / world * summary.get("dense_parameter_bytes", 0)
    # evals run on the same 4-rank DMP, so their forward all-to-all crosses hosts too (k-step runs
    # evaluate inside each host); counted apart, to compare with the veth counters (launch to exit)
    ev = traffic(table_infos(plan, header), world, summary.get("eval_rows", 0) // world)
    per_eval = sum(float(ev.fwd[a, b]) for a in range(world) for b in range(world) if host[a] != host[b])
    return {
        "cross_host_bytes_total": (emb + dense) * summary["steps"],
        "cross_host_bytes_per_step_embeddings": emb,
        "cross_host_bytes_per_step_dense": dense,
        "cross_host_bytes_evals": per_eval * summary.get("evals", 1),
    }


def probe_dmpcollection() -> dict[str, Any]:
    """torchrec's 2D parallelism (DMPCollection: shards inside a group, replicas across groups,
    `sync()` every k steps) as an arm: built the documented way on this machine's device (CPU,
    gloo). Returns whether it constructs, and the error if not (subprocess, so this launcher keeps
    no process group)."""
    code = r"""
import os, tempfile, json, torch, torch.distributed as dist
import torchrec
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
f = tempfile.NamedTemporaryFile(delete=False)
dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"])],
                             device=torch.device("meta"))
plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).collective_plan(ebc, pg=dist.GroupMember.WORLD)
try:
    DMPCollection(module=ebc, device=torch.device("cpu"), plan=plan, world_size=1, sharding_group_size=1, global_pg=dist.GroupMember.WORLD)
    out = {"constructs": True, "error": None}
except Exception as e:
    out = {"constructs": False, "error": f"{type(e).__name__}: {e}"}
out["torchrec"] = torchrec.__version__
print(json.dumps(out))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        out = json.loads(last)
    except json.JSONDecodeError:
        out = {"constructs": False, "error": f"probe failed (exit {p.returncode}): {p.stderr.strip()[-300:]}"}
    out["arm"] = "dmpcollection"
    return out


def _variant_of(outer: str, compress: str, sep: str = "_") -> str:
    """'' for plain fp32 averaging, else e.g. '_nesterov', '_bf16', '_nesterov_bf16'."""
    return "".join(sep + x for x in (outer, compress) if x not in ("average", "none"))


def _variant(r: dict[str, Any]) -> str:
    """The arm's outer step and compression (rows written before they existed: plain averaging)."""
    return _variant_of(r.get("merge_outer", "average"), r.get("merge_compress", "none"))


def _k_label(r: dict[str, Any]) -> str:
    return (
        "sync"
        if r.get("arm") == "sync"
        else str(r["k"]) + _variant_of(r.get("merge_outer", "average"), r.get("merge_compress", "none"), " ")
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown; with --net also training time, samples/s and the bytes on the veth counters."""
    net = any("veth_cross_host_bytes" in r for r in rows)
    head = "| k | moments merged | eval AUC | oracle AUC | logloss | merges | cross-host bytes/sample | wall s |"
    if net:
        head += " train s | epoch s | samples/s | veth bytes/sample | veth / model |"
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        line = (
            f"| {_k_label(r)} | {'yes' if r['moments'] else 'no'} | {r['auc']:.4f} | {r['oracle_auc']:.4f} | "
            f"{r['logloss']:.4f} | {r['merges']} | {r['cross_host_bytes_per_sample']:,.0f} | {r['wall_s']:.0f} |"
        )
        if net:
            ratio = r.get("veth_vs_model")
            line += (
                f" {r['train_s']:.1f} | {r['epoch_s']:.1f} | {r['samples_per_s']:,.0f} | "
                f"{r['veth_cross_host_bytes'] / r['samples']:,.0f} | {f'{ratio:.3f}' if ratio else '-'} |"
            )
        out.append(line)
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sync = [r for r in rows if r.get("arm") == "sync"]
    rows = [r for r in rows if r.get("arm") != "sync"]
    if not rows:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in sync:
        ax1.axhline(r["auc"], color="black", ls=":", lw=1, label="synchronous DMP (4 ranks)")
        ax2.axhline(r["cross_host_bytes_per_sample"], color="black", ls=":", lw=1, label="synchronous DMP (model)")
    for (moments, kind), style in (((False, "all"), "o-"), ((True, "all"), "s--"), ((False, "touched"), "^-"), ((True, "touched"), "v--")):
        rs = sorted((r for r in rows if r["moments"] == moments and _rows_of(r) == kind), key=lambda r: r["k"])
        if not rs:
            continue
        label = ("moments merged" if moments else "moments not merged") + (", touched rows" if kind == "touched" else "")
        ax1.plot([r["k"] for r in rs], [r["auc"] for r in rs], style, label=label)
        ax2.plot([r["k"] for r in rs], [r["cross_host_bytes_per_sample"] for r in rs], style, label=label)
    k1 = [r["auc"] for r in rows if r["k"] == 1]
    if k1:
        best = max(k1)
        ax1.axhspan(best - TARGET_AUC_GAP, best, color="green", alpha=0.12, label="within 0.001 of best k=1")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (steps between merges)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("final eval AUC")
    ax1.set_title(f"AUC vs k (oracle {rows[0]['oracle_auc']:.4f})")
    ax2.set_yscale("log")
    ax2.set_ylabel("cross-host bytes per sample")
    ax2.set_title("cross-host traffic (all ranks)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def key(r):
        return ("moments" if r["moments"] else "no_moments") + ("_touched" if _rows_of(r) == "touched" else "") + _variant(r)

    sync = [r for r in rows if r.get("arm") == "sync"]
    rows = [r for r in rows if r.get("arm") != "sync"]
    if not rows:
        return {"sync": _sync_head(sync)}

    auc: dict[str, dict[str, float]] = {}
    for r in rows:
        auc.setdefault(f"k{r['k']}", {})[key(r)] = round(r["auc"], 6)
    out: dict[str, Any] = {"auc": auc, "oracle_auc": rows[0]["oracle_auc"]}
    by = {(r["k"], key(r)): r for r in rows}
    names = sorted({key(r) for r in rows})
    gaps, ratios, met = {}, {}, {}
    for name in names:
        if (1, name) in by and (16, name) in by:
            a, b = by[(1, name)], by[(16, name)]
            gaps[name] = round(a["auc"] - b["auc"], 6)
            ratios[name] = round(a["cross_host_bytes_total"] / b["cross_host_bytes_total"], 3)
            met[name] = gaps[name] <= TARGET_AUC_GAP and ratios[name] >= TARGET_BYTES_RATIO - 1e-9
    if gaps:
        out.update(auc_gap_k16_vs_k1=gaps, bytes_ratio_k1_k16=ratios, target_met=met)
    out["bytes_per_sample"] = {f"k{r['k']}_{key(r)}": round(r["cross_host_bytes_per_sample"], 1) for r in rows}
    out["wall_s_total"] = round(sum(r["wall_s"] for r in rows), 1)
    if any("veth_cross_host_bytes" in r for r in rows):
        out["net"] = rows[0]["net"]
        out["veth_bytes"] = {f"k{r['k']}_{key(r)}": r["veth_cross_host_bytes"] for r in rows}
        out["train_wall_s"] = {f"k{r['k']}_{key(r)}": round(r["train_wall_s"], 2) for r in rows}
        speed = {}
        for name in names:
            if (1, name) in by and (16, name) in by:
                speed[name] = round(by[(1, name)]["train_wall_s"] / by[(16, name)]["train_wall_s"], 3)
        if speed:
            out["train_time_ratio_k1_k16"] = speed
    if sync:
        out["sync"] = _sync_head(sync)
    return out


def _sync_head(sync: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not sync:
        return None
    r = sync[-1]
    return {"auc": round(r["auc"], 6), "epoch_s": round(r["epoch_s"], 2), "bytes_per_sample": round(r["cross_host_bytes_per_sample"], 1)}


# -- the network experiment across invocations (one per rate): the --results JSON ---------------------
def _row_key(r: dict[str, Any]) -> tuple:
    return (r.get("net", "loopback"), r.get("arm", "kstep"), r["k"], r["moments"], r.get("merge_route"), _rows_of(r), _variant(r))


def _rows_of(r: dict[str, Any]) -> str:
    """Which rows the arm's merges averaged (rows written before touched-row merges existed: all)."""
    return "-" if r.get("arm") == "sync" else r.get("merge_rows", "all")


def _arm_key(r: dict[str, Any]) -> str:
    """k, suffixed for touched-row merges and the outer step / bf16 deltas: '16' (whole shards),
    '16-touched', '16-touched-nesterov-bf16'."""
    return (
        str(r["k"])
        + ("-touched" if _rows_of(r) == "touched" else "")
        + _variant_of(r.get("merge_outer", "average"), r.get("merge_compress", "none"), "-")
    )


def merge_results(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any], probe: dict[str, Any] | None) -> dict[str, Any]:
    """Adds this invocation's rows to `path` (a row with the same link, arm, k and moments is
    replaced), recomputes the per-link summary, writes atomically and returns the document."""
    doc: dict[str, Any] = {"rows": [], "runs": []}
    if path.exists():
        doc = json.loads(path.read_text())
    new = {_row_key(r) for r in rows}
    doc["rows"] = [r for r in doc.get("rows", []) if _row_key(r) not in new] + rows
    doc["rows"].sort(key=lambda r: (_rate_of(r.get("net", "loopback")), r.get("arm") != "sync", r["moments"], r["k"]))
    doc.setdefault("runs", []).append(meta)
    if probe is not None:
        doc["dmpcollection"] = probe
    doc["summary"] = network_summary(doc["rows"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return doc


def _rate_of(net: str) -> float:
    """Bits/s of a link label ("rate=1gbit"; loopback: infinite), for sorting and plotting."""
    for part in net.split(","):
        key, _, val = part.partition("=")
        if key.strip() == "rate":
            for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
                if val.endswith(unit):
                    return float(val[: -len(unit)]) * mult
    return float("inf")


def network_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per link: the synchronous run, then per k (moments not merged where both exist) the epoch
    time, its speed-up over k=1 and over sync, the AUC gap to k=1 and to sync, the training time
    to reach sync's final AUC (exact, and within TIME_AUC_TOL), and the crossovers: the smallest k
    that beats sync per epoch, and the smallest k within STOPS_PAYING of the fastest k's epoch
    time (larger k buys less than that: where merges stop paying)."""
    out: dict[str, Any] = {}
    for net in sorted({r.get("net", "loopback") for r in rows}, key=_rate_of):
        rs = [r for r in rows if r.get("net", "loopback") == net]
        sync = next((r for r in rs if r.get("arm") == "sync"), None)
        ks: dict[str, dict[str, Any]] = {}
        for r in sorted((r for r in rs if r.get("arm") != "sync"), key=lambda r: r["moments"], reverse=True):
            ks[_arm_key(r)] = r  # moments not merged wins when both exist (sorted last)
        entry: dict[str, Any] = {"rate_bps": None if _rate_of(net) == float("inf") else _rate_of(net)}
        if sync is not None:
            entry["sync"] = {
                "auc": sync["auc"],
                "epoch_s": sync["epoch_s"],
                "steps": sync["steps"],
                "cross_host_bytes_per_sample": sync["cross_host_bytes_per_sample"],
                "veth_bytes_per_sample": sync.get("veth_cross_host_bytes", 0) / sync["samples"] or None,
            }
        per_k = {}
        for k in sorted(ks, key=lambda a: (int(a.split("-")[0]), a)):
            r = ks[k]
            e: dict[str, Any] = {
                "moments": r["moments"],
                "auc": r["auc"],
                "epoch_s": r["epoch_s"],
                "steps": r["steps"],
                "cross_host_bytes_per_sample": r["cross_host_bytes_per_sample"],
            }
            if "1" in ks:
                e["speedup_vs_k1"] = ks["1"]["epoch_s"] / r["epoch_s"]
                e["auc_gap_to_k1"] = ks["1"]["auc"] - r["auc"]
            if r.get("rows_tracked"):
                e["rows_merged_share"] = r["rows_merged_last"] / r["rows_tracked"]
            if sync is not None:
                e["speedup_vs_sync"] = sync["epoch_s"] / r["epoch_s"]
                e["auc_gap_to_sync"] = sync["auc"] - r["auc"]
                e["time_to_sync_auc_s"] = time_to_auc(r.get("eval_curve", []), sync["auc"])
                e["time_to_sync_auc_tol_s"] = time_to_auc(r.get("eval_curve", []), sync["auc"] - TIME_AUC_TOL)
            per_k[k] = e
        entry["k"] = per_k
        if ks:
            for rows_kind, suffix in (("all", ""), ("touched", "_touched")):
                same = {r["k"]: r for r in ks.values() if _rows_of(r) == rows_kind}
                if not same:
                    continue
                best = min(r["epoch_s"] for r in same.values())
                entry["k_stops_paying" + suffix] = min(k for k, r in same.items() if r["epoch_s"] <= best * (1 + STOPS_PAYING))
                if sync is not None:
                    entry["k_beats_sync" + suffix] = min((k for k, r in same.items() if r["epoch_s"] < sync["epoch_s"]), default=None)
            if sync is not None:
                entry["sync_time_to_own_auc_s"] = time_to_auc(sync.get("eval_curve", []), sync["auc"])
        out[net] = entry
    return out


def network_table(doc: dict[str, Any]) -> str:
    """Markdown, one row per (link, arm): what docs/kstep.md shows from the results file."""
    head = (
        "| link | arm | steps | epoch s | samples/s | vs k=1 | vs sync | eval AUC | AUC gap to sync | "
        "time to sync AUC s (exact / -0.001) | modelled cross-host B/sample | veth B/sample |"
    )
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    by_net: dict[str, list[dict[str, Any]]] = {}
    for r in doc["rows"]:
        by_net.setdefault(r.get("net", "loopback"), []).append(r)
    for net in sorted(by_net, key=_rate_of):
        e = doc["summary"][net]
        rows = sorted(by_net[net], key=lambda r: (r.get("arm") != "sync", r["moments"], _rows_of(r), r["k"]))
        for r in rows:
            sync = r.get("arm") == "sync"
            arm = (
                "sync DMP"
                if sync
                else (f"k={r['k']}" + (", moments" if r["moments"] else "") + (", touched rows" if _rows_of(r) == "touched" else ""))
            )

            def f(x, fmt):
                return "-" if x is None else format(x, fmt)

            t_exact = t_tol = None
            if not sync and "sync" in e:
                t_exact = time_to_auc(r.get("eval_curve", []), e["sync"]["auc"])
                t_tol = time_to_auc(r.get("eval_curve", []), e["sync"]["auc"] - TIME_AUC_TOL)
            k1 = e["k"].get("1")
            vs_k1 = None if sync or k1 is None else k1["epoch_s"] / r["epoch_s"]
            vs_sync = None if sync or "sync" not in e else e["sync"]["epoch_s"] / r["epoch_s"]
            gap = None if sync or "sync" not in e else e["sync"]["auc"] - r["auc"]
            veth = r.get("veth_cross_host_bytes")
            model = r["cross_host_bytes_total"] + r.get("cross_host_bytes_evals", 0)
            out.append(
                f"| {net} | {arm} | {r['steps']} | {r['epoch_s']:.1f} | {r['samples_per_s']:,.0f} | {f(vs_k1, '.2f')} | "
                f"{f(vs_sync, '.2f')} | {r['auc']:.4f} | {f(gap, '+.4f')} | {f(t_exact, '.0f')} / {f(t_tol, '.0f')} | "
                f"{model / r['samples']:,.0f} | {'-' if veth is None else format(veth / r['samples'], ',.0f')} |"
            )
    return "\n".join(out)


def plot_network(doc: dict[str, Any], path: Path) -> None:
    """Time per epoch vs k, one line per link (synchronous DMP dotted, same colour), and final AUC vs k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (net, e) in enumerate(doc["summary"].items()):
        color = f"C{i}"
        steps = {x["steps"] for x in e["k"].values()}
        tag = f" ({steps.pop()} steps)" if len(steps) == 1 and len({r["steps"] for r in doc["rows"]}) > 1 else ""
        for suffix, style, what in (("", "o-", "whole shards"), ("-touched", "^--", "touched rows")):
            keys = sorted((a for a in e["k"] if a.endswith(suffix) and (suffix or "-" not in a)), key=lambda a: int(a.split("-")[0]))
            if keys:
                ks = [int(a.split("-")[0]) for a in keys]
                ax1.plot(ks, [e["k"][a]["epoch_s"] for a in keys], style, color=color, label=f"k-step ({what}), {net}")
                ax2.plot(ks, [e["k"][a]["auc"] for a in keys], style, color=color, label=f"k-step ({what}), {net}{tag}")
        if "sync" in e:
            ax1.axhline(e["sync"]["epoch_s"], color=color, ls=":", label=f"sync DMP, {net}")
            ax2.axhline(e["sync"]["auc"], color=color, ls=":", label=f"sync DMP, {net}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (steps between merges)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("training seconds per epoch (evals excluded)")
    ax1.set_title("time per epoch vs k, per cross-host rate")
    ax2.set_ylabel("final eval AUC")
    ax2.set_title("AUC vs k (dotted: synchronous DMP)")
    fig.suptitle("2 simulated hosts x 2 ranks behind a tc-shaped veth link (tools/experiments/simnet.py)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None, help=f"default {CONFIG.relative_to(REPO)}")
    ap.add_argument("--quick", action="store_true", help=f"tiny data ({QUICK_CONFIG.relative_to(REPO)})")
    ap.add_argument("--ks", default="1,4,16,64", help="merge intervals, comma-separated")
    ap.add_argument("--moments", choices=("both", "on", "off"), default="both")
    ap.add_argument(
        "--rows", default="touched", help="which rows merges average, comma-separated: touched (rows looked up since the last merge), all"
    )
    ap.add_argument("--out", type=Path, default=None, help="run directories and results.json (default runs/exp_kstep[_quick])")
    ap.add_argument("--plot", type=Path, default=None, help="PNG (default <out>/kstep_auc.png)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument(
        "--net",
        default=None,
        metavar="rate=1gbit,delay=1ms",
        help=(
            "run each host in a network namespace behind a shaped link (tools/experiments/simnet.py; root, ip, tc); "
            "default: both hosts on loopback"
        ),
    )
    ap.add_argument(
        "--sync", action="store_true", help="add the synchronous baseline: one DMP sharded over all 4 ranks (train.hosts=1, no merges)"
    )
    ap.add_argument(
        "--eval-every", type=int, default=0, help="mid-run evals every N steps (a multiple of every k), for the time to reach sync's AUC"
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help="also merge the rows into this JSON (e.g. benchmarks/results/DATE-kstep-network.json: one file "
        "over several invocations, one per rate) and recompute the per-link summary",
    )
    ap.add_argument("--network-plot", type=Path, default=None, help="with --results: time-vs-k plot of every link in it")
    ap.add_argument(
        "--dmpcollection", action="store_true", help="try torchrec's DMPCollection (2D parallelism) here and record whether it runs"
    )
    ap.add_argument(
        "--outer", default="average", help="outer step at merges, comma-separated: average (plain), nesterov (DiLoCo; train.merge_outer)"
    )
    ap.add_argument(
        "--compress", default="none", help="parameter deltas at merges, comma-separated: none (fp32), bf16 (train.merge_compress)"
    )
    a = ap.parse_args(argv)

    config = a.config or (QUICK_CONFIG if a.quick else CONFIG)
    out = a.out or REPO / "runs" / ("exp_kstep_quick" if a.quick else "exp_kstep")
    ks = [int(x) for x in a.ks.split(",") if x.strip()]
    moments = {"both": [False, True], "on": [True], "off": [False]}[a.moments]
    merge_rows = [x.strip() for x in a.rows.split(",") if x.strip()]
    if not merge_rows or set(merge_rows) - {"touched", "all"}:
        ap.error(f"--rows {a.rows}: expected touched, all or both")
    outers = [x.strip() for x in a.outer.split(",") if x.strip()]
    if not outers or set(outers) - {"average", "nesterov"}:
        ap.error(f"--outer {a.outer}: expected average, nesterov or both")
    compresses = [x.strip() for x in a.compress.split(",") if x.strip()]
    if not compresses or set(compresses) - {"none", "bf16"}:
        ap.error(f"--compress {a.compress}: expected none, bf16 or both")
    grid = [(k, m, rw, o, c) for o in outers for c in compresses for rw in merge_rows for m in moments for k in ks]
    if a.sync:
        grid.insert(0, (SYNC, False, "-", "average", "none"))
    if a.eval_every:
        bad = [k for k in ks if a.eval_every % k]
        if bad:
            ap.error(f"--eval-every {a.eval_every} is not a multiple of k={bad[0]} (mid-run evals must see merged replicas)")
        a.overrides = [*a.overrides, f"train.eval_every={a.eval_every}"]
    net = None
    if a.net is not None:
        try:
            from tools.experiments.simnet import LinkSpec, SimNet, SimNetError
        except ImportError:  # run as a script: tools/ is on sys.path
            from simnet import LinkSpec, SimNet, SimNetError  # type: ignore[no-redef]
        try:
            net = SimNet(f"k{os.getpid() % 10**7}", HOSTS, LinkSpec.parse(a.net))
            net.__enter__()  # torn down in the finally below, on SIGTERM/SIGHUP and at exit too
        except SimNetError as e:
            print(f"exp_kstep: --net {a.net}: {e}", file=sys.stderr)
            return 2
        _log(f"simulated hosts: {', '.join(f'{net.ns(i)} {net.host_addr(i)}' for i in range(HOSTS))}, link {net.link}")
    out.mkdir(parents=True, exist_ok=True)
    _log(f"{len(grid)} runs of {HOSTS} hosts x {RANKS_PER_HOST} ranks, config {config}, overrides {a.overrides}")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for i, (k, m, rw, o, c) in enumerate(grid, 1):
            what = "synchronous DMP over all ranks" if k == SYNC else f"k={k} moments={'merged' if m else 'not merged'} rows={rw}"
            _log(f"run {i}/{len(grid)}: {what}{_variant_of(o, c, ' ')}")
            run_dir = out / ("sync" if k == SYNC else f"k{k}_{'mom' if m else 'nomom'}_{rw}{_variant_of(o, c)}")
            r = run_one(config, run_dir, k, m, a.overrides, a.timeout, net, rows=rw, outer=o, compress=c)
            rows.append(r)
            elapsed = time.perf_counter() - t0
            _log(
                f"run {i}/{len(grid)} done in {r['wall_s']:.0f} s ({r['epoch_s']:.1f} s per epoch): "
                f"auc {r['auc']:.4f} (oracle {r['oracle_auc']:.4f}) "
                f"{r['cross_host_bytes_per_sample']:,.0f} cross-host B/sample"
                + (f" (veth {r['veth_cross_host_bytes'] / r['samples']:,.0f})" if net is not None else "")
                + f"; ETA {elapsed / i * (len(grid) - i):.0f} s"
            )
    finally:
        if net is not None:
            net.__exit__(None, None, None)
    meta = {
        "config": str(config),
        "overrides": a.overrides,
        "hosts": HOSTS,
        "ranks_per_host": RANKS_PER_HOST,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "net": str(net.link) if net is not None else "loopback",
    }
    try:
        import torch
        import torchrec

        meta["versions"] = f"torch {torch.__version__}, torchrec {torchrec.__version__}"
    except ImportError:
        pass
    head = headline(rows)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "headline": head}, indent=2) + "\n")
    png = a.plot or out / "kstep_auc.png"
    try:
        plot(rows, png, f"{config.name}, {HOSTS} hosts x {RANKS_PER_HOST} ranks, {rows[0]['samples']:,} samples")
        head["plot"] = str(png)
    except ImportError:
        _log("matplotlib not installed: no plot")
    if a.results is not None:
        probe = probe_dmpcollection() if a.dmpcollection else None
        doc = merge_results(a.results, rows, meta, probe)
        head["network_summary"] = {
            net: {
                "k_beats_sync": e.get("k_beats_sync"),
                "k_stops_paying": e.get("k_stops_paying"),
                "k_beats_sync_touched": e.get("k_beats_sync_touched"),
                "speedup_k16_vs_k1": (e["k"].get("16") or {}).get("speedup_vs_k1"),
                "speedup_k16_touched_vs_sync": (e["k"].get("16-touched") or {}).get("speedup_vs_sync"),
            }
            for net, e in doc["summary"].items()
        }
        if probe is not None:
            head["dmpcollection"] = probe
        print(network_table(doc))
        if a.network_plot is not None:
            plot_network(doc, a.network_plot)
            head["network_plot"] = str(a.network_plot)
    print(table(rows))
    print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
