"""`recsys-plan`: make, show, diff and validate sharding plans.

    recsys-plan make --config configs/experiments/demo.yaml --world-size 8 --compute-device cuda \
        --hbm-gb 80 --out plan.json [--set data.cardinalities=criteo_kaggle_raw ...] \
        [--data-sample synthetic:200000|data:N|hist.json|SHARD_DIR[:N] [--target-hit-rate 0.95]]
    recsys-plan make --model mypackage.models:build_model --world-size 8 --batch-size 65536 --out plan.json
    (--model is another name for --config)
    recsys-plan show plan.json [--model MODEL] [--topology dgx-a100-2host] [--format text|json|html] [--out report.html]
    recsys-plan diff a.json b.json [--format text|json]
    recsys-plan validate plan.json [--model MODEL] [--world-size N] [--hbm-gb G] [--ddr-gb G] [--set K=V]

MODEL is an experiment YAML (`--config` is the same option) or `package.module:factory`, a function
that takes no arguments and returns an nn.Module holding the EmbeddingBagCollections the plan is
for (called on the `meta` device when it can be). `show` and `validate` need no model: a plan file
records each table's shape, data type and optimizer state. With a model, `validate` also checks
that the plan is for it (table names and shapes).

Plans are computed on this machine for any cluster (the model is built on `meta`). Exit codes:
0 ok, 1 `validate` found problems (one line each), 2 bad input, including a plan that fails
validation in `show` or `diff` (one line on stderr; no output file is written, or an existing one
is left as it was).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from recsys.config import ConfigError
from recsys.plan_inputs import (
    UsageError,
    check_capacity,
    emit,
    factory_inputs,
    is_factory,
    load_cluster,
    model_and_tables,
    read_valid,
    tables_of,
    topology_file_of,
    writing,
)


def cmd_make(args: argparse.Namespace) -> int:
    from recsys.optim.embedding import embedding_sharders
    import sharding.plan.io as plan_io
    from sharding.planner.build import build_planner

    for option, gb in (("--hbm-gb", args.hbm_gb), ("--ddr-gb", args.ddr_gb), ("--hbm-bw-gb-s", args.hbm_bw_gb_s)):
        check_capacity(option, gb)
    overrides = list(args.overrides)
    cluster = None
    if args.topology:  # the topology-aware planner on this hardware description
        cluster_file = topology_file_of(args)
        cluster = load_cluster(cluster_file)
        overrides += ["sharding.planner=topology", f"sharding.topology={cluster_file}"]
    if is_factory(args.config):  # a user's model: no experiment config, so no --set / --data-sample
        cfg, model, sharders = factory_inputs(args, overrides)
    else:
        cfg, model, _ = model_and_tables(args.config, overrides)
        sharders = embedding_sharders(cfg.optim)
    world = args.world_size or (cluster.world_size if cluster else cfg.train.nproc_per_node)
    local = args.local_world_size or (cluster.local_world_size if cluster else min(world, 8))
    if world <= 0 or world % local:
        if args.local_world_size or not cluster:
            raise UsageError(f"--world-size {world} is not a positive multiple of --local-world-size {local}")
        raise UsageError(
            f"--world-size {world} does not fill whole hosts of topology {args.topology} ({local} ranks per "
            f"host): give a multiple of {local}, or a topology with {world} GPUs per host"
        )
    batch = (args.batch_size or cfg.train.batch_size) // world
    if batch <= 0:
        raise UsageError(f"--batch-size: fewer samples than ranks ({world})")
    gb = 1024**3
    stats = None
    if args.data_sample:  # per-table id frequencies -> UVM cache hit-rate curves
        from recsys.data.id_histogram import load_sample

        if not 0.0 < args.target_hit_rate <= 1.0:
            raise UsageError(f"--target-hit-rate: expected a number in (0, 1], got {args.target_hit_rate}")
        stats = load_sample(args.data_sample, model, cfg, batch=batch * world)
    planner = build_planner(
        cfg.sharding,
        model,
        world,
        local,
        args.compute_device,
        batch,
        hbm_bytes=int(args.hbm_gb * gb) if args.hbm_gb else None,
        ddr_bytes=int(args.ddr_gb * gb) if args.ddr_gb else None,
        cache_stats=stats,
        target_hit_rate=args.target_hit_rate,
    )
    try:
        plan = planner.plan(model, sharders)
    except Exception as e:  # torchrec's PlannerError is multi-line; keep its first line
        raise UsageError(f"planning failed: {str(e).strip().splitlines()[0]}") from None
    meta = {
        "planner": cfg.sharding.planner,
        "topology": cfg.sharding.topology,
        "config": str(args.config),
        "overrides": args.overrides,
        "batch_size_per_rank": batch,
        "hbm_gb": args.hbm_gb,
        "ddr_gb": args.ddr_gb,
    }
    if getattr(planner, "last_pooling", None):  # what its modelled step used (sharding/planner/cost/plan_cost.py)
        meta["pooling"] = planner.last_pooling
    if stats:
        from sharding.planner.cache_sizing import summary
        from sharding.constants import MAX_CACHE_LOAD_FACTOR

        lfs = {
            name: ps.cache_params.load_factor
            for mp in plan.plan.values()
            for name, ps in mp.items()
            if ps.compute_kernel == "fused_uvm_caching" and ps.cache_params is not None and ps.cache_params.load_factor is not None
        }
        meta.update(
            data_sample=args.data_sample,
            target_hit_rate=args.target_hit_rate,
            cache_sizing=summary(stats, lfs, args.target_hit_rate, MAX_CACHE_LOAD_FACTOR),
        )
    with writing(args.out):
        plan_io.save_plan(plan, args.out, model, world_size=world, compute_device=args.compute_device, meta=meta)
    print(f"wrote {args.out}: {sum(len(m) for m in plan.plan.values())} tables on {world} ranks")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import sharding.plan.report as plan_report
    import sharding.planner.cost.traffic as plan_traffic

    if args.format == "html" and not args.out:
        raise UsageError("--format html needs --out FILE.html")
    plan, header = read_valid(args.plan, args.config, args.overrides)
    rep = plan_report.report(plan, header)
    topo = None
    if args.topology:
        from sharding.topology.topology_file import load_topology

        topo = load_topology(args.topology)  # a file or a shipped name; TopologyError is a ValueError
        if topo.world_size != header["world_size"]:
            raise UsageError(f"--topology {args.topology}: {topo.world_size} ranks, the plan has {header['world_size']}")
    tr = cost = None
    batch, assumed = _batch_per_rank(args, header)
    if topo is not None or args.format == "html":
        infos = plan_report.table_infos(plan, header)
        tr = plan_traffic.traffic(infos, header["world_size"], batch)
        if topo is not None:
            plan_traffic.apply_topology(tr, topo, infos, rep["ranks"])
            cost = _modeled_step(plan, header, topo, batch)  # the planner's own model (sharding/planner/cost/plan_cost.py)
    if args.format == "html":
        import sharding.plan.html as plan_html

        emit(plan_html.render_html(rep, tr, topo, cost), args.out)  # times: the planner's model, as the text report
    elif args.format == "json":
        if topo is not None:
            rep["modeled_step"] = {
                **cost.as_dict(),
                "batch_size_per_rank": batch,
                "batch_size_assumed": assumed,
                "model": "sharding/planner/cost/model.py",
            }
            rep["traffic"] = tr.to_dict()
        emit(json.dumps(rep, indent=1), args.out)
    else:
        text = plan_report.format_text(rep)
        if topo is not None:
            from sharding.planner.cost.plan_cost import format_step

            text += "\n\n" + format_step(cost, args.topology, batch) + "\n\n" + plan_traffic.format_text(tr)
            if assumed:
                text += (
                    f"\nbatch per rank: {batch} assumed (the plan file records none: save_plan(..., planner=...) "
                    "records it); --batch-size sets it"
                )
        emit(text, args.out)
    return 0


def _modeled_step(plan, header: dict, topo, batch: int | None = None):
    """The planner's modelled step of a plan file on a topology (sharding/planner/cost/plan_cost.py),
    at `batch` per rank (default: the file's)."""
    from sharding.planner.cost.plan_cost import modeled_step, plan_pooling, plan_tables
    from sharding.planner.cost.traffic import batch_size_of

    return modeled_step(plan, plan_tables(header), topo, batch or batch_size_of(header), plan_pooling(header))


def _batch_per_rank(args: argparse.Namespace, header: dict) -> tuple[int, bool]:
    """(batch per rank for the modelled step, whether it is assumed): --batch-size, else the file's,
    else traffic's default, said to be assumed."""
    from sharding.planner.cost.traffic import DEFAULT_BATCH_SIZE_PER_RANK

    given = getattr(args, "batch_size", 0)
    if given:
        if given < 0:
            raise UsageError(f"--batch-size {given}: expected a positive number of samples per rank")
        return given, False
    recorded = (header.get("meta") or {}).get("batch_size_per_rank")
    if isinstance(recorded, int) and recorded > 0:
        return recorded, False
    return DEFAULT_BATCH_SIZE_PER_RANK, True


def cmd_diff(args: argparse.Namespace) -> int:
    import sharding.plan.report as plan_report

    a, ha = read_valid(args.a)
    b, hb = read_valid(args.b)
    d = plan_report.diff(a, ha, b, hb)
    text = plan_report.format_diff(d)
    if args.topology:  # modeled time per rank on this hardware, b - a
        (ta, sa), (tb, sb) = _modeled_seconds(a, ha, args.topology), _modeled_seconds(b, hb, args.topology)
        for r in d["ranks"]:
            r["modeled_s_delta"] = tb[r["rank"]] - ta[r["rank"]]
        d["modeled_step_s"] = [sa, sb]
        text += "\nmodeled time per rank on {} (b - a): {}\nmodeled step (the planner's model): {:.4f} ms -> {:.4f} ms".format(
            args.topology,
            ", ".join(f"{r['rank']}: {r['modeled_s_delta'] * 1e3:+.4f} ms" for r in d["ranks"]),
            sa * 1e3,
            sb * 1e3,
        )
    emit(json.dumps(d, indent=1) if args.format == "json" else text, args.out)
    return 0


def _modeled_seconds(plan, header: dict, topology: str) -> tuple[list[float], float]:
    """Per-rank modelled seconds and the modelled step of a plan on a topology: the planner's
    model (sharding/planner/cost/plan_cost.py; the step includes the collectives' busiest links)."""
    from sharding.topology.topology_file import load_topology

    topo = load_topology(topology)
    if topo.world_size != header["world_size"]:
        raise UsageError(f"--topology {topology}: {topo.world_size} ranks, the plan has {header['world_size']}")
    cost = _modeled_step(plan, header, topo)
    return [float(x) for x in cost.rank_time], float(cost.step_time)


def cmd_validate(args: argparse.Namespace) -> int:
    import sharding.plan.io as plan_io
    import sharding.plan.report as plan_report
    from sharding.plan.io import PlanFileError
    from sharding.plan.validation import plan_problems

    for option, gb in (("--hbm-gb", args.hbm_gb), ("--ddr-gb", args.ddr_gb)):
        check_capacity(option, gb)

    plan, header = plan_io.read_plan_file(args.plan)  # a file that is not a plan: exit 2
    world = args.world_size or header["world_size"]
    problems = plan_problems(plan, header, str(args.plan))
    if args.config:  # the plan must be for this model
        tables = tables_of(args.config, args.overrides)
        try:
            plan_io.check_plan_fits(header, plan, tables, world, str(args.plan))
            header["tables"] = tables  # memory with the model's optimizer state (version-1 files record none)
        except PlanFileError as e:
            problems.append(str(e))
    elif world != header["world_size"]:
        problems.append(f"{args.plan}: key 'world_size': plan is for {header['world_size']} ranks, this job has {world}")
    caps = {"hbm_bytes": ("HBM", args.hbm_gb), "host_bytes": ("host memory", args.ddr_gb)}
    if not problems:
        for r in plan_report.rank_memory(plan_report.table_infos(plan, header), header["world_size"]):
            for key, (label, gbs) in caps.items():
                if gbs and r[key] > gbs * 1024**3:
                    problems.append(f"{args.plan}: rank {r['rank']}: {label} {r[key] / 1024**3:.2f} GB > {gbs} GB")
    for p in problems:
        print(f"invalid: {p}")
    if not problems:
        print(f"valid: {sum(len(m) for m in plan.plan.values())} tables, each placed once, on {world} ranks")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recsys-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="plan a model for a cluster and write the plan file")
    m.add_argument(
        "--config",
        "--model",
        dest="config",
        required=True,
        metavar="MODEL",
        help="experiment YAML (model and data sections), or package.module:factory (a function returning your nn.Module)",
    )
    m.add_argument("--world-size", type=int, default=0, help="ranks (default: train.nproc_per_node)")
    m.add_argument("--local-world-size", type=int, default=0, help="ranks per host (default: min(world, 8))")
    m.add_argument("--compute-device", choices=("cuda", "cpu"), default="cuda")
    m.add_argument(
        "--topology",
        default="",
        help="topology YAML, shipped name (configs/topologies) or `nvidia-smi topo -m` text (.txt): plan with the topology-aware planner",
    )
    m.add_argument(
        "--gpu",
        default="",
        help="GPU model of an imported nvidia-smi topology (e.g. 'NVIDIA H100 80GB HBM3', h100-sxm, a100-80gb-sxm): "
        "HBM size and bandwidth from its preset",
    )
    m.add_argument(
        "--hbm-bw-gb-s", type=float, default=None, help="HBM bandwidth for an imported nvidia-smi topology (default: the --gpu preset)"
    )
    m.add_argument("--hbm-gb", type=float, default=0.0, help="HBM per GPU (default: torchrec's)")
    m.add_argument("--ddr-gb", type=float, default=0.0, help="host memory per rank (default: torchrec's)")
    m.add_argument("--batch-size", type=int, default=0, help="global batch (default: train.batch_size)")
    m.add_argument(
        "--data-sample",
        default="",
        metavar="SAMPLE",
        help="size UVM caches from id frequencies: a JSON id histogram, synthetic:N (N rows of the configured "
        "generator), data:N (first N rows of the configured data), or a preprocessed shard directory [DIR:N]",
    )
    m.add_argument(
        "--target-hit-rate",
        type=float,
        default=0.95,
        help="with --data-sample: each UVM-cached table's load factor is the smallest reaching this hit rate",
    )
    m.add_argument("--out", required=True, help="the plan file to write (an existing one is replaced only when planning succeeds)")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    m.set_defaults(fn=cmd_make)
    s = sub.add_parser("show", help="per-table placement and per-rank memory")
    s.add_argument("plan", help="a plan file (recsys-plan make, or save_plan)")
    s.add_argument(
        "--model",
        "--config",
        dest="config",
        default=None,
        metavar="MODEL",
        help="experiment YAML or package.module:factory: check the plan is for this model, report its optimizer state",
    )
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    s.add_argument(
        "--format", choices=("text", "json", "html"), default="text", help="html: one self-contained file with charts (needs --out)"
    )
    s.add_argument("--topology", help="topology YAML or shipped name (configs/topologies/): adds modeled time per rank")
    s.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="batch per rank for the modelled step (default: the plan file's; 512, said to be assumed, if it has none)",
    )
    s.add_argument("--out", help="write the report to this file instead of stdout")
    s.set_defaults(fn=cmd_show)
    d = sub.add_parser("diff", help="tables that moved or changed kernel; memory deltas per rank")
    d.add_argument("a", help="the first plan file")
    d.add_argument("b", help="the plan file to compare with it")
    d.add_argument("--format", choices=("text", "json"), default="text")
    d.add_argument("--topology", default="", help="also report modeled time deltas per rank on this topology")
    d.add_argument("--out", help="write the diff to this file instead of stdout")
    d.set_defaults(fn=cmd_diff)
    v = sub.add_parser(
        "validate",
        help="torchrec sharding types/kernels, shards tile each table, ranks in the world, "
        "every table once, fits memory; with --model: the plan is for that model",
    )
    v.add_argument("plan", help="a plan file")
    v.add_argument(
        "--model",
        "--config",
        dest="config",
        default=None,
        metavar="MODEL",
        help="experiment YAML or package.module:factory (optional: the plan file records its tables)",
    )
    v.add_argument("--world-size", type=int, default=0, help="the job's ranks; the plan must be for them (0: the plan's own)")
    v.add_argument("--hbm-gb", type=float, default=0.0, help="HBM per rank the shards must fit in (0: not checked)")
    v.add_argument("--ddr-gb", type=float, default=0.0, help="host memory per rank the shards must fit in (0: not checked)")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    v.set_defaults(fn=cmd_validate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    from recsys.library_warnings import quiet_known_library_warnings

    logging.disable(logging.WARNING)  # torchrec's planner logs its own tables
    quiet_known_library_warnings()
    try:
        return args.fn(args)
    except BrokenPipeError:  # `recsys-plan show ... | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ConfigError, UsageError, ValueError, FileNotFoundError) as e:  # PlanFileError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
