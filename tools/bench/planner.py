"""Benchmark: the topology-aware planner vs torchrec's default planner.

For each shipped topology x model (Criteo Kaggle DeepFM tables; a Criteo-1TB-sized DLRM: 26
tables, the 1TB cardinalities, dim 128; a synthetic 500-table model of mixed sizes and dims):
planning time, modeled step time and per-rank memory of both plans, each plan scored by our cost
model (sharding/planner/cost/model.py) and by torchrec's own estimator (EmbeddingPerfEstimator on the
default planner's topology, max over ranks of the shards' perf, as torchrec's NoopPerfModel),
and a lower bound on the modeled step time of any plan (``sharding/planner/bounds.py``): ``bound /
default`` is the lowest ratio any planner could reach on that row, by our model.

    .venv/bin/python tools/bench/planner.py --quick      # 3 topologies x 2 models
    .venv/bin/python tools/bench/planner.py              # everything
    .venv/bin/python tools/bench/planner.py --data-parallel --topologies dgx-a100-2host

``--data-parallel`` allows ``data_parallel`` next to the model-parallel types, for both planners
(the trainer's ``sharding.sharding_types`` opt-in): the same constraints for both, so a row
compares the two planners on one search space; run it with and without to compare each planner
with itself.

torchrec's default planner has no search time limit of its own; on the 500-table model it walks
thousands of proposals (a full run did not finish in 20 minutes), so here its search (after the
enumeration) gets torchrec's ``timeout_seconds`` = ``--default-timeout`` (default 60 s): a row
whose default search reached it says ``default_search_cut: true`` (torchrec keeps the best plan
found so far). Ours runs with its own defaults: no clock, a budget of proposals per proposer
(``max_proposals``), early-stopping greedy proposers, so its plan does not depend on the machine's
load; a row says how many proposals it evaluated and whether the budget cut its search
(``ours_search_cut``). Plan times are wall clock and CPU (process) seconds: the machine may be
shared.

Prints progress and a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: E402
from torchrec.distributed.planner.perf_models import NoopPerfModel  # noqa: E402
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator  # noqa: E402
from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, PlannerError, TopologyFactory, TrainerConfig  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from recsys.config import CARDINALITY_PRESETS  # noqa: E402
from sharding.planner.bounds import step_time_lower_bound  # noqa: E402
from sharding.constants import MODEL_PARALLEL_TYPES  # noqa: E402
from sharding.compat import estimator_sharders  # noqa: E402
from sharding.planner.cost.model import TopologyCostModel  # noqa: E402
from sharding.topology.topology_file import load_topology, shipped_topologies  # noqa: E402
from sharding.planner.topology_planner import TopologyAwarePlanner, default_constraints  # noqa: E402

KAGGLE = CARDINALITY_PRESETS["criteo_kaggle_raw"]
CRITEO_1TB = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
    11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
]  # fmt: skip


def ebc(specs: list[tuple[int, int]]) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t_{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f_{i}"]) for i, (n, d) in enumerate(specs)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def synthetic_500(seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(100), np.log(5e6), 500)).astype(int)
    dims = rng.choice([16, 32, 64, 128], 500, p=[0.3, 0.3, 0.25, 0.15])
    return [(int(r), int(d)) for r, d in zip(rows, dims)]


MODELS = {
    "deepfm-kaggle": lambda: [(n, 16) for n in KAGGLE],
    "dlrm-1tb": lambda: [(n, 128) for n in CRITEO_1TB],
    "synthetic-500": synthetic_500,
}


def default_planner(cluster, batch: int, constraints, timeout_s: int | None = None) -> EmbeddingShardingPlanner:
    """torchrec's planner as the trainer's `torchrec` choice builds it: same per-rank capacities
    (host memory / ranks per host), torchrec's default bandwidths."""
    hbm = None if cluster.compute_device == "cpu" else min(g.hbm_bytes for h in cluster.hosts for g in h.gpus)
    topo = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=cluster.world_size, local_world_size=cluster.local_world_size),
        hardware_config=HardwareConfig(
            hbm_cap_bytes=hbm, ddr_cap_bytes=min(h.ddr_bytes for h in cluster.hosts) // cluster.local_world_size
        ),
        kernel_config=KernelConfig(compute_device=cluster.compute_device),
    )
    return EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=constraints, debug=False, timeout_seconds=timeout_s)


