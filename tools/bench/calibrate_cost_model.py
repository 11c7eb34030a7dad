"""Calibration: the planner's step-time model against measured steps on this machine.

Two measurements, both on real process groups (gloo on CPU; NCCL when the ranks have GPUs):

1. collectives: the latency of a tiny ``all_to_all_single`` (8 bytes to each peer) and the
   bandwidth of a large one, against the model's collective latency and pair bandwidth
   (``sharding/planner/cost/model.py``, ``sharding/topology/paths.py`` on the topology);
2. plans: one EmbeddingBagCollection (Criteo-Kaggle-like: 26 tables of dim 16, rows capped at
   ``--max-rows``) sharded by several plans of the topology-aware planner, each restricted to one
   sharding type (and its unrestricted choice), trained with the fused optimizer; per plan the
   median time of a sparse step (input dist, lookup, output dist, backward + fused update; the
   slowest rank's) against the model's step time for that plan.

Prints each plan's measured and modeled ms, their ratio, a least-squares fit measured ~ a + b x
modeled, and the Spearman rank correlation (does the model order the plans as the machine does?).
Last line: one JSON object.

    .venv/bin/python tools/bench/calibrate_cost_model.py                 # 2 CPU ranks, ~2 min
    .venv/bin/python tools/bench/calibrate_cost_model.py --nproc 8 --topology dgx-a100   # on a GPU host

With one GPU (``--nproc 1``) there is no communication to measure; the plans then calibrate the
lookup and host-memory terms (HBM, UVM, UVM caching) of that GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from recsys.config import CARDINALITY_PRESETS  # noqa: E402
from recsys.training.distributed import free_port  # noqa: E402

# the planner's own choice; the planner restricted to one sharding type (column_wise_<k>: every
# table cut into k column shards); every table whole on rank 0 (the most unbalanced plan)
# (torchrec's stock sharder offers row-wise and table-row-wise on GPUs only); on GPUs also every
# table in host memory (fused_uvm) and behind a UVM cache (fused_uvm_caching, load factor 0.2)
PLANS = ["planner", "table_wise", "column_wise_2", "column_wise_4", "table_column_wise_2", "rank0"]
GPU_PLANS = ["row_wise", "table_row_wise", "table_wise:fused_uvm", "table_wise:fused_uvm_caching"]


def _tables(max_rows: int, dim: int):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=f"t_{i}", embedding_dim=dim, num_embeddings=min(n, max_rows), feature_names=[f"f_{i}"])
        for i, n in enumerate(CARDINALITY_PRESETS["criteo_kaggle_raw"])
    ]


def _cluster(args, world: int):
    """The topology of the run; on GPUs with fewer ranks than the topology has (``--nproc 1`` on
    one GPU of a DGX), its first host cut down to the first ``world`` GPUs (their HBM, switches,
    NUMA nodes and NICs as the file says)."""
    import dataclasses

    from sharding.topology.topology_file import load_topology
    from sharding.planner.job_topology import cluster_for

    device = "cuda" if args.cuda else "cpu"
    name = args.topology if args.cuda else (args.topology or "cpu-gloo")
    if args.cuda:
        full = load_topology(name)
        if full.world_size > world and full.local_world_size >= world:
            h = full.hosts[0]
            host = dataclasses.replace(h, gpus=h.gpus[:world])
            return dataclasses.replace(full, hosts=(host,), name=f"{full.name}[:{world}]")
    return cluster_for(name, device, world, world)


def _plan(args, world: int, which: str):
    """(ShardingPlan, modeled step seconds, sharding types) of the topology-aware planner, restricted to
    one sharding type unless ``which == 'planner'``."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from sharding.planner.topology_planner import TopologyAwarePlanner, default_constraints

    cluster = _cluster(args, world)
    module = EmbeddingBagCollection(tables=_tables(args.max_rows, args.dim), device=torch.device("meta"))
    if which == "rank0":
        return _rank0_plan(args, cluster, module)
    cons = default_constraints(module, cluster.compute_device)
    if which != "planner":
        which, _, kernel = which.partition(":")
        st, _, k = which.rpartition("_") if which[-1].isdigit() else (which, "", "")
        cons = {
            t: ParameterConstraints(
                sharding_types=[st], compute_kernels=[kernel or "fused"], min_partition=args.dim // int(k) if k else None
            )
            for t in cons
        }
    planner = TopologyAwarePlanner(cluster, args.batch, cons, column_splits=() if which != "planner" else (2, 4))
    plan = planner.plan(module, [EmbeddingBagCollectionSharder()])
    types = sorted({so.sharding_type for so in planner.best_plan})
    return plan, planner.cost_model.score(planner.best_plan).step_time, types


