"""A training job's parts, built from its config inside each torchrun worker: config -> data ->
model -> plan -> sharded model, optimizers, checkpointer and hooks. recsys/training/trainer.py
runs them; `recsys.train` is the thin entry point."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recsys import config as config_mod
from recsys.config import ExperimentConfig, ShardingConfig
from recsys.data.batching import steps_per_epoch
from recsys.data.source import TRAIN, DataSource, build_source, prepare_data
from recsys.models.ctr import TrainModule, build_model
from recsys.optim.dense import DenseLrWarmup, combined_optimizer, dense_optimizer
from recsys.optim.scaling import effective_optim
from recsys.optim.embedding import attach_embedding_optimizer, embedding_sharders
from recsys.training.checkpoint import Checkpointer, CheckpointError
from recsys.training.comm_failure import register_peers
from recsys.training.distributed import DistEnv, init_distributed
from recsys.training.kstep.host_groups import HostGroups, build_host_groups, remap_plan_to_host, resolve_hosts
from recsys.training.hooks import CowClipHook, DenseWarmupHook, MergeHook, TrainHook
from recsys.training.kstep.merger import KStepMerger
from recsys.training.run_dir import (
    ResumePoint,
    RunDirError,
    RunFinished,
    RunLock,
    preflight,
    shard_world_size,
    state_shape,
    total_steps,
)
import sharding.plan.file_format as plan_format
import sharding.plan.io as plan_io
from sharding.planner.build import allowed_sharding_types, build_planner, make_plan

log = logging.getLogger("recsys.train")

# A user model factory: (config, data source) -> nn.Module mapping (dense, KJT) -> logits.
ModelFactory = Callable[[ExperimentConfig, DataSource], nn.Module]


def default_model(cfg: ExperimentConfig, source: DataSource, device: torch.device) -> nn.Module:
    return build_model(cfg.model, source.sparse_names, source.cardinalities, len(source.dense_names), device)


@dataclass
class Job:
    cfg: ExperimentConfig
    env: DistEnv
    source: DataSource
    dmp: DistributedModelParallel
    optimizer: Any
    dense_optimizer: Any
    checkpointer: Checkpointer
    run_dir: Path
    groups: HostGroups | None = None  # hierarchical training (train.merge_every > 0)
    merger: KStepMerger | None = None
    warmup: DenseLrWarmup | None = None  # dense-lr warmup of the scaling rule
    resume_from: ResumePoint | None = None  # the checkpoint to resume from (preflight), None: from scratch
    lock: RunLock | None = None  # rank 0: the run directory's lock, held for the whole run
    hooks: list[TrainHook] = field(default_factory=list)  # recsys/training/hooks.py, called in this order


def _on_rank0(env: DistEnv, fn: Callable[[], Any]) -> Any:
    """Runs `fn` on rank 0 and gives every rank its result; an expected failure (one-line errors,
    RunFinished) is raised on every rank, so all stop together."""
    box: list[Any] = [None]
    if env.is_main:
        try:
            box[0] = ("ok", fn())
        except (RunDirError, RunFinished, CheckpointError) as e:
            box[0] = ("raise", e)
        except (FileNotFoundError, FileExistsError, ValueError) as e:  # data and config errors: one line
            box[0] = ("raise", RunDirError(str(e)))
    if env.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "raise":
        raise value
    return value


def setup(cfg: ExperimentConfig, model_factory: ModelFactory | None = None) -> Job:
    env = init_distributed(cfg.train)
    torch.manual_seed(cfg.train.seed)
    run_dir = cfg.resolved_run_dir()
    lock = RunLock(run_dir)

    def lock_and_prepare() -> None:  # a `recsys train` launcher above us may hold the lock for us
        lock.acquire(allow_ancestor=True)
        prepare_data(cfg)

    _on_rank0(env, lock_and_prepare)
    source = build_source(cfg)
    shape = state_shape(cfg, source.sparse_names, source.cardinalities, shard_world_size(cfg, env.world_size))
    resume_from = _on_rank0(env, lambda: preflight(cfg, source, shape))
    # only now, when the run is known to go ahead, is anything written
    _on_rank0(env, lambda: _write_or_fail(run_dir / "config.yaml", config_mod.dump(cfg)))

    # the scaling rule (optim.scale_from_batch): hyperparameters for this batch size, dense-lr warmup
    optim_cfg, warmup_steps = effective_optim(cfg.optim, cfg.train.batch_size, steps_per_epoch(source, TRAIN, cfg.train.batch_size))
    if env.is_main and cfg.optim.scale_from_batch:
        log.info(
            "scaling rule %s from batch %d to %d: embedding_lr %.4g, dense_lr %.4g, embedding_l2 %.4g, dense warmup %d steps",
            cfg.optim.scale_rule,
            cfg.optim.scale_from_batch,
            cfg.train.batch_size,
            optim_cfg.embedding_lr,
            optim_cfg.dense_lr,
            optim_cfg.embedding_l2,
            warmup_steps,
        )

    model = model_factory(cfg, source) if model_factory else default_model(cfg, source, env.device)
    attach_embedding_optimizer(model, optim_cfg)
    module = TrainModule(model, cfg.train.micro_batch_rows)
    sharders = embedding_sharders(optim_cfg)
    local_batch = cfg.train.batch_size // env.world_size
    if env.is_main and module.micro_batched and local_batch > cfg.train.micro_batch_rows:
        log.info(
            "dense part in micro-batches of %d rows (local batch %d: %d chunks); one embedding update per batch",
            cfg.train.micro_batch_rows,
            local_batch,
            -(-local_batch // cfg.train.micro_batch_rows),
        )
    elif env.is_main and cfg.train.micro_batch_rows and not module.micro_batched:
        log.info(
            "train.micro_batch_rows=%d: %s has no sparse()/over() split (recsys.models.micro_batch.SplitCTRModel); whole batches",
            cfg.train.micro_batch_rows,
            type(model).__name__,
        )
    tables = plan_io.model_tables(module)
    # Hierarchical training: shard over the host's ranks; the same plan on every host.
    pg_timeout = timedelta(seconds=cfg.train.pg_timeout_s)
    groups = build_host_groups(resolve_hosts(cfg.train.hosts), pg_timeout) if cfg.train.merge_every > 0 else None
    if env.world_size > 1:  # a collective failure caused by another host is then told in one line naming it
        register_peers(groups.hosts if groups else resolve_hosts(1), pg_timeout.total_seconds() if groups else None)
    shard_world = groups.ranks_per_host if groups else env.world_size
    if cfg.plan:  # a saved plan: it must be for this model and world size (the host's, if hierarchical)
        plan, header = plan_io.read_plan_file(cfg.plan)
        plan_io.check_plan_fits(header, plan, tables, shard_world, cfg.plan)
        meta = dict(header["meta"], loaded_from=str(cfg.plan))
    elif groups:  # planned for one host on global rank 0, broadcast to all hosts
        planner = build_planner(
            host_local_sharding(cfg.sharding),
            module,
            shard_world,
            min(env.local_world_size, shard_world),
            env.device.type,
            local_batch,
            cache_stats=_cache_stats(cfg, module),
            target_hit_rate=cfg.sharding.target_hit_rate,
        )
        plan = planner.collective_plan(module, sharders, dist.GroupMember.WORLD)
        meta = {"planner": cfg.sharding.planner, "batch_size_per_rank": local_batch, "hosts": groups.hosts}
    else:
        plan = make_plan(
            cfg.sharding, module, sharders, env.device, env.local_world_size, local_batch, cache_stats=_cache_stats(cfg, module)
        )
        meta = {"planner": cfg.sharding.planner, "batch_size_per_rank": local_batch}
    # the plan this run used, as a reusable file and as torchrec's table
    _on_rank0(env, lambda: _save_plan_files(run_dir, plan_format.plan_to_dict(plan, shard_world, env.device.type, tables, meta), str(plan)))
    sharding_env = {}
    if groups:  # DMP over the host's ranks, with the plan moved onto them
        plan = remap_plan_to_host(plan, groups, env.device.type)
        sharding_env = {"env": ShardingEnv.from_process_group(groups.host_pg)}
    dmp = DistributedModelParallel(module, device=env.device, plan=plan, sharders=sharders, **sharding_env)
    dense = dense_optimizer(dmp, optim_cfg)
    optimizer = combined_optimizer(dmp, dense)
    warmup = DenseLrWarmup(dense, optim_cfg.dense_lr, warmup_steps) if warmup_steps else None
    ckpt = Checkpointer(
        run_dir / "checkpoints",
        env.rank,
        env.world_size,
        cfg.checkpoint.keep,
        groups,
        shape,
        source.identity(),
        every_steps=cfg.checkpoint.every_steps,
    )
    ckpt.data_start_step = resume_from.data_start_step if resume_from is not None else 0
    hooks: list[TrainHook] = []
    merger = None
    if groups:
        merger = KStepMerger(
            dmp,
            optimizer,
            groups.replica_pg,
            cfg.train.merge_every,
            cfg.train.merge_moments,
            host_pg=groups.host_pg,
            route=cfg.train.merge_route,
            rows=cfg.train.merge_rows,
            outer=cfg.train.merge_outer,
            outer_lr=cfg.train.merge_outer_lr,
            outer_momentum=cfg.train.merge_outer_momentum,
            compress=cfg.train.merge_compress,
        )
        ckpt.per_host_optim = not cfg.train.merge_moments  # unmerged moments: each host saves its own
        _checkpoint_at_merges(ckpt, merger.every_k, total_steps(cfg, source, ckpt.data_start_step), env.is_main)
        hooks.append(MergeHook(merger, groups, env.world_size, ckpt.every_steps))
    if warmup is not None:
        hooks.append(DenseWarmupHook(warmup, dense))
    hooks.append(CowClipHook(dmp))
    lock = lock if env.is_main else None
    return Job(cfg, env, source, dmp, optimizer, dense, ckpt, run_dir, groups, merger, warmup, resume_from, lock, hooks)


def _checkpoint_at_merges(ckpt: Checkpointer, every_k: int, total: int, is_main: bool) -> None:
    """A hierarchical run checkpoints at merge steps only (docs/kstep.md): the cadence is rounded
    up to a multiple of train.merge_every, and the log says so."""
    asked = ckpt.every_steps
    if asked and ckpt.align_every(every_k) != asked and is_main:
        later = "" if ckpt.every_steps < total else f"; none before the final one at step {total}"
        log.info(
            "checkpoint.every_steps=%d rounded up to %d: checkpoints are taken at merge steps only (train.merge_every=%d)%s",
            asked,
            ckpt.every_steps,
            every_k,
            later,
        )


def _write_or_fail(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise RunDirError(f"cannot write {path}: {e.strerror or e}") from None


def _save_plan_files(run_dir: Path, plan_dict: dict[str, Any], table: str) -> None:
    """plan.json (atomic) and plan.txt; a failed write (a full disk) leaves no temp file and
    says which file in one line."""
    try:
        plan_io.write_plan_file(run_dir / "plan.json", plan_dict)
        (run_dir / "plan.txt").write_text(table + "\n")
    except OSError as e:
        for tmp in run_dir.glob(".plan.json.tmp*"):
            tmp.unlink(missing_ok=True)
        raise RunDirError(f"cannot write the plan files in {run_dir}: {e.strerror or e}") from None


def host_local_sharding(cfg: ShardingConfig) -> ShardingConfig:
    """Sharding types for DMP over one host's group: table-row-wise builds its intra-/cross-host
    groups from the global world (torchrec's TwRw sharding), not from the host group DMP runs on,
    so its all-to-alls would not match (the stock CPU sharder never offers it; ours does)."""
    types = [t for t in allowed_sharding_types(cfg) if t != "table_row_wise"]
    return dataclasses.replace(cfg, sharding_types=types)


def _cache_stats(cfg: ExperimentConfig, module: nn.Module) -> dict | None:
    """Id-frequency statistics for UVM cache sizing (sharding.data_sample), or None."""
    if not cfg.sharding.data_sample:
        return None
    from recsys.data.id_histogram import load_sample

    return load_sample(cfg.sharding.data_sample, module, cfg, cfg.train.batch_size)