def torchrec_score(opts, ref: EmbeddingShardingPlanner) -> float:
    opts = copy.deepcopy(opts)
    EmbeddingPerfEstimator(topology=ref._topology).estimate(opts, estimator_sharders(ref._enumerator))
    return NoopPerfModel(ref._topology).rate(opts)


def _time_enumeration(planner) -> list[float]:
    """Wrap torchrec's default planner's enumerator so the search time (plan - enumeration) can be
    told apart (ours reports it: ``planner.last_enumerator.last_enumerate_s``)."""
    spent: list[float] = []
    if isinstance(planner, TopologyAwarePlanner):
        return spent
    inner = planner._enumerator.enumerate

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent.append(time.perf_counter() - t)

    planner._enumerator.enumerate = timed
    return spent


def run_one(topo_name: str, model_name: str, batch: int, default_timeout: int | None = 60, sharding_types: list[str] | None = None) -> dict:
    cluster = load_topology(topo_name)
    module = ebc(MODELS[model_name]())
    sharders = [EmbeddingBagCollectionSharder()]
    cm = TopologyCostModel(cluster, batch)
    row: dict = {"topology": topo_name, "model": model_name, "world": cluster.world_size}
    if sharding_types:
        row["sharding_types"] = list(sharding_types)
    results = {}
    for who in ("default", "ours"):
        cons = default_constraints(module, cluster.compute_device, sharding_types)
        planner = default_planner(cluster, batch, cons, default_timeout) if who == "default" else TopologyAwarePlanner(cluster, batch, cons)
        enum_s = _time_enumeration(planner)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            planner.plan(module, sharders)
            err = None
        except PlannerError as e:
            err = str(e).splitlines()[0][:160]
        dt = time.perf_counter() - t0
        results[who] = (planner, err)
        row[f"{who}_plan_s"] = round(dt, 2)
        row[f"{who}_plan_cpu_s"] = round(time.process_time() - c0, 2)
        ours = isinstance(planner, TopologyAwarePlanner)
        if ours and planner.last_enumerator is not None:
            enum_s.append(planner.last_enumerator.last_enumerate_s)
        row[f"{who}_enumerate_s"] = round(sum(enum_s), 2)
        row[f"{who}_proposals"] = (planner.last_planner if ours else planner)._num_proposals
        if ours:
            if planner.last_search is not None and planner.last_search.cut:
                row["ours_search_cut"] = True
        elif default_timeout and dt - sum(enum_s) >= default_timeout:
            row["default_search_cut"] = True
        if err:
            row[f"{who}_error"] = err
            continue
        opts = planner.best_plan if ours else planner._best_plan
        cost = cm.score(opts)
        row[f"{who}_step_ms"] = round(cost.step_time * 1e3, 4)
        row[f"{who}_max_hbm_gib"] = round(float(cost.hbm_bytes.max()) / 2**30, 2)
        row[f"{who}_max_host_gib_per_rank"] = round(float(cost.host_bytes.max()) / 2**30, 2)
        row[f"{who}_kernels"] = sorted({so.compute_kernel for so in opts})
        row[f"{who}_types"] = sorted({so.sharding_type for so in opts})
    ref = results["default"][0]
    if not results["default"][1] and not results["ours"][1]:
        for who in ("default", "ours"):
            p = results[who][0]
            row[f"{who}_torchrec_est"] = round(torchrec_score(p.best_plan if who == "ours" else p._best_plan, ref), 4)
        row["ratio_ours_vs_default"] = round(row["ours_step_ms"] / row["default_step_ms"], 3)
        # no plan of our search space (a superset of torchrec's) can go below this, by the model
        lb = step_time_lower_bound(cm, results["ours"][0].search_space) * 1e3
        row["lower_bound_ms"] = round(lb, 4)
        row["best_possible_ratio"] = round(lb / row["default_step_ms"], 3)
    return row