def _rank0_plan(args, cluster, module):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from sharding.planner.cost.model import TopologyCostModel

    per = {t.name: table_wise(rank=0, compute_kernel="fused") for t in _tables(args.max_rows, args.dim)}
    mplan = construct_module_sharding_plan(
        module,
        per_param_sharding=per,
        local_size=cluster.local_world_size,
        world_size=cluster.world_size,
        device_type="cuda" if args.cuda else "cpu",
    )
    plan = ShardingPlan({"": mplan})
    tables = {t.name: {"num_embeddings": t.num_embeddings, "embedding_dim": t.embedding_dim} for t in _tables(args.max_rows, args.dim)}
    return plan, TopologyCostModel(cluster, args.batch).score_sharding_plan(plan, tables).step_time, ["table_wise"]


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    device = torch.device("cuda", rank) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo", rank=rank, world_size=world)
    try:
        res = {"collectives": _collectives(world, device, args), "plans": {}}
        for which in PLANS + (GPU_PLANS if args.cuda else []):
            try:
                plan, modeled, types = _plan(args, world, which)
            except RuntimeError as e:  # torchrec's sharder does not offer the type on this device
                res["plans"][which] = {"skipped": str(e).splitlines()[0][:120]}
                continue
            ms = _sparse_steps(plan, world, device, args)
            res["plans"][which] = {"measured_ms": ms, "modeled_ms": modeled * 1e3, "types": types}
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps: int) -> float:
    """Median over reps of the slowest rank's seconds for fn()."""
    out = []
    for _ in range(reps):
        dist.barrier()
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=device)  # NCCL: CUDA tensors
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append(float(dt))
    return statistics.median(out)


def _collectives(world: int, device, args) -> dict:
    small = torch.zeros(2 * world, device=device)  # 8 bytes to each peer
    big = torch.zeros(args.a2a_mb * 2**20 // 4, device=device)
    for _ in range(3):
        dist.all_to_all_single(torch.empty_like(small), small)
    lat = _timed(lambda: dist.all_to_all_single(torch.empty_like(small), small), device, args.reps)
    out_big = torch.empty_like(big)
    dist.all_to_all_single(out_big, big)
    t = _timed(lambda: dist.all_to_all_single(out_big, big), device, max(5, args.reps // 5))
    per_peer = big.numel() * 4 / world  # bytes each rank sends to each peer
    # the model's view of a rank in an all-to-all: it sends to and receives from every peer
    return {
        "a2a_latency_us": lat * 1e6,
        "a2a_big_ms": t * 1e3,
        "a2a_bytes_per_peer": per_peer,
        "a2a_pair_gb_s": 2 * per_peer * (world - 1) / t / 1e9 if world > 1 else None,
    }


def _sparse_steps(plan, world: int, device, args) -> float:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = _tables(args.max_rows, args.dim)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01})
    dmp = DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), plan=plan, sharders=[sharder], device=device
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = []
    for _ in range(4):
        vals = torch.cat([torch.randint(0, t.num_embeddings, (args.batch,), generator=g) for t in tables])
        batches.append(
            KeyedJaggedTensor(
                keys=[t.feature_names[0] for t in tables],
                values=vals.to(device),
                lengths=torch.ones(len(tables) * args.batch, dtype=torch.int32, device=device),
            )
        )
    it = iter(range(10**9))

    def step():
        kt = dmp(batches[next(it) % len(batches)])
        kt.values().sum().backward()

    for _ in range(3):
        step()
    return _timed(step, device, args.reps) * 1e3


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else float("nan")


