"""Atomic distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout: <root>/step_000000120/ holds DCP's files for the sharded model and the optimizer state
(embedding shards stay sharded: each rank writes its own), plus one `rank<r>.pt` per rank with
its RNG states, and `COMMITTED` (JSON: step, world size, extra state).

Atomicity: everything is written into `step_XXXXXXXXX.tmp/`; only after every rank has
finished (barrier) does rank 0 write COMMITTED, fsync, and rename the directory to its final
name. A crash at any point leaves either a `.tmp` directory (ignored, removed by the next save)
or a complete checkpoint; nothing half-written is ever found by `latest()`.
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
    def __init__(self, root: Path, rank: int, world_size: int, keep: int = 2) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep

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
    def save(self, step: int, model: nn.Module, optimizer: KeyedOptimizer, extra: dict[str, Any]) -> Path:
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
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, storage_writer=writer)
        torch.save({"torch_rng": torch.get_rng_state()}, tmp / f"rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            _fsync_tree(tmp)
            marker = {"step": step, "world_size": self.world_size, "extra": extra}
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
        """Restores model, optimizer and this rank's RNG in place; returns the marker's `extra`."""
        marker = json.loads((path / MARKER).read_text())
        if marker["world_size"] != self.world_size:
            raise RuntimeError(
                f"checkpoint {path} was written by {marker['world_size']} ranks, this job has {self.world_size}"
            )
        # Adam's state is created lazily; a zero-gradient step creates it so DCP can load into it.
        dense_optimizer.init_state()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=str(path))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        rank_file = path / f"rank{self.rank}.pt"
        torch.set_rng_state(torch.load(rank_file, weights_only=True)["torch_rng"])
        return dict(marker["extra"], step=marker["step"])
