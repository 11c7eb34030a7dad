"""The training job: config -> data -> model -> plan -> sharded model -> train loop -> metrics and
checkpoints. Runs inside each torchrun worker; `recsys.train` is its thin entry point."""

from __future__ import annotations

import logging
import os
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv

from recsys import config as config_mod
from recsys.config import ExperimentConfig, ShardingConfig
from recsys.data.batching import steps_per_epoch, train_batches
from recsys.data.source import TRAIN, DataSource, build_source, epoch_order, prepare_data
from recsys.models.ctr import TrainModule, build_model
from recsys.optim.dense import DenseLrWarmup, combined_optimizer, dense_optimizer
from recsys.optim.scaling import effective_optim
from recsys.optim.cowclip.catchup import catch_up_all_tables
from recsys.optim.cowclip.sharder import take_update_stats
from recsys.optim.embedding import attach_embedding_optimizer, embedding_sharders
from recsys.training.checkpoint import Checkpointer, CheckpointError, describe_failure
from recsys.training.comm_failure import HostLostError, host_lost, register_peers
from recsys.training.distributed import DistEnv, collective_device, init_distributed
from recsys.training.finite import FiniteGuard
from recsys.training.hierarchy import HostGroups, build_host_groups, pg_timeout_from_env, remap_plan_to_host, resolve_hosts
from recsys.training.merge import KStepMerger
from recsys.training.metrics import MetricsWriter, evaluate, format_metric, write_json_atomic
from recsys.training.progress import Progress
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
    groups = (
        build_host_groups(resolve_hosts(cfg.train.hosts), pg_timeout_from_env(cfg.train.pg_timeout_s))
        if cfg.train.merge_every > 0
        else None
    )
    if env.world_size > 1:  # a collective failure caused by another host is then told in one line naming it
        register_peers(
            groups.hosts if groups else resolve_hosts(1), pg_timeout_from_env(cfg.train.pg_timeout_s).total_seconds() if groups else None
        )
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
    _on_rank0(env, lambda: _save_plan_files(run_dir, plan_io.plan_to_dict(plan, shard_world, env.device.type, tables, meta), str(plan)))
    sharding_env = {}
    if groups:  # DMP over the host's ranks, with the plan moved onto them
        plan = remap_plan_to_host(plan, groups, env.device.type)
        sharding_env = {"env": ShardingEnv.from_process_group(groups.host_pg)}
    dmp = DistributedModelParallel(module, device=env.device, plan=plan, sharders=sharders, **sharding_env)
    dense = dense_optimizer(dmp, optim_cfg)
    optimizer = combined_optimizer(dmp, dense)
    warmup = DenseLrWarmup(dense, optim_cfg.dense_lr, warmup_steps) if warmup_steps else None
    ckpt = Checkpointer(run_dir / "checkpoints", env.rank, env.world_size, cfg.checkpoint.keep, groups, shape, source.identity())
    ckpt.data_start_step = resume_from.data_start_step if resume_from is not None else 0
    merger = None
    if groups:  # train.merge_route (RECSYS_MERGE_ROUTE overrides): auto (hierarchical when R > 1) | flat | hierarchical
        merger = KStepMerger(
            dmp,
            optimizer,
            groups.replica_pg,
            cfg.train.merge_every,
            cfg.train.merge_moments,
            host_pg=groups.host_pg,
            route=os.environ.get("RECSYS_MERGE_ROUTE", cfg.train.merge_route),
            rows=cfg.train.merge_rows,
        )
        ckpt.per_host_optim = not cfg.train.merge_moments  # unmerged moments: each host saves its own
    return Job(cfg, env, source, dmp, optimizer, dense, ckpt, run_dir, groups, merger, warmup, resume_from, lock if env.is_main else None)


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


def _dense_parameter_bytes(dmp: nn.Module) -> int:
    """Bytes of the trainable parameters outside the sharded embedding modules: what DDP
    all-reduces every step. tools/exp_kstep.py models a synchronous run's dense traffic from it."""
    from torchrec.distributed.types import ShardedModule

    sharded = {id(p) for m in dmp.modules() if isinstance(m, ShardedModule) for p in m.parameters()}
    seen, total = set(), 0
    for p in dmp.parameters():
        if p.requires_grad and id(p) not in sharded and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _mean_across_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def run(cfg: ExperimentConfig, model_factory: ModelFactory | None = None) -> dict[str, Any] | None:
    """Trains and evaluates; returns the summary on rank 0 (None elsewhere). A collective that
    fails because another host is gone or silent raises HostLostError (one line naming the host)."""
    try:
        return _run(cfg, model_factory)
    except HostLostError:
        raise
    except Exception as e:
        lost = host_lost(e)
        if lost is not None:
            raise lost from e
        raise