def plot(path: str, names: list[str], modeled: list[float], measured: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter(modeled, measured)
    for n, x, y in zip(names, modeled, measured):
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    hi = max(max(modeled), max(measured)) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="measured = modeled")
    ax.set(
        xlim=(0, hi), ylim=(0, hi), xlabel="modeled step ms (sharding/planner/cost/model.py)", ylabel="measured sparse step ms", title=title
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--topology", default="", help="default: cpu-gloo (resized to --nproc) on CPU")
    ap.add_argument("--batch", type=int, default=2048, help="per rank")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--max-rows", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--a2a-mb", type=int, default=16, help="MiB each rank sends in the bandwidth all-to-all")
    ap.add_argument("--plot", default="", help="also draw measured vs modeled ms per plan into this PNG")
    args = ap.parse_args(argv)
    args.cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc
    if args.cuda and not args.topology:
        ap.error("--topology is needed on GPUs (the machine's topology file)")
    from sharding.topology.bandwidth import bandwidth_matrix
    from sharding.planner.cost.model import TopologyCostModel

    cluster = _cluster(args, args.nproc)
    cm = TopologyCostModel(cluster, args.batch)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        print(
            f"[calibrate] {args.nproc} ranks on {cluster.name} ({'cuda' if args.cuda else 'cpu'}), batch {args.batch}/rank, "
            f"{len(PLANS)} plans x {args.reps} steps ...",
            flush=True,
        )
        mp.start_processes(_worker, args=(args.nproc, free_port(), args, out), nprocs=args.nproc, join=True, start_method="spawn")
        res = json.loads(Path(out).read_text())
    col = res["collectives"]
    bw = bandwidth_matrix(cluster)
    col["modeled_latency_us"] = cm.collective_latency * 1e6
    col["modeled_pair_gb_s"] = float(bw[0, 1] / 1e9) if args.nproc > 1 else None
    print(f"all-to-all latency: measured {col['a2a_latency_us']:.1f} us, modeled {col['modeled_latency_us']:.1f} us")
    if args.nproc > 1:
        print(
            f"all-to-all pair bandwidth (send + receive per peer): measured {col['a2a_pair_gb_s']:.2f} GB/s, "
            f"modeled {col['modeled_pair_gb_s']:.2f} GB/s"
        )
    for n, p in res["plans"].items():
        if "skipped" in p:
            print(f"plan {n}: skipped: {p['skipped']}")
    names = [n for n, p in res["plans"].items() if "skipped" not in p]
    meas = [res["plans"][n]["measured_ms"] for n in names]
    mod = [res["plans"][n]["modeled_ms"] for n in names]
    b, a = np.polyfit(mod, meas, 1) if len(set(mod)) > 1 else (float("nan"), float("nan"))
    rho = spearman(mod, meas)
    print(f"\n{'plan':<16} {'types':<32} {'measured ms':>12} {'modeled ms':>11} {'measured/modeled':>17}")
    for n, x, y in zip(names, meas, mod):
        print(f"{n:<16} {','.join(res['plans'][n]['types']):<32} {x:>12.3f} {y:>11.4f} {x / y:>17.1f}")
    print(f"\nfit: measured = {a:.3f} ms + {b:.2f} x modeled; Spearman rank correlation {rho:.2f}")
    if args.plot:
        plot(args.plot, names, mod, meas, f"{args.nproc} rank(s) on {cluster.name}, batch {args.batch}/rank")
    print(
        json.dumps(
            {
                "nproc": args.nproc,
                "topology": cluster.name,
                "device": "cuda" if args.cuda else "cpu",
                "batch_per_rank": args.batch,
                "collectives": col,
                "plans": res["plans"],
                "fit_intercept_ms": a,
                "fit_slope": b,
                "spearman": rho,
                "total_s": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
