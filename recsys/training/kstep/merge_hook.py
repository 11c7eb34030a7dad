"""``KStepMergeHook``: k-step merging for an existing TorchRec loop in two lines (docs/dropin.md).

Its constructor builds the host and replica groups from the torchrun environment and gives DMP
the host's ``ShardingEnv``; ``step(model, optimizer)`` after each optimizer step runs the engine,
``KStepMerger`` (recsys/training/kstep/merger.py), every k steps and at ``total_steps``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from recsys.training.kstep.merger import KStepMerger
from recsys.training.kstep.outer import Compress, OuterKind, check_outer


class KStepMergeHook:
    """K-step merging for an existing TorchRec loop in two lines (docs/dropin.md): a
    constructor that builds the host groups from the torchrun environment, one call per step.

    Call it in every rank after ``dist.init_process_group``; the number of hosts is ``hosts`` or
    torchrun's ``GROUP_WORLD_SIZE`` (``--nnodes``), else ``NNODES``, else 1 (then every call is a
    no-op and ``env`` is the whole job). It gives DMP what it needs: ``env``, a ``ShardingEnv``
    over this host's ranks (embeddings sharded inside the host, dense data-parallel inside it);
    plan with ``TopologyAwarePlanner(..., hosts=merger.hosts)``, whose ``collective_plan`` moves
    the one-host plan onto each host's ranks. ``step(model, optimizer)`` after each optimizer step
    averages the replicas across hosts every ``every_k`` steps (``KStepMerger`` over the replica
    groups) and at ``total_steps`` if given, so the final model is a merged one with no extra
    call; without ``total_steps`` use ``with KStepMergeHook(...) as merger:`` or
    ``merger.finish()``, which merge the steps left since the last merge.

    Example (torchrun --nnodes 2 --nproc_per_node 4 train.py)::

        from recsys import KStepMergeHook
        merger = KStepMergeHook(every_k=16, total_steps=steps)
        planner = TopologyAwarePlanner("cpu-gloo", batch_size=512, hosts=merger.hosts)
        model = DistributedModelParallel(model, env=merger.env, plan=planner.collective_plan(model, sharders), sharders=sharders)
        for _ in range(steps):
            pipeline.progress(batches)
            merger.step(model, optimizer)
    """

    def __init__(
        self,
        every_k: int,
        *,
        total_steps: int | None = None,
        hosts: int | None = None,
        merge_moments: bool = False,
        route: str = "auto",
        rows: str = "touched",
        timeout: "timedelta | None" = None,
        outer: OuterKind = "average",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compress: Compress = "none",
    ) -> None:
        """``outer`` / ``outer_lr`` / ``outer_momentum`` / ``compress``: the merge's outer step and
        bf16 deltas, as ``KStepMerger`` takes them (recsys/training/kstep/outer.py)."""
        from torchrec.distributed.types import ShardingEnv

        from recsys.training.kstep.host_groups import build_host_groups, pg_timeout_from_env, resolve_hosts

        if not dist.is_initialized():
            raise RuntimeError("KStepMergeHook: call torch.distributed.init_process_group() first")
        if every_k <= 0:
            raise ValueError(f"every_k must be positive, got {every_k}")
        self.every_k = every_k
        self.total_steps = total_steps
        self.merge_moments = merge_moments
        self.route = route
        self.rows = rows
        check_outer(outer, outer_lr, outer_momentum, compress)
        self.outer = dict(outer=outer, outer_lr=outer_lr, outer_momentum=outer_momentum, compress=compress)
        self.hosts = resolve_hosts(hosts or 0)
        self.groups = build_host_groups(self.hosts, timeout or pg_timeout_from_env()) if self.hosts > 1 else None
        self.pg = self.groups.host_pg if self.groups is not None else dist.GroupMember.WORLD
        self.env = ShardingEnv.from_process_group(self.pg)
        self.steps = 0
        self.merger: KStepMerger | None = None
        self._merged_at = 0

    def _bind(self, model: nn.Module, optimizer: Any) -> KStepMerger:
        if self.merger is None:
            assert self.groups is not None
            # bound after the first step: the rows that step moved were not seen, so the first
            # merge takes whole shards (``tracking_from_start=False``), the later ones touched rows
            self.merger = KStepMerger(
                model,
                optimizer,
                self.groups.replica_pg,
                self.every_k,
                self.merge_moments,
                host_pg=self.groups.host_pg,
                route=self.route,
                rows=self.rows,
                tracking_from_start=False,
                **self.outer,
            )
        elif self.merger.dmp is not model or self.merger.optimizer is not optimizer:
            raise ValueError("KStepMergeHook.step: called with another model or optimizer than at the first step")
        return self.merger

    def step(self, model: nn.Module, optimizer: Any) -> bool:
        """After each optimizer step: counts it and merges at every ``every_k``-th step and at
        ``total_steps``. Collective over the replica groups. Returns whether it merged."""
        self.steps += 1
        if self.groups is None:
            return False
        merger = self._bind(model, optimizer)
        if merger.should_merge(self.steps) or self.steps == self.total_steps:
            merger.merge()
            self._merged_at = self.steps
            return True
        return False

    def finish(self) -> bool:
        """Merges the steps left since the last merge, so the final model is a merged one.
        Collective; returns whether it merged."""
        if self.merger is None or self._merged_at == self.steps:
            return False
        self.merger.merge()
        self._merged_at = self.steps
        return True

    def __enter__(self) -> "KStepMergeHook":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:  # after an error the other hosts may not reach the collective
            self.finish()

    @property
    def merges(self) -> int:
        return self.merger.merges if self.merger is not None else 0