def _run(cfg: ExperimentConfig, model_factory: ModelFactory | None) -> dict[str, Any] | None:
    job = setup(cfg, model_factory)
    env, t = job.env, cfg.train
    per_epoch = steps_per_epoch(job.source, TRAIN, t.batch_size)
    data_start = job.checkpointer.data_start_step  # the step this data's epoch 0 began at
    total = total_steps(cfg, job.source, data_start)

    start_step, resumed_from = 0, None
    # RECSYS_RESUME=1: the same as resume=true
    if cfg.resume or os.environ.get("RECSYS_RESUME") == "1":
        latest = job.resume_from.path if job.resume_from else None  # the newest complete, compatible checkpoint
        if latest is not None:
            try:
                extra = job.checkpointer.load(latest, job.dmp, job.optimizer, job.dense_optimizer)
            except (CheckpointError, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # corrupt bytes behind complete-looking files (DCP raises on every rank)
                raise CheckpointError(
                    f"cannot load checkpoint {latest}: {describe_failure(e)}; move it aside to resume from an earlier one"
                ) from None
            start_step, resumed_from = int(extra["step"]), str(latest)
            # FBGEMM's COWCLIP/counter modes keep their iteration outside the state dict
            job.optimizer.set_optimizer_step(start_step)
            if job.merger is not None:
                job.merger.load_state_dict(extra["rank_state"].get("merger", {}))
            if env.is_main:
                log.info("resumed from %s at step %d", latest, start_step)
                if extra["shard_world"] != job.checkpointer.shard_world:
                    per_host = " per host" if cfg.train.merge_every > 0 else ""
                    log.info("resharded from %d to %d ranks%s", extra["shard_world"], job.checkpointer.shard_world, per_host)
        elif env.is_main:
            log.info("resume=true but no checkpoint in %s: starting from scratch", job.checkpointer.root)
    writer = MetricsWriter(job.run_dir, env.is_main, resume_step=start_step if resumed_from else None, tensorboard=cfg.train.tensorboard)
    if env.is_main:
        log.info(
            "training %s on %d rank(s) (%s, %s): %d steps of %d samples (%d steps/epoch)",
            cfg.model.name,
            env.world_size,
            env.device,
            env.backend,
            total,
            t.batch_size,
            per_epoch,
        )

    pipeline = TrainPipelineSparseDist(job.dmp, job.optimizer, env.device)
    batches = train_batches(
        job.source, t.batch_size, env.rank, env.world_size, start_step - data_start, total - data_start, epoch_order(cfg, job.source)
    )
    progress = Progress(total, start_step, t.batch_size)
    wall0 = time.perf_counter()
    loss_sum, loss_n = 0.0, 0
    bytes_logged, step_logged = 0.0, start_step
    bytes_from_step = start_step  # the merger's byte counters cover steps (bytes_from_step, total]
    if job.merger is not None and resumed_from:
        bytes_logged = _mean_across_ranks(job.merger.cross_host_bytes_total) * env.world_size
        bytes_from_step = 0 if job.merger.merges else start_step
    ckpt_every = cfg.checkpoint.every_steps
    if job.merger is not None and ckpt_every:  # checkpoints only at merge steps (docs/kstep.md)
        ckpt_every = -(-ckpt_every // job.merger.every_k) * job.merger.every_k
        if ckpt_every != cfg.checkpoint.every_steps and env.is_main:
            later = "" if ckpt_every < total else f"; none before the final one at step {total}"
            log.info(
                "checkpoint.every_steps=%d rounded up to %d: checkpoints are taken at merge steps only (train.merge_every=%d)%s",
                cfg.checkpoint.every_steps,
                ckpt_every,
                job.merger.every_k,
                later,
            )
    last_eval: dict[str, Any] = {}
    guard = FiniteGuard()  # a non-finite loss or weight stops the run (recsys/training/finite.py)

    def last_checkpoint() -> str | None:
        latest = job.checkpointer.latest()
        return str(latest) if latest is not None else None

    def eval_now(step: int) -> dict[str, Any]:
        train_s = progress.train_s()
        guard.check(step, last_checkpoint=last_checkpoint)
        with progress.pause():
            pipeline.detach()
            result = evaluate(job.dmp, job.source, t.eval_batch_size, env.rank, env.world_size, env.device)
            record = {"kind": "eval", "step": step, "epoch": (step - data_start) / per_epoch, "train_s": train_s, **result}
            writer.log(record)
            if env.is_main:
                oracle = f" (oracle {format_metric(result['oracle_auc'])})" if "oracle_auc" in result else ""
                why = f" ({result['auc_undefined']})" if "auc_undefined" in result else ""
                log.info("eval step %d: auc %s%s%s logloss %.4f", step, format_metric(result["auc"]), why, oracle, result["logloss"])
            pipeline.attach(job.dmp)
        return record

    def checkpoint_now(step: int) -> None:
        rank_state = {"merger": job.merger.state_dict()} if job.merger is not None else None
        with progress.pause():
            catch_up_all_tables(job.dmp)  # embedding_l2_scope=catchup: every row at this step
            guard.check(step, job.dmp, last_checkpoint)
            job.checkpointer.save(step, job.dmp, job.optimizer, {"samples": step * t.batch_size}, rank_state)

    for step in range(start_step + 1, total + 1):
        if job.warmup is not None:
            job.warmup.before_step(step)
        step_loss, _, _ = pipeline.progress(batches)
        if job.merger is not None and not job.merger.step(step) and step == total:
            job.merger.merge()  # the final model is the merged one
        step_loss = float(step_loss)
        guard.see_loss(step, step_loss)
        loss_sum += step_loss
        loss_n += 1
        if step % t.log_every == 0 or step == total:
            guard.check(step, last_checkpoint=last_checkpoint)
            loss = _mean_across_ranks(loss_sum / loss_n)
            stats = progress.update(step)
            if job.merger is not None:  # bytes that crossed hosts, all ranks, per step of this window
                sent = _mean_across_ranks(job.merger.cross_host_bytes_total) * env.world_size
                stats["cross_host_bytes_per_step"] = (sent - bytes_logged) / max(step - step_logged, 1)
                bytes_logged, step_logged = sent, step
            if job.warmup is not None:
                stats["dense_lr"] = job.dense_optimizer.param_groups[0]["lr"]
            unique, clipped = take_update_stats(job.dmp)
            if unique:  # CowClip kernels: share of updated rows whose gradient was clipped (all ranks)
                uc = torch.tensor([unique, clipped], dtype=torch.float64, device=collective_device())
                dist.all_reduce(uc)
                stats["clipped_row_fraction"] = float(uc[1] / uc[0])
            writer.log({"kind": "train", "step": step, "epoch": (step - data_start) / per_epoch, "loss": loss, **stats})
            if env.is_main:
                log.info(progress.line(step, (step - data_start) / per_epoch, loss, stats))
            loss_sum, loss_n = 0.0, 0
        if t.eval_every and step % t.eval_every == 0 and step != total:
            last_eval = eval_now(step)
        if ckpt_every and step % ckpt_every == 0 and step != total:
            checkpoint_now(step)

    train_wall = time.perf_counter() - wall0
    train_s_no_eval = progress.train_s()
    last_eval = eval_now(total)
    checkpoint_now(total)
    summary = {
        "name": cfg.name,
        "model": cfg.model.name,
        "world_size": env.world_size,
        "device": str(env.device),
        "steps": total,
        "global_batch": t.batch_size,
        "samples": total * t.batch_size,
        "resumed_from": resumed_from,
        "train_wall_s_this_run": train_wall,
        "samples_per_s_this_run": (total - start_step) * t.batch_size / max(train_wall, 1e-9),
        # without mid-run evals and checkpoints (train_wall_s_this_run includes them)
        "train_s_no_eval_this_run": train_s_no_eval,
        "dense_parameter_bytes": _dense_parameter_bytes(job.dmp),
        **{k: v for k, v in last_eval.items() if k not in ("kind", "step", "epoch", "train_s")},
    }
    if job.merger is not None:
        m = job.merger
        summary.update(
            hosts=job.groups.hosts,
            merge_every=m.every_k,
            merge_moments=m.merge_moments,
            merges=m.merges,
            merge_route=m.route,
            checkpoint_every_steps=ckpt_every,
            cross_host_bytes_total=_mean_across_ranks(m.cross_host_bytes_total) * env.world_size,
            merge_payload_bytes_per_rank=m.payload_bytes_per_merge,
            merge_rows=m.rows,
            # the last merge: embedding rows averaged / held, in all ranks' tracked shards
            rows_merged_last=int(_mean_across_ranks(m.rows_merged) * env.world_size),
            rows_tracked=int(_mean_across_ranks(m.rows_tracked) * env.world_size),
            merge_seconds={k: round(v, 3) for k, v in m.seconds.items()},  # rank 0's, all merges, by phase
            replica_divergence=m.max_divergence(),
        )
        summary["cross_host_bytes_per_step"] = summary["cross_host_bytes_total"] / max(total - bytes_from_step, 1)
    if summary.get("oracle_auc") is not None and summary.get("auc") is not None:
        summary["auc_gap_to_oracle"] = summary["oracle_auc"] - summary["auc"]
    writer.close()
    if env.is_main:
        write_json_atomic(job.run_dir / "summary.json", summary)
        if cfg.train.curves:  # matplotlib (the [viz] extra) is checked with the config
            from recsys.training.plots import plot_run

            plot_run(job.run_dir)
        log.info("summary: %s", {k: summary[k] for k in ("auc", "logloss", "oracle_auc") if k in summary})
    dist.barrier()
    return summary if env.is_main else None
