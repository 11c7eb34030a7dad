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
into any run whose shard world matches (another host count, or a plain run of R ranks), and,
with a reshardable optimizer state, into another number of ranks per host.

Integrity (docs/run_integrity.md):
- COMMITTED also records `shape`, the config that shapes the saved state (model, tables,
  embedding optimizer, batch, shard world, merge settings; `run_dir.state_shape`); a resume
  whose config differs stops with one line naming the keys (`check_compatible`). The world size
  (for k-step runs: the ranks per host) may change with FBGEMM's fused optimizers and our Adam
  kernels (`reshardable`): DCP reshards on load.
- COMMITTED records `data`, the identity of the data trained on (recsys/data/identity.py), and
  `data_start_step`; a resume on other data stops with one line saying what changed
  (`check_data`), unless `resume_on_new_data=true`.
- COMMITTED records the SHA-256 of every file (`sha256`: relative path -> hex), hashed by all
  ranks in parallel after the write, before the commit.
- `latest_complete()` checks the newest checkpoint's files against its DCP metadata (every
  `.distcp` present and long enough, every `rank<r>.pt` present) and their bytes against the
  recorded hashes, and falls back to the previous complete one with a one-line warning naming
  the bad file.
- Pruning keeps the `keep` newest checkpoints of this run's lineage (`lineage` in COMMITTED,
  inherited on resume) by step, never the one just written and never another run's.
- A failed write (a full disk) removes the `.tmp` directory on every rank and raises
  `CheckpointError` (one line); the previous checkpoints are untouched.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # the launcher imports this module for its errors; it needs no torchrec
    from torchrec.optim.keyed import KeyedOptimizer

from recsys.data.cache_key import file_sha256
from recsys.data.identity import describe_data_change
from recsys.training.distributed import collective_device

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step_(\d{9})$")
MARKER = "COMMITTED"


class CheckpointError(RuntimeError):
    """An expected, user-facing checkpoint failure; the message is one line."""


def step_dir_name(step: int) -> str:
    """`step_000000120`; a negative or oversized step has no name (resume could never find it)."""
    if not 0 <= step < 10**9:
        raise ValueError(f"checkpoint step {step} is outside [0, 1e9)")
    return f"step_{step:09d}"


def step_of(path: Path) -> int | None:
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def read_marker(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / MARKER).read_text())


def incomplete_reason(path: Path, verify_bytes: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot load (naming the bad file), or None if it looks complete:
    a readable marker and DCP metadata, every storage file the metadata names present and long
    enough, one rank<r>.pt per writing rank, and (`verify_bytes`) every file's SHA-256 equal to
    the one COMMITTED recorded at save time (checkpoints written before hashes were recorded
    are checked for presence and length only)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        marker = read_marker(path)
    except (OSError, ValueError):
        return f"{path / MARKER} is unreadable"
    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception:  # a missing or truncated .metadata fails in open() or in unpickling
        return f"{path / '.metadata'} is missing or unreadable"
    needed: dict[str, int] = {}
    for info in meta.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size < size:
            return f"{f} is truncated ({f.stat().st_size} of {size} bytes)"
    for r in range(int(marker.get("world_size", 1))):
        f = path / f"rank{r}.pt"
        if not f.is_file() or f.stat().st_size == 0:
            return f"{f} is missing"
    if verify_bytes:
        for name, want in sorted((marker.get("sha256") or {}).items()):
            f = path / name
            try:
                got = file_sha256(f)
            except OSError as e:
                return f"{f} is unreadable ({e.strerror or e})"
            if got != want:
                return f"{f} is corrupt (its SHA-256 differs from the one recorded when it was written)"
    return None


def checkpoint_files(tmp: Path) -> list[str]:
    """Every file of a checkpoint being written (relative paths, sorted; COMMITTED excluded)."""
    return sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != MARKER)


# Optimizers whose state is per-row or per-element tensors laid out like the table's shards, which
# DCP reshards by offset, so a checkpoint loads on another world size (a hierarchical one on
# another number of ranks per host: its files, host 0's and each host<h>/, are DCP checkpoints of
# one host's ranks): FBGEMM's fused ones, and our CowClip-Adam / Adam (moments per element, the row
# step per row; in both update scopes). Tested 2 -> 1 -> 2 ranks, and 1 -> 2 -> 1 ranks per host
# of a k-step run, with exact metrics (docs/run_integrity.md).
RESHARDABLE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd", "cowclip_adam", "adam")


