"""The DCP `Checkpointer`: when to checkpoint, which checkpoint to resume from, and the collective
save and load of a run's state with torch.distributed.checkpoint (DCP).

The directory layout and its atomic commit are in `layout.py`, the completeness and
hash checks in `integrity.py`, the state-shape comparison in `shape.py`,
the one-line reasons for a failed write in `failure.py`; this module holds the
decisions that use them.

Hierarchical runs (hosts x ranks, k-step merges; docs/kstep.md), `Checkpointer(..., groups=)`:
saves happen only at merge steps, when every host holds the same model. Host 0's ranks write the
model and the optimizer state through DCP over `host_pg` (so the files are exactly those of a
one-host run of R ranks, written once, not H times); the other hosts write nothing but their
`rank<g>.pt`. When the optimizer moments are not merged (`merge_moments=false`) they differ
between hosts, so host h > 0 also writes its optimizer state (no model) into `host<h>/`:
exact resume without forcing a moment merge at checkpoint steps. Resume: every host loads the
model (and, if there is no `host<h>/`, the optimizer state) from host 0's files over its own
`host_pg`. COMMITTED records `ranks_per_host` (the shard world) and `hosts`; a checkpoint loads
into any run whose shard world matches (another host count, or a plain run of R ranks), and,
with a reshardable optimizer state, into another number of ranks per host.

Decisions (docs/run_integrity.md):
- A resume whose config differs from the checkpoint's state shape stops with one line naming
  the keys (`check_compatible`).
- COMMITTED records `data`, the identity of the data trained on (recsys/data/identity.py), and
  `data_start_step`; a resume on other data stops with one line saying what changed
  (`check_data`), unless `resume_on_new_data=true`.
- `latest_complete()` falls back past a broken newest checkpoint to the previous complete one
  with a one-line warning naming the bad file.
- Pruning keeps the `keep` newest checkpoints of this run's lineage (`lineage` in COMMITTED,
  inherited on resume) by step, never the one just written and never another run's.
- A failed write (a full disk) removes the `.tmp` directory on every rank and raises
  `CheckpointError` (one line); the previous checkpoints are untouched.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # the launcher imports this module for its errors; it needs no torchrec
    from torchrec.optim.keyed import KeyedOptimizer

from recsys.data.identity import describe_data_change
from recsys.training.checkpoint.failure import describe_failure, disk_reason
from recsys.training.checkpoint.integrity import hash_files, incomplete_reason
from recsys.training.checkpoint.layout import commit_dir, committed, read_marker, step_dir_name, step_of
from recsys.training.checkpoint.shape import incompatible_changes, reshardable
from recsys.training.distributed import collective_device

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """An expected, user-facing checkpoint failure; the message is one line."""


class Checkpointer:
    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        keep: int = 2,
        groups: Any = None,
        shape: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
        every_steps: int = 0,
    ) -> None:
        """`groups`: a `hierarchy.HostGroups` for hierarchical runs (see the module docstring).
        `shape`: the config that shapes the saved state, recorded in and checked against COMMITTED.
        `data`: the identity of the data trained on (`DataSource.identity()`), likewise.
        `every_steps`: the mid-run cadence (`due`); 0: only the final checkpoint."""
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.groups = groups
        self.shape = shape or {}
        self.data = data
        self.data_start_step = 0  # where the epochs of `data` began (a resume_on_new_data run: later)
        self.per_host_optim = False  # hierarchical, moments not merged: host h>0 saves its own
        self.lineage = uuid.uuid4().hex  # this run's; a resume adopts the checkpoint's (load)
        self.every_steps = every_steps

    # -- cadence -------------------------------------------------------------------------------
    def align_every(self, k: int) -> int:
        """Rounds the cadence up to a multiple of `k` (a hierarchical run checkpoints only at its
        merge steps, where every host holds the same model); returns the new cadence."""
        if self.every_steps:
            self.every_steps = -(-self.every_steps // k) * k
        return self.every_steps

    def due(self, step: int, last_step: int) -> bool:
        """Whether a mid-run checkpoint is taken after `step`; the last step's is always taken,
        after the final eval, so it is not due here."""
        return bool(self.every_steps) and step % self.every_steps == 0 and step != last_step

    @property
    def shard_world(self) -> int:
        return self.groups.ranks_per_host if self.groups is not None else self.world_size

    # -- discovery -----------------------------------------------------------------------------
    def committed(self) -> list[Path]:
        return committed(self.root)

    def latest(self) -> Path | None:
        found = self.committed()
        return found[-1] if found else None

    def latest_complete(self, verify_bytes: bool = True) -> Path | None:
        """The newest checkpoint that looks complete (`incomplete_reason`); each newer, broken one
        gets a one-line warning naming its bad file (on rank 0) and is left in place."""
        for path in reversed(self.committed()):
            why = incomplete_reason(path, verify_bytes)
            if why is None:
                return path
            if self.rank == 0:
                log.warning("warning: checkpoint %s is incomplete (%s); falling back to an earlier one", path.name, why)
        return None

    def check_compatible(self, path: Path) -> None:
        """CheckpointError (one line) if the checkpoint was written under another state shape."""
        changes = incompatible_changes(read_marker(path), self.shape, self.shard_world)
        if changes:
            raise CheckpointError(
                f"cannot resume from {path}: the config changed ({'; '.join(changes)}); restore these values, "
                "or start a new run (another run_dir, or overwrite=true)"
            )

    def check_data(self, path: Path, allow_new: bool, warn: bool = True) -> int:
        """The step the epochs of this run's data count from, after checking that the checkpoint
        trained on the same data: CheckpointError (one line saying what changed) if not, unless
        `allow_new` (resume_on_new_data=true): then the new data's epochs begin at the
        checkpoint's step. A checkpoint that records no data (an older version) is taken as is."""
        marker = read_marker(path)
        saved = marker.get("data")
        if saved is None or self.data is None:
            return int(marker.get("data_start_step", 0))
        change = describe_data_change(saved, self.data)
        if change is None:
            return int(marker.get("data_start_step", 0))
        if not allow_new:
            raise CheckpointError(
                f"cannot resume from {path}: it trained on other data ({change}); restore that data, or pass "
                f"resume_on_new_data=true to go on training on this data (its epochs counted from step {marker['step']})"
            )
        if warn:
            log.warning(
                "resume_on_new_data=true: step %d's model goes on training on other data (%s); epoch 0 of this data starts at step %d",
                marker["step"],
                change,
                marker["step"],
            )
        return int(marker["step"])

    # -- save ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: KeyedOptimizer,
        extra: dict[str, Any],
        rank_state: dict[str, Any] | None = None,
    ) -> Path:
        """Collective over all ranks. `rank_state`: small per-rank state (saved in rank<r>.pt)."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{final.name}.tmp"
        err: BaseException | None = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob("*.tmp"):  # a crashed save of this run (the run dir is locked)
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                err = e
        self._agree(err, tmp, final)
        try:
            self._write(step, tmp, model, optimizer, rank_state)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a full disk: OSError, or DCP's CheckpointException (a BaseException)
            err = e
        self._agree(err, tmp, final)
        hashes: dict[str, str] = {}
        try:
            hashes = hash_files(tmp, self.rank, self.world_size)
        except OSError as e:
            err = e
        self._agree(err, tmp, final)
        if self.rank == 0:
            try:
                self._commit(step, tmp, final, extra, hashes)
            except OSError as e:
                err = e
        self._agree(err, tmp, final)
        return final

    def _agree(self, err: BaseException | None, tmp: Path, final: Path) -> None:
        """Collective: if any rank failed, rank 0 removes the `.tmp` and every rank raises one line."""
        flag = torch.tensor([1 if err is not None else 0], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        reason = disk_reason(err, tmp) if err is not None else "another rank failed to write its part"
        dist.barrier()  # every rank has looked at the disk before rank 0 frees it
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        kept = self.latest()
        raise CheckpointError(
            f"checkpoint {final} not written: {reason}; " + (f"the last complete one is {kept}" if kept else "no earlier checkpoint")
        )

    def _write(self, step: int, tmp: Path, model: nn.Module, optimizer: KeyedOptimizer, rank_state: dict[str, Any] | None) -> None:
        # One file per tensor: FBGEMM keeps all tables of a kernel in one flat buffer, so DCP
        # clones each table view before writing it and, with one file per rank, keeps every
        # clone alive until the file is closed, doubling memory at raw-Criteo table sizes.
        import torch.distributed.checkpoint as dcp  # here: the launcher imports this module for its errors

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

    def _commit(self, step: int, tmp: Path, final: Path, extra: dict[str, Any], hashes: dict[str, str]) -> None:
        """Rank 0, after every rank wrote its part: marker, fsync, rename (`commit_dir`), prune."""
        g = self.groups
        marker = {
            "step": step,
            "world_size": self.world_size,
            "extra": extra,
            "shape": self.shape,
            "lineage": self.lineage,
            "sha256": hashes,
        }
        if self.data is not None:
            marker.update(data=self.data, data_start_step=self.data_start_step)
        if g is not None:
            marker.update(ranks_per_host=g.ranks_per_host, hosts=g.hosts, per_host_optim=self.per_host_optim)
        commit_dir(tmp, final, marker)
        self._prune(step)

    def _prune(self, step: int) -> None:
        """Keeps the `keep` newest checkpoints of this lineage up to `step` (the one just written
        among them); later steps (an abandoned branch after a fallback) and other runs' stay."""
        mine = []
        for p in self.committed():
            s = step_of(p)
            if s is None or s >= step:
                continue
            try:
                if read_marker(p).get("lineage") == self.lineage:
                    mine.append(p)
            except (OSError, ValueError):
                continue
        for old in mine[: max(len(mine) - (self.keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------
    def resume(self, path: Path, model: nn.Module, optimizer: KeyedOptimizer, dense_optimizer: KeyedOptimizer) -> dict[str, Any]:
        """`load`, for a run that continues from `path`: any failure behind complete-looking files
        (corrupt bytes; DCP raises it on every rank) becomes one CheckpointError line, and the
        optimizer's step is set to the checkpoint's (FBGEMM's COWCLIP and counter modes keep their
        iteration outside the state dict). Returns what `load` returns."""
        try:
            extra = self.load(path, model, optimizer, dense_optimizer)
        except (CheckpointError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            why = describe_failure(e)
            raise CheckpointError(f"cannot load checkpoint {path}: {why}; move it aside to resume from an earlier one") from None
        optimizer.set_optimizer_step(int(extra["step"]))
        return extra

    def load(self, path: Path, model: nn.Module, optimizer: KeyedOptimizer, dense_optimizer: KeyedOptimizer) -> dict[str, Any]:
        """Restores model, optimizer and this rank's RNG in place; returns the marker's `extra`
        with `step` and `rank_state` (what `save` got as rank_state, {} if none)."""
        import torch.distributed.checkpoint as dcp

        marker = read_marker(path)
        shard_world = marker.get("ranks_per_host", marker["world_size"])
        if shard_world != self.shard_world and not reshardable(marker.get("shape", {})):
            what = f"{shard_world} ranks" + (" per host" if "ranks_per_host" in marker else "")
            mine = f"{self.shard_world} ranks" + (" per host" if self.groups is not None else "")
            raise CheckpointError(f"checkpoint {path} was written by {what}, this job has {mine}")
        self.lineage = marker.get("lineage") or self.lineage  # checkpoints from here on continue that run
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
        if not rank_file.is_file():  # more ranks than the checkpoint had: rank 0's RNG
            rank_file = path / "rank0.pt"
        saved = torch.load(rank_file, weights_only=True)
        torch.set_rng_state(saved["torch_rng"])
        return dict(
            marker["extra"],
            step=marker["step"],
            world_size=marker["world_size"],
            shard_world=shard_world,
            rank_state=saved.get("state", {}),
        )
