"""Training hooks: the components that act at the Trainer's step, log and checkpoint points.

The Trainer (recsys/training/trainer.py) knows only this interface; each hook decides for itself
what to do at each point, so a new concern (a merger, an optimizer's statistics, an lr schedule)
plugs in without the loop growing a branch for it. Every method is called on every rank, in the
same order, so a hook may run collectives in any of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys.optim.cowclip.catchup import catch_up_all_tables
from recsys.optim.cowclip.sharder import take_update_stats
from recsys.optim.dense import DenseLrWarmup
from recsys.training.distributed import collective_device, mean_across_ranks
from recsys.training.kstep.host_groups import HostGroups
from recsys.training.kstep.merger import KStepMerger


class TrainHook:
    """The no-op base: a hook overrides the points it acts at."""

    def on_resume(self, step: int, rank_state: dict[str, Any]) -> None:
        """After a checkpoint was loaded: `step` is its step, `rank_state` what `rank_state()`
        returned for this rank when it was saved ({} if nothing)."""

    def before_step(self, step: int) -> None:
        """Before training step `step` (1-based)."""

    def after_step(self, step: int, last_step: bool) -> None:
        """After step `step`'s optimizer update; `last_step`: it was the run's last."""

    def log_stats(self, step: int) -> dict[str, float]:
        """Figures for this log line and metrics.jsonl record (called at every log step)."""
        return {}

    def before_checkpoint(self, step: int) -> None:
        """Before a checkpoint of step `step` is written (mid-run and final)."""

    def rank_state(self) -> dict[str, Any]:
        """Small per-rank state saved with each checkpoint and given back to `on_resume`."""
        return {}

    def summary(self, total_steps: int) -> dict[str, Any]:
        """Entries of the run's summary.json."""
        return {}


class DenseWarmupHook(TrainHook):
    """The scaling rule's dense-lr warmup (optim.scale_from_batch): sets the lr before each step
    and logs it."""

    def __init__(self, warmup: DenseLrWarmup, dense_optimizer: Any) -> None:
        self.warmup = warmup
        self.dense_optimizer = dense_optimizer

    def before_step(self, step: int) -> None:
        self.warmup.before_step(step)

    def log_stats(self, step: int) -> dict[str, float]:
        return {"dense_lr": self.dense_optimizer.param_groups[0]["lr"]}


class CowClipHook(TrainHook):
    """CowClip embedding kernels: the share of updated rows whose gradient was clipped (all
    ranks, since the last log line), and, before a checkpoint, every `embedding_l2_scope=catchup`
    row brought to the checkpoint's step. Both are no-ops for a model without CowClip tables."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def log_stats(self, step: int) -> dict[str, float]:
        unique, clipped = take_update_stats(self.model)
        if not unique:
            return {}
        counts = torch.tensor([unique, clipped], dtype=torch.float64, device=collective_device())
        dist.all_reduce(counts)
        return {"clipped_row_fraction": float(counts[1] / counts[0])}

    def before_checkpoint(self, step: int) -> None:
        catch_up_all_tables(self.model)


class MergeHook(TrainHook):
    """Hierarchical training (train.merge_every > 0): the k-step merger merges at its steps and
    once more at the last step (the final model is the merged one), saves its state with each
    checkpoint, and accounts the bytes that crossed hosts per step for the log and the summary."""

    def __init__(self, merger: KStepMerger, groups: HostGroups, world_size: int, checkpoint_every: int) -> None:
        self.merger = merger
        self.groups = groups
        self.world_size = world_size
        self.checkpoint_every = checkpoint_every
        self.bytes_logged = 0.0  # all ranks' cross-host bytes at the last log line
        self.step_logged = 0
        self.bytes_from_step = 0  # the merger's byte counters cover steps (bytes_from_step, total]

    def _bytes_sent(self) -> float:
        return mean_across_ranks(self.merger.cross_host_bytes_total) * self.world_size

    def on_resume(self, step: int, rank_state: dict[str, Any]) -> None:
        self.merger.load_state_dict(rank_state.get("merger", {}))
        self.bytes_logged = self._bytes_sent()
        self.step_logged = step
        self.bytes_from_step = 0 if self.merger.merges else step

    def after_step(self, step: int, last_step: bool) -> None:
        if not self.merger.step(step) and last_step:
            self.merger.merge()

    def log_stats(self, step: int) -> dict[str, float]:
        sent = self._bytes_sent()
        per_step = (sent - self.bytes_logged) / max(step - self.step_logged, 1)
        self.bytes_logged, self.step_logged = sent, step
        return {"cross_host_bytes_per_step": per_step}

    def rank_state(self) -> dict[str, Any]:
        return {"merger": self.merger.state_dict()}

    def summary(self, total_steps: int) -> dict[str, Any]:
        m = self.merger
        total_bytes = self._bytes_sent()
        return dict(
            hosts=self.groups.hosts,
            merge_every=m.every_k,
            merge_moments=m.merge_moments,
            merges=m.merges,
            merge_route=m.route,
            checkpoint_every_steps=self.checkpoint_every,
            cross_host_bytes_total=total_bytes,
            merge_payload_bytes_per_rank=m.payload_bytes_per_merge,
            merge_rows=m.rows,
            # the parameters' outer step (DiLoCo's Nesterov, or plain averaging) and their wire format
            merge_outer={"kind": m.outer.kind, "lr": m.outer.lr, "momentum": m.outer.momentum},
            merge_compress=m.outer.compress,
            # what the outer step and bf16 deltas keep between merges, all ranks (anchors, momentum, residuals)
            merge_outer_state_bytes=int(mean_across_ranks(m.outer.state_bytes()) * self.world_size),
            # the last merge: embedding rows averaged / held, in all ranks' tracked shards
            rows_merged_last=int(mean_across_ranks(m.rows_merged) * self.world_size),
            rows_tracked=int(mean_across_ranks(m.rows_tracked) * self.world_size),
            merge_seconds={k: round(v, 3) for k, v in m.seconds.items()},  # rank 0's, all merges, by phase
            replica_divergence=m.max_divergence(),
            cross_host_bytes_per_step=total_bytes / max(total_steps - self.bytes_from_step, 1),
        )