def reshardable(shape: dict[str, Any]) -> bool:
    return shape.get("optim.embedding") in RESHARDABLE_OPTIMIZERS


# State-shape keys added after checkpoints were first written, with the value those older
# checkpoints had: a checkpoint without the key resumes when the run has this value.
SHAPE_DEFAULTS = {"optim.embedding_l2_scope": "batch"}


def shape_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key old -> new` for every key whose value differs (a key absent on one side counts)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):  # e.g. data.tables: only the tables that differ
            out.extend(f"{key}.{c}" for c in shape_changes(old, new))
        else:
            out.append(f"{key} {_short(old)} -> {_short(new)}")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def describe_failure(e: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException is unwrapped to its first rank's error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, (list, tuple)) else first
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# Below min(this, 1/16 of the file system) free, a failed write is put down to a full disk
# (see `_disk_reason`).
FULL_DISK_BYTES = 1 << 20


def _disk_reason(e: BaseException, where: Path | None = None) -> str:
    """One line for a failed write: the first OSError found in the exception (DCP wraps them).

    torch.save (DCP's tensor writer) turns a failed write into `RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos`; whether the OSError survives as its `__context__` depends
    on which write hit the end of the disk, so when no OSError is found, the file system of `where`
    is asked directly: nearly nothing free (FULL_DISK_BYTES, or 1/16 of a smaller file system) means
    the full disk is the reason. Call it before the
    partial files are removed."""
    seen: list[BaseException] = [e]
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict):
        for v in failures.values():
            seen.extend(v if isinstance(v, (list, tuple)) else [v])
    for x in seen:  # (DCP's failures are (exception, stack) pairs)
        while isinstance(x, BaseException):
            if isinstance(x, OSError):
                where_ = f" ({x.filename})" if x.filename else ""
                return (os.strerror(x.errno) if x.errno else str(x)) + where_
            x = x.__cause__ or x.__context__
    if where is not None and _nearly_full(where):
        return os.strerror(errno.ENOSPC)
    return describe_failure(e)


def _nearly_full(path: Path) -> bool:
    """Whether the file system holding `path` (or its nearest existing parent) has (nearly) no room
    left for this process."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize < min(FULL_DISK_BYTES, st.f_blocks * st.f_frsize // 16)
    return False


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
        if not self.root.is_dir():
            return []
        out = [p for p in self.root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
        return sorted(out, key=lambda p: p.name)

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
        marker = read_marker(path)
        saved = marker.get("shape")
        if saved is None:  # written before shapes were recorded: the world size is all we know
            saved = {"train.world_size": marker.get("ranks_per_host", marker["world_size"])}
            current = {"train.world_size": self.shape.get("train.world_size", self.shard_world)}
        else:
            current = self.shape
            saved = {**{k: v for k, v in SHAPE_DEFAULTS.items() if k in current}, **saved}
            if reshardable(saved) and reshardable(current):  # another world size is fine
                saved = {k: v for k, v in saved.items() if k != "train.world_size"}
                current = {k: v for k, v in current.items() if k != "train.world_size"}
        changes = shape_changes(saved, current)
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
            hashes = self._hash_files(tmp)
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
        reason = _disk_reason(err, tmp) if err is not None else "another rank failed to write its part"
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

    def _hash_files(self, tmp: Path) -> dict[str, str]:
        """Collective: the SHA-256 of every file of the checkpoint, the files dealt round-robin over
        the ranks so each hashes its share (mostly still in its page cache); rank 0 gets them all."""
        files = checkpoint_files(tmp) if self.rank == 0 else []
        box = [files]
        dist.broadcast_object_list(box, src=0)
        failed: OSError | None = None
        try:
            mine = {name: file_sha256(tmp / name) for name in box[0][self.rank :: self.world_size]}
        except OSError as e:  # raised after the gather, so no rank waits for this one
            mine, failed = {}, e
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        if failed is not None:
            raise failed
        return {k: v for part in parts for k, v in part.items()}

    def _commit(self, step: int, tmp: Path, final: Path, extra: dict[str, Any], hashes: dict[str, str]) -> None:
        """Rank 0, after every rank wrote its part: marker, fsync, rename, prune."""
        g = self.groups
        for sub in tmp.glob("host*"):
            _fsync_tree(sub)
        _fsync_tree(tmp)
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
        with open(tmp / MARKER, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        old = self.root / f"{final.name}.old.tmp"
        if final.exists():  # a re-save of the same step (e.g. after resume): move it aside
            os.replace(final, old)  # deleted only once the new one is in place
        os.replace(tmp, final)
        _fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
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