def plot_rows(rows: list[dict], path: str) -> None:
    """Bars per row: our modeled step time and the lower bound, both over the default's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "ratio_ours_vs_default" in r]
    labels = [f"{r['topology']} / {r['model']}" for r in rows]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
    ax.barh(y + 0.2, [r["ratio_ours_vs_default"] for r in rows], height=0.4, label="ours / default")
    ax.barh(y - 0.2, [r["best_possible_ratio"] for r in rows], height=0.4, label="lower bound / default")
    ax.axvline(0.8, color="k", ls="--", lw=0.8, label="0.8x target")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("modeled step time relative to torchrec's default planner")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 topologies x 2 models")
    ap.add_argument("--batch-size", type=int, default=4096, help="per rank")
    ap.add_argument("--topologies", nargs="*", default=None)
    ap.add_argument("--models", nargs="*", default=None, choices=sorted(MODELS))
    ap.add_argument(
        "--default-timeout",
        type=int,
        default=60,
        help="search time limit (s) for torchrec's default planner (0: none, as torchrec's default)",
    )
    ap.add_argument("--data-parallel", action="store_true", help="allow data_parallel next to the model-parallel types, for both planners")
    ap.add_argument("--out", default="", help="also append each finished row to this file, one JSON object a line")
    ap.add_argument("--plot", default="", help="also draw ours/default and bound/default per row into this PNG")
    ap.add_argument("--replot", default="", help="only draw --plot from the rows of an earlier --out file")
    args = ap.parse_args(argv)
    if args.replot:
        plot_rows([json.loads(line) for line in Path(args.replot).read_text().splitlines() if line.strip()], args.plot or "planner.png")
        return 0
    logging.disable(logging.WARNING)
    if args.quick:
        topos = args.topologies or ["dgx-a100", "pcie-8gpu-2socket", "dgx-a100-2host"]
        models = args.models or ["deepfm-kaggle", "dlrm-1tb"]
    else:
        topos = args.topologies or [p.stem for p in shipped_topologies()]
        models = args.models or list(MODELS)
    rows = []
    t_all = time.perf_counter()
    for t in topos:
        for m in models:
            print(f"[bench] {t} x {m} ...", flush=True)
            types = list(MODEL_PARALLEL_TYPES) + ["data_parallel"] if args.data_parallel else None
            row = run_one(t, m, args.batch_size, args.default_timeout or None, types)
            rows.append(row)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            print("   ", {k: v for k, v in row.items() if not k.endswith(("_kernels", "_types"))}, flush=True)
    print()
    hdr = (
        f"{'topology':<32} {'model':<14} {'world':>5} {'plan s (def/ours)':>18} {'step ms (def/ours)':>22} {'ratio':>6} "
        f"{'bound ms':>9} {'bound/def':>9} {'torchrec est (def/ours)':>24} {'max HBM GiB (def/ours)':>22}"
    )
    print(hdr)
    for r in rows:
        if "ratio_ours_vs_default" not in r:
            print(
                f"{r['topology']:<32} {r['model']:<14} {r['world']:>5} {r['default_plan_s']:>8}/{r['ours_plan_s']:<9} "
                f"default: {r.get('default_error', 'ok')[:60]} | ours: {r.get('ours_error', 'ok')[:60]}"
            )
            continue
        print(
            f"{r['topology']:<32} {r['model']:<14} {r['world']:>5} {r['default_plan_s']:>8}/{r['ours_plan_s']:<9} "
            f"{r['default_step_ms']:>10}/{r['ours_step_ms']:<11} {r['ratio_ours_vs_default']:>6} "
            f"{r['lower_bound_ms']:>9} {r['best_possible_ratio']:>9} "
            f"{r['default_torchrec_est']:>11}/{r['ours_torchrec_est']:<12} {r['default_max_hbm_gib']:>10}/{r['ours_max_hbm_gib']:<11}"
            + (" default search cut" if r.get("default_search_cut") else "")
            + (" ours search cut" if r.get("ours_search_cut") else "")
        )
    if args.plot:
        plot_rows(rows, args.plot)
    print(
        json.dumps(
            {
                "quick": args.quick,
                "data_parallel": args.data_parallel,
                "batch_size_per_rank": args.batch_size,
                "default_timeout_s": args.default_timeout,
                "total_s": round(time.perf_counter() - t_all, 1),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
