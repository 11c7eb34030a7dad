"""`recsys` command line. `recsys preprocess --config FILE [--task I --tasks N --procs P] [key=value ...]`
preprocesses the config's raw files into its shard cache (all of them, or one task's share of a
fan-out, docs/data.md). `recsys export --run-dir DIR --out FILE` writes a run's model as one unsharded state_dict.
`recsys train --config FILE [key=value ...]` checks the config (one-line
errors, before any process starts), locks the run directory and checks it (a fresh run into old
checkpoints, a finished or incompatible resume), preprocesses raw data once, then launches
torchrun with `train.nproc_per_node` local processes running `recsys.train`.

Process lifetime (docs/run_integrity.md): torchrun runs in its own session, so a Ctrl-C in the
terminal reaches only this launcher, which forwards SIGTERM to torchrun (torchrun stops its
workers) and prints one line; SIGTERM likewise. If the launcher is killed outright (SIGKILL),
torchrun gets SIGTERM from the kernel (parent-death signal) and the workers follow; each worker
also dies with its torchrun. The run directory's lock is held until the launcher exits."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys

from recsys.config import ConfigError, check_training_extras, load_config
from recsys.training.checkpoint import CheckpointError, Checkpointer
from recsys.training.parent_death import die_with_parent
from recsys.training.run_dir import (
    LAUNCHER_ENV,
    RunDirError,
    RunFinished,
    RunLock,
    preflight,
    shard_world_size,
    state_shape,
)


def _check_saved_plan(cfg) -> None:
    """A saved plan that torchrec cannot run (unknown sharding type or kernel, shards that do not
    tile a table, ranks outside the world) or that is for another model or world size fails here,
    with one line, before any process starts (sharding/plan/validation.py: the check
    `recsys-plan validate` and `show` run)."""
    import torch

    from recsys.data.source import build_source
    from recsys.models.ctr import TrainModule
    from recsys.training.job import default_model
    import sharding.plan.io as plan_io
    from sharding.plan.validation import validate_plan

    plan, header = plan_io.read_plan_file(cfg.plan)
    validate_plan(plan, header, cfg.plan)
    model = TrainModule(default_model(cfg, build_source(cfg), torch.device("meta")))
    plan_io.check_plan_fits(header, plan, plan_io.model_tables(model), cfg.train.nproc_per_node, cfg.plan)


def _check_topology(cfg) -> None:
    """sharding.planner=topology: the topology must be for this run's device and world size,
    checked here with one line naming the key rather than in every worker after it started."""
    from recsys.training.distributed import device_type
    from sharding.planner.job_topology import cluster_for

    t = cfg.train
    world = shard_world_size(cfg, t.nproc_per_node)
    try:
        cluster_for(cfg.sharding.topology, device_type(t), world, min(t.nproc_per_node, world))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"key 'sharding.topology': {e}") from None


def _train(args: argparse.Namespace) -> int:
    """Checks everything a worker would refuse, under the run directory's lock, then launches.
    The lock is held until the job ends and released on every way out, so `main()` can be called
    more than once in one process (as the tests do)."""
    with contextlib.ExitStack() as held:
        return _checked_launch(args, held)


def _checked_launch(args: argparse.Namespace, held: contextlib.ExitStack) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        check_training_extras(cfg, args.config)
        from recsys.data.source import build_source, prepare_data

        prepare_data(cfg)  # once, in this process, so workers find the shards ready
        if cfg.plan:
            _check_saved_plan(cfg)
        elif cfg.sharding.planner == "topology":
            _check_topology(cfg)
        held.enter_context(RunLock(cfg.resolved_run_dir()))  # until the job ends
        source = build_source(cfg)
        world = shard_world_size(cfg, cfg.train.nproc_per_node)
        preflight(
            cfg, source, state_shape(cfg, source.sparse_names, source.cardinalities, world), warn=False
        )  # the workers repeat it (and warn about broken checkpoints) before writing
    except RunFinished as e:
        print(e, file=sys.stderr)
        return 0
    except (ConfigError, RunDirError, CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
        # PlanFileError too; ValueError: e.g. a data file with more malformed rows than data.max_bad_fraction
        print(f"error: {e}", file=sys.stderr)
        return 2
    worker = ["-m", "recsys.train", "--config", args.config, *args.overrides]
    if cfg.train.nproc_per_node == 1 and not args.torchrun:
        cmd = [sys.executable, *worker]
    else:
        cmd = [
            sys.executable,
            "-m",
            "recsys.training.torchrun_quiet",
            "--standalone",
            f"--nproc_per_node={cfg.train.nproc_per_node}",
            *worker,
        ]
    env = dict(os.environ, **{LAUNCHER_ENV: str(os.getpid())})  # the workers' rank 0 accepts our lock
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.train.nproc_per_node)))
    return _supervise(cmd, env, cfg.resolved_run_dir())


def _supervise(cmd: list[str], env: dict[str, str], run_dir) -> int:
    """Runs the job in its own session, dying with us; SIGINT/SIGTERM stop it and say so once."""
    me = os.getpid()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM, expected_parent=me))
    stopped: list[int] = []

    def stop(sig: int, _frame) -> None:
        if not stopped:  # torchrun forwards SIGTERM to its workers and waits for them
            stopped.append(sig)
            proc.send_signal(signal.SIGTERM)
        else:  # a second Ctrl-C: no more waiting
            os.killpg(proc.pid, signal.SIGKILL)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not stopped and rc >= 0:
        return rc
    latest = Checkpointer(run_dir / "checkpoints", -1, 1).latest_complete(verify_bytes=False)
    where = f"the last complete checkpoint is {latest} (resume=true continues from it)" if latest else "no checkpoint was written"
    if not stopped:  # torchrun itself was killed (OOM killer, kill -9): its workers follow it (die_with_parent)
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # any worker still in its process group, at once
        except ProcessLookupError:
            pass
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else f"signal {-rc}"
        print(f"error: torchrun (pid {proc.pid}) was killed by {name}; its workers were stopped with it; {where}", file=sys.stderr)
        return 128 - rc
    print(f"stopped by {signal.Signals(stopped[0]).name}: every worker has exited; {where}", file=sys.stderr)
    return 128 + stopped[0]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else default


def _preprocess(args: argparse.Namespace) -> int:
    """Preprocess the config's raw files into its shard cache: all at once (`--tasks 1`), or as
    task `--task` of `--tasks` (recsys/data/preprocess/fanout.py), the last part to finish joining them all.
    `--procs P` splits this task into P parts, one process each (the files go to tasks x P parts)."""
    from recsys.data.errors import DataFileError
    from recsys.data.source import prepare_data, preprocess_tasks, shard_dir

    try:
        cfg = load_config(args.config, args.overrides)
        if args.tasks < 1 or args.procs < 1 or not 0 <= args.task < args.tasks:
            raise ConfigError(f"--task {args.task} of --tasks {args.tasks} (--procs {args.procs}): need 0 <= task < tasks and procs >= 1")
        if cfg.data.source == "synthetic":
            raise ConfigError(f"{args.config}: key 'data.source': generated data (synthetic) has nothing to preprocess")
        total = args.tasks * args.procs
        parts = list(range(args.task * args.procs, (args.task + 1) * args.procs))
        manifest = prepare_data(cfg) if total == 1 else preprocess_tasks(cfg, parts, total)
    except (ConfigError, DataFileError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = f"task {args.task} of {args.tasks}" + (f" (parts {parts[0]}-{parts[-1]} of {total})" if args.procs > 1 else "")
    if manifest is None:
        print(f"{what}: part written; the last task to finish joins {shard_dir(cfg)}")
    else:
        print(f"{what}: {shard_dir(cfg)} holds {manifest['num_rows']} rows in {len(manifest['shards'])} shards")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (launches torchrun)")
    p.add_argument("--config", required=True, help="experiment YAML, e.g. configs/experiments/demo.yaml")
    p.add_argument("--torchrun", action="store_true", help="use torchrun even for one process")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.batch_size=8192 resume=true")
    p = sub.add_parser("preprocess", help="preprocess raw data into the config's shard cache (all, or one task of many)")
    p.add_argument("--config", required=True, help="experiment YAML whose data section names the raw files")
    p.add_argument(
        "--task", type=int, default=_env_int("SLURM_ARRAY_TASK_ID", 0), help="this task's index (default: $SLURM_ARRAY_TASK_ID, else 0)"
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=_env_int("SLURM_ARRAY_TASK_COUNT", 1),
        help="number of tasks the files are split over (default: $SLURM_ARRAY_TASK_COUNT, else 1)",
    )
    p.add_argument("--procs", type=int, default=1, help="processes this task runs, each preprocessing its own part (parts: tasks x procs)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.path=/data/day_*.gz")
    p = sub.add_parser("export", help="write a run's model as one unsharded state_dict (recsys/training/export.py)")
    p.add_argument("--run-dir", required=True, help="the run directory (its config.yaml and checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    p.add_argument("--out", required=True, help="the file to write (torch.save; load it with recsys.load_exported)")
    return parser


def main(argv: list[str] | None = None) -> int:
    # The launcher's own messages (e.g. "rebuilding the shard cache: ...") are one plain line each.
    # force: importing fbgemm_gpu calls logging.info(), which installs a "LEVEL:name:" root handler.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "preprocess":
        return _preprocess(args)
    if args.command == "export":
        return _export(args)
    return 2


def _export(args: argparse.Namespace) -> int:
    from recsys.training.export import export_model

    try:
        meta = export_model(args.run_dir, args.out, args.step)
    except (RunDirError, CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = sum(meta["cardinalities"])
    print(
        f"wrote {args.out}: {meta['model']['name']} at step {meta['step']} ({len(meta['sparse_names'])} sparse features, "
        f"{rows:,} ids in all), from {meta['checkpoint']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
