"""Atomic distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout: <root>/step_000000120/ holds DCP's files for the sharded model and the optimizer state
(embedding shards stay sharded: each rank writes its own), plus one `rank<r>.pt` per rank with
its RNG states, and `COMMITTED` (JSON: step, world size, extra state).

Atomicity: everything is written into `step_XXXXXXXXX.tmp/`; only after every rank has
finished (barrier) does rank 0 write COMMITTED, fsync, and rename the directory to its final
name. A crash at any point leaves either a `.tmp` directory (ignored, removed by the next save)
or a complete checkpoint; nothing half-written is ever found by `latest()`.

Hierarchical runs (hosts x ranks, k-step merges; docs/kstep.md), `Checkpointer(..., groups=)`:
saves happen only at merge steps, when every host holds the same model. Host 0's ranks write the
model and the optimizer state through DCP over `host_pg` (so the files are exactly those of a
one-host run of R ranks, written once, not H times); the other hosts write nothing but their
`rank<g>.pt`. When the optimizer moments are not merged (`merge_moments=false`) they differ
between hosts, so host h > 0 also writes its optimizer state (no model) into `host<h>/`:
exact resume without forcing a moment merge at checkpoint steps. Resume: every host loads the
model (and, if there is no `host<h>/`, the optimizer state) from host 0's files over its own
`host_pg`. COMMITTED records `ranks_per_host` (the shard world) and `hosts`; a checkpoint loads
into any run whose shard world matches (another host count, or a plain run of R ranks).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from torchrec.optim.keyed import KeyedOptimizer

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step_(\d{9})$")
MARKER = "COMMITTED"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


class Checkpointer:
    def __init__(self, root: Path, rank: int, world_size: int, keep: int = 2, groups: Any = None) -> None:
        """`groups`: a `hierarchy.HostGroups` for hierarchical runs (see the module docstring)."""
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.groups = groups
        self.per_host_optim = False  # hierarchical, moments not merged: host h>0 saves its own

    @property
    def shard_world(self) -> int:
        return self.groups.ranks_per_host if self.groups is not None else self.world_size

    # -- discovery -----------------------------------------------------------------------------
    def committed(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        out = [p for p in self.root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
        return sorted(out, key=lambda p: p.name)

    def latest(self) -> Path | None:
        found = self.committed()
        return found[-1] if found else None

    # -- save ----------------------------------------------------------------------------------
    def save(
        self, step: int, model: nn.Module, optimizer: KeyedOptimizer, extra: dict[str, Any],
        rank_state: dict[str, Any] | None = None,
    ) -> Path:
        """Collective over all ranks. `rank_state`: small per-rank state (saved in rank<r>.pt)."""
        final = self.root / f"step_{step:09d}"
        tmp = self.root / f"step_{step:09d}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        # One file per tensor: FBGEMM keeps all tables of a kernel in one flat buffer, so DCP
        # clones each table view before writing it and, with one file per rank, keeps every
        # clone alive until the file is closed, doubling memory at raw-Criteo table sizes.
        g = self.groups
        if g is None:
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
            dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, storage_writer=writer)
        elif g.host == 0:  # replicas are identical after the merge: host 0's copy is the checkpoint
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            dcp.save(state, storage_writer=writer, process_group=g.host_pg)
        elif self.per_host_optim:  # this host's own (unmerged) moments
            sub = tmp / f"host{g.host}"
            if g.local_rank == 0:
                sub.mkdir()
            dist.barrier(group=g.host_pg)
            writer = dcp.FileSystemWriter(str(sub), single_file_per_rank=False)
            dcp.save({"optim": optimizer.state_dict()}, storage_writer=writer, process_group=g.host_pg)
        torch.save({"torch_rng": torch.get_rng_state(), "state": rank_state or {}}, tmp / f"rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            for sub in tmp.glob("host*"):
                _fsync_tree(sub)
            _fsync_tree(tmp)
            marker = {"step": step, "world_size": self.world_size, "extra": extra}
            if g is not None:
                marker.update(ranks_per_host=g.ranks_per_host, hosts=g.hosts, per_host_optim=self.per_host_optim)
            with open(tmp / MARKER, "w") as f:
                json.dump(marker, f)
                f.flush()
                os.fsync(f.fileno())
            old = self.root / f"step_{step:09d}.old.tmp"
            if final.exists():  # a re-save of the same step (e.g. after resume): move it aside
                os.replace(final, old)  # deleted only once the new one is in place
            os.replace(tmp, final)
            _fsync_dir(self.root)
            shutil.rmtree(old, ignore_errors=True)
            for old in self.committed()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    # -- load ----------------------------------------------------------------------------------
    def load(self, path: Path, model: nn.Module, optimizer: KeyedOptimizer, dense_optimizer: KeyedOptimizer) -> dict[str, Any]:
        """Restores model, optimizer and this rank's RNG in place; returns the marker's `extra`
        with `step` and `rank_state` (what `save` got as rank_state, {} if none)."""
        marker = json.loads((path / MARKER).read_text())
        shard_world = marker.get("ranks_per_host", marker["world_size"])
        if shard_world != self.shard_world:
            what = f"{shard_world} ranks" + (" per host" if "ranks_per_host" in marker else "")
            mine = f"{self.shard_world} ranks" + (" per host" if self.groups is not None else "")
            raise RuntimeError(f"checkpoint {path} was written by {what}, this job has {mine}")
        # Adam's state is created lazily; a zero-gradient step creates it so DCP can load into it.
        dense_optimizer.init_state()
        g = self.groups
        pg = g.host_pg if g is not None else None  # every host reads the same files on its own
        own = path / f"host{g.host}" if g is not None and g.host > 0 else None
        if own is not None and (own / ".metadata").is_file():  # this host's unmerged moments
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=str(path), process_group=pg)
            optim = {"optim": optimizer.state_dict()}
            dcp.load(optim, checkpoint_id=str(own), process_group=pg)
            state.update(optim)
        else:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            dcp.load(state, checkpoint_id=str(path), process_group=pg)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        rank_file = path / f"rank{self.rank}.pt"
        if not rank_file.is_file() and g is not None:  # another host count: a replica's RNG
            rank_file = path / f"rank{g.local_rank}.pt"
        saved = torch.load(rank_file, weights_only=True)
        torch.set_rng_state(saved["torch_rng"])
        return dict(marker["extra"], step=marker["step"], rank_state=saved.get("state", {}))
