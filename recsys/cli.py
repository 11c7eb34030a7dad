"""`recsys` command line. `recsys train --config FILE [key=value ...]` checks the config (one-line
errors, before any process starts), preprocesses raw data once, then launches torchrun with
`train.nproc_per_node` local processes running `recsys.train`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from recsys.config import ConfigError, load_config


def _check_saved_plan(cfg) -> None:
    """A saved plan that torchrec cannot run (unknown sharding type or kernel, shards that do not
    tile a table, ranks outside the world) or that is for another model or world size fails here,
    with one line, before any process starts (sharding/plan_validation.py: the check
    `recsys-plan validate` and `show` run)."""
    import torch

    from recsys.data.source import build_source
    from recsys.models.ctr import TrainModule
    from recsys.training.loop import default_model
    from sharding import plan_io
    from sharding.plan_validation import validate_plan

    plan, header = plan_io.read_plan_file(cfg.plan)
    validate_plan(plan, header, cfg.plan)
    model = TrainModule(default_model(cfg, build_source(cfg), torch.device("meta")))
    plan_io.check_plan_fits(header, plan, plan_io.model_tables(model), cfg.train.nproc_per_node, cfg.plan)


def _train(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        from recsys.data.source import prepare_data

        prepare_data(cfg)  # once, in this process, so workers find the shards ready
        if cfg.plan:
            _check_saved_plan(cfg)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:  # PlanFileError too
        # ValueError: e.g. a data file with more malformed rows than data.max_bad_fraction
        print(f"error: {e}", file=sys.stderr)
        return 2
    worker = ["-m", "recsys.train", "--config", args.config, *args.overrides]
    if cfg.train.nproc_per_node == 1 and not args.torchrun:
        cmd = [sys.executable, *worker]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={cfg.train.nproc_per_node}", *worker,
        ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.train.nproc_per_node)))
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recsys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (launches torchrun)")
    p.add_argument("--config", required=True, help="experiment YAML, e.g. configs/experiments/demo.yaml")
    p.add_argument("--torchrun", action="store_true", help="use torchrun even for one process")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.batch_size=8192 resume=true")
    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
