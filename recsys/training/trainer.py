"""The training loop: a Trainer runs a Job's parts (recsys/training/job.py) from the resume
point to the last step, with evals, log lines, checkpoints and the summary.

The loop itself only orders the work. Its components decide for themselves: the Checkpointer
resumes and keeps the cadence, hooks (recsys/training/hooks.py: the k-step merger, CowClip's
statistics and catch-up, the dense-lr warmup) act at the step, log and checkpoint points, and the
FiniteGuard stops a run whose loss or weights are no longer finite.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from recsys.config import ExperimentConfig
from recsys.data.batching import steps_per_epoch, train_batches
from recsys.data.source import TRAIN, epoch_order
from recsys.training.comm_failure import HostLostError, host_lost
from recsys.training.distributed import mean_across_ranks
from recsys.training.finite import FiniteGuard
from recsys.training.job import Job, ModelFactory, setup
from recsys.training.metrics import MetricsWriter, evaluate, format_metric, write_json_atomic
from recsys.training.progress import Progress
from recsys.training.run_dir import total_steps

log = logging.getLogger("recsys.train")


def run(cfg: ExperimentConfig, model_factory: ModelFactory | None = None) -> dict[str, Any] | None:
    """Trains and evaluates; returns the summary on rank 0 (None elsewhere). A collective that
    fails because another host is gone or silent raises HostLostError (one line naming the host)."""
    try:
        return Trainer(setup(cfg, model_factory)).train()
    except HostLostError:
        raise
    except Exception as e:
        lost = host_lost(e)
        if lost is not None:
            raise lost from e
        raise


class Trainer:
    """Runs one job on every rank: ``train()`` resumes (if asked), steps, logs, evaluates and
    checkpoints, then writes the summary. Built from a ``Job`` (``setup(cfg)``), so a caller can
    change the job's parts, e.g. add a hook, before training."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cfg = job.cfg
        self.env = job.env
        self.hooks = job.hooks
        self.checkpointer = job.checkpointer
        self.per_epoch = steps_per_epoch(job.source, TRAIN, self.cfg.train.batch_size)
        self.data_start = self.checkpointer.data_start_step  # the step this data's epoch 0 began at
        self.total = total_steps(self.cfg, job.source, self.data_start)
        self.guard = FiniteGuard()  # a non-finite loss or weight stops the run (recsys/training/finite.py)
        self.start_step, self.resumed_from = self._resume()
        resume_step = self.start_step if self.resumed_from else None
        self.writer = MetricsWriter(job.run_dir, self.env.is_main, resume_step=resume_step, tensorboard=self.cfg.train.tensorboard)
        self.pipeline = TrainPipelineSparseDist(job.dmp, job.optimizer, self.env.device)
        self.progress = Progress(self.total, self.start_step, self.cfg.train.batch_size)
        self.last_eval: dict[str, Any] = {}

    def _resume(self) -> tuple[int, str | None]:
        """(the step to continue after, the checkpoint it comes from): the newest complete,
        compatible checkpoint that the launcher's preflight chose, or (0, None)."""
        job = self.job
        if not self.cfg.resume:
            return 0, None
        if job.resume_from is None:
            if self.env.is_main:
                log.info("resume=true but no checkpoint in %s: starting from scratch", self.checkpointer.root)
            return 0, None
        path = job.resume_from.path
        extra = self.checkpointer.resume(path, job.dmp, job.optimizer, job.dense_optimizer)
        step = int(extra["step"])
        for hook in self.hooks:
            hook.on_resume(step, extra["rank_state"])
        if self.env.is_main:
            log.info("resumed from %s at step %d", path, step)
            if extra["shard_world"] != self.checkpointer.shard_world:
                per_host = " per host" if self.cfg.train.merge_every > 0 else ""
                log.info("resharded from %d to %d ranks%s", extra["shard_world"], self.checkpointer.shard_world, per_host)
        return step, str(path)

    def _epoch(self, step: int) -> float:
        return (step - self.data_start) / self.per_epoch

    def _last_checkpoint(self) -> str | None:
        latest = self.checkpointer.latest()
        return str(latest) if latest is not None else None

    def train(self) -> dict[str, Any] | None:
        """Steps from the resume point to the last, then the final eval and checkpoint; returns
        the summary on rank 0 (None elsewhere)."""
        t, env = self.cfg.train, self.env
        if env.is_main:
            what = (self.cfg.model.name, env.world_size, env.device, env.backend, self.total, t.batch_size, self.per_epoch)
            log.info("training %s on %d rank(s) (%s, %s): %d steps of %d samples (%d steps/epoch)", *what)
        batches = train_batches(
            self.job.source,
            t.batch_size,
            env.rank,
            env.world_size,
            self.start_step - self.data_start,
            self.total - self.data_start,
            epoch_order(self.cfg, self.job.source),
        )
        wall0 = time.perf_counter()
        loss_sum, loss_n = 0.0, 0
        for step in range(self.start_step + 1, self.total + 1):
            last = step == self.total
            for hook in self.hooks:
                hook.before_step(step)
            step_loss, _, _ = self.pipeline.progress(batches)
            for hook in self.hooks:
                hook.after_step(step, last)
            step_loss = float(step_loss)
            self.guard.see_loss(step, step_loss)
            loss_sum, loss_n = loss_sum + step_loss, loss_n + 1
            if step % t.log_every == 0 or last:
                self.log(step, loss_sum / loss_n)
                loss_sum, loss_n = 0.0, 0
            if t.eval_every and step % t.eval_every == 0 and not last:
                self.last_eval = self.evaluate(step)
            if self.checkpointer.due(step, self.total):
                self.checkpoint(step)
        train_wall = time.perf_counter() - wall0
        train_s_no_eval = self.progress.train_s()
        self.last_eval = self.evaluate(self.total)
        self.checkpoint(self.total)
        return self.finish(train_wall, train_s_no_eval)

    def log(self, step: int, mean_loss: float) -> None:
        """One progress line (rank 0) and metrics record: the loss averaged over the steps since the
        last line and all ranks, throughput, and what the hooks report."""
        self.guard.check(step, last_checkpoint=self._last_checkpoint)
        loss = mean_across_ranks(mean_loss)
        stats = self.progress.update(step)
        for hook in self.hooks:
            stats.update(hook.log_stats(step))
        self.writer.log({"kind": "train", "step": step, "epoch": self._epoch(step), "loss": loss, **stats})
        if self.env.is_main:
            log.info(self.progress.line(step, self._epoch(step), loss, stats))

    def evaluate(self, step: int) -> dict[str, Any]:
        """AUC and log loss on the eval split (all ranks), outside the training time."""
        env = self.env
        train_s = self.progress.train_s()
        self.guard.check(step, last_checkpoint=self._last_checkpoint)
        with self.progress.pause():
            self.pipeline.detach()
            result = evaluate(self.job.dmp, self.job.source, self.cfg.train.eval_batch_size, env.rank, env.world_size, env.device)
            record = {"kind": "eval", "step": step, "epoch": self._epoch(step), "train_s": train_s, **result}
            self.writer.log(record)
            if env.is_main:
                oracle = f" (oracle {format_metric(result['oracle_auc'])})" if "oracle_auc" in result else ""
                why = f" ({result['auc_undefined']})" if "auc_undefined" in result else ""
                log.info("eval step %d: auc %s%s%s logloss %.4f", step, format_metric(result["auc"]), why, oracle, result["logloss"])
            self.pipeline.attach(self.job.dmp)
        return record

    def checkpoint(self, step: int) -> None:
        """A checkpoint of `step`, once every hook has brought its state to the step and the
        weights were checked finite (a non-finite model is never saved)."""
        rank_state: dict[str, Any] = {}
        for hook in self.hooks:
            rank_state.update(hook.rank_state())
        with self.progress.pause():
            for hook in self.hooks:
                hook.before_checkpoint(step)
            self.guard.check(step, self.job.dmp, self._last_checkpoint)
            samples = {"samples": step * self.cfg.train.batch_size}
            self.checkpointer.save(step, self.job.dmp, self.job.optimizer, samples, rank_state or None)

    def finish(self, train_wall: float, train_s_no_eval: float) -> dict[str, Any] | None:
        """summary.json and the curves (rank 0); returns the summary on rank 0."""
        cfg, env, t = self.cfg, self.env, self.cfg.train
        summary = {
            "name": cfg.name,
            "model": cfg.model.name,
            "world_size": env.world_size,
            "device": str(env.device),
            "steps": self.total,
            "global_batch": t.batch_size,
            "samples": self.total * t.batch_size,
            "resumed_from": self.resumed_from,
            "train_wall_s_this_run": train_wall,
            "samples_per_s_this_run": (self.total - self.start_step) * t.batch_size / max(train_wall, 1e-9),
            # without mid-run evals and checkpoints (train_wall_s_this_run includes them)
            "train_s_no_eval_this_run": train_s_no_eval,
            "dense_parameter_bytes": dense_parameter_bytes(self.job.dmp),
            **{k: v for k, v in self.last_eval.items() if k not in ("kind", "step", "epoch", "train_s")},
        }
        for hook in self.hooks:
            summary.update(hook.summary(self.total))
        if summary.get("oracle_auc") is not None and summary.get("auc") is not None:
            summary["auc_gap_to_oracle"] = summary["oracle_auc"] - summary["auc"]
        self.writer.close()
        if env.is_main:
            write_json_atomic(self.job.run_dir / "summary.json", summary)
            if t.curves:  # matplotlib (the [viz] extra) is checked with the config
                from recsys.training.plots import plot_run

                plot_run(self.job.run_dir)
            log.info("summary: %s", {k: summary[k] for k in ("auc", "logloss", "oracle_auc") if k in summary})
        dist.barrier()
        return summary if env.is_main else None


def dense_parameter_bytes(dmp: nn.Module) -> int:
    """Bytes of the trainable parameters outside the sharded embedding modules: what DDP
    all-reduces every step. tools/experiments/kstep.py models a synchronous run's dense traffic from it."""
    from torchrec.distributed.types import ShardedModule

    sharded = {id(p) for m in dmp.modules() if isinstance(m, ShardedModule) for p in m.parameters()}
    seen, total = set(), 0
    for p in dmp.parameters():
        if p.requires_grad and id(p) not in sharded and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
