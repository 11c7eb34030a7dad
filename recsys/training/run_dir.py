"""A run directory belongs to one run at a time (docs/run_integrity.md).

- `RunLock`: an exclusive `fcntl.flock` on `<run_dir>/.lock`, held for the whole run, with the
  holder's pid written inside. `recsys train` takes it before launching torchrun; rank 0 of the
  workers takes it too (so plain `torchrun -m recsys.train` is covered), and accepts a lock held
  by the launcher that started it (its pid in $RECSYS_RUN_LOCK_PID and among the worker's
  ancestors). flock locks die with their holder, so a killed run never leaves a stale lock.
- `check_fresh`: a run without `resume` must not write into a directory holding checkpoints of
  an earlier run (its pruning and a later resume would mix the two); `overwrite=true` moves the
  old run aside to `<run_dir>.old-<timestamp>`; nothing is deleted.
- `finished_step`: the step of a run that already finished (its final checkpoint and
  summary.json are there), so a resume can say so and write nothing.

Every refusal is a `RunDirError` whose message is one line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("recsys.train")
LOCK_NAME = ".lock"
LAUNCHER_ENV = "RECSYS_RUN_LOCK_PID"  # set by `recsys train` for its workers: "I hold the lock for you"


class RunDirError(RuntimeError):
    """An expected, user-facing refusal; the message is one line."""


def _ancestors(pid: int) -> set[int]:
    """Parent pids of `pid` up to init, from /proc (Linux)."""
    out: set[int] = set()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid in out:
            break
        out.add(pid)
    return out


class RunLock:
    """Exclusive lock on a run directory for the lifetime of this object (or process)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def holder(self) -> int | None:
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def acquire(self, allow_ancestor: bool = False) -> "RunLock":
        """Takes the lock or raises RunDirError naming the holder's pid. `allow_ancestor`: a lock
        held by the `recsys train` launcher that started this process (an ancestor whose pid the
        launcher put in $RECSYS_RUN_LOCK_PID) counts as ours."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise RunDirError(f"run_dir {self.run_dir} exists and is not a directory") from None
        except OSError as e:  # a read-only file system, no permission
            raise RunDirError(f"cannot create run_dir {self.run_dir}: {e.strerror or e}; choose a writable run_dir") from None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(
                f"cannot write in run_dir {self.run_dir} ({self.path}: {e.strerror or e}); choose a writable run_dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            pid = self.holder()
            if allow_ancestor and pid is not None and os.environ.get(LAUNCHER_ENV) == str(pid) and pid in _ancestors(os.getpid()):
                return self  # our launcher holds it for us
            who = f"pid {pid}" if pid is not None else "another process"
            raise RunDirError(
                f"run_dir {self.run_dir} is in use by another run ({who}); wait for it to finish, stop it, or choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def committed_steps(ckpt_root: Path) -> list[int]:
    """Steps of the committed checkpoints under `ckpt_root` (complete or not), ascending."""
    from recsys.training.checkpoint.layout import MARKER, step_of

    if not ckpt_root.is_dir():
        return []
    steps = [step_of(p) for p in ckpt_root.iterdir() if (p / MARKER).is_file()]
    return sorted(s for s in steps if s is not None)


def check_fresh(run_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """For a run without `resume`: refuses a directory with checkpoints, or with `overwrite`
    moves its contents (all but the lock) to `<run_dir>.old-<timestamp>` and returns that path."""
    run_dir = Path(run_dir)
    if resume:
        return None
    steps = committed_steps(run_dir / "checkpoints")
    if not steps:
        return None
    if not overwrite:
        raise RunDirError(
            f"run_dir {run_dir} holds checkpoints of an earlier run (newest step {steps[-1]}); pass resume=true "
            "to continue it, overwrite=true to move it aside, or choose another run_dir"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    aside.mkdir()
    for entry in run_dir.iterdir():
        if entry.name != LOCK_NAME:
            os.rename(entry, aside / entry.name)
    return aside


def finished_step(run_dir: Path, total_steps: int) -> int | None:
    """`total_steps` if the run in `run_dir` already finished: summary.json records that many
    steps and the checkpoint of that step is committed; else None."""
    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if summary.get("steps") != total_steps or total_steps not in committed_steps(run_dir / "checkpoints"):
        return None
    return total_steps


class RunFinished(Exception):
    """Resume of a run that already finished: not an error; the message is one line."""


def state_shape(cfg, sparse_names: list[str], cardinalities: list[int], shard_world: int) -> dict:
    """The config that shapes a checkpoint's state, flat `section.key -> value`: a resume must
    match every entry (Checkpointer.check_compatible). The host count is not among them: a
    hierarchical checkpoint loads into any run with the same ranks per host (docs/kstep.md).
    A shuffled epoch order is recorded as `data.order` (absent for file order, as in checkpoints
    written before shuffling existed): resuming under another order would re-read rows. Our Adam
    kernels record their update scope (`optim.embedding_l2_scope`, `auto` resolved): `row_step`
    is a row's own update count when lazy and the global step it is current at with catch-up, so
    the state of one cannot continue as the other (absent in older checkpoints: they were lazy,
    `SHAPE_DEFAULTS`)."""
    from recsys.config import effective_l2_scope
    from recsys.data.order import order_label

    m, t, d = cfg.model, cfg.train, cfg.data
    order = {"data.order": order_label(d.shuffle_seed, d.shuffle_block_rows, d.shuffle_buffer_rows)} if d.shuffle else {}
    scope = {"optim.embedding_l2_scope": effective_l2_scope(cfg.optim)} if cfg.optim.embedding in ("cowclip_adam", "adam") else {}
    return {
        "model.name": m.name,
        "model.embedding_dim": m.embedding_dim,
        "model.dnn": list(m.dnn),
        "model.cross_layers": m.cross_layers,
        "model.cross_low_rank": m.cross_low_rank,
        **({"model.table_rows_factor": m.table_rows_factor} if m.table_rows_factor != 1 else {}),
        "data.tables": dict(zip(sparse_names, [int(c) for c in cardinalities])),
        "optim.embedding": cfg.optim.embedding,
        "train.batch_size": t.batch_size,
        "train.world_size": shard_world,
        "train.merge_every": t.merge_every,
        "train.merge_moments": t.merge_moments,
        **order,
        **scope,
    }


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume starts: the checkpoint, and the step at which the epochs of the data it
    continues on began (0, or the step a `resume_on_new_data` run switched data at)."""

    path: Path
    data_start_step: int = 0


def preflight(cfg, source, shape: dict, warn: bool = True) -> ResumePoint | None:
    """The run-directory checks, before anything is written (the launcher, then rank 0 of the
    workers): a fresh run refuses (or with `overwrite` moves aside) earlier checkpoints; a
    resume picks the newest complete checkpoint and stops with CheckpointError if the config
    changed or the data differs from the data it trained on (`source.identity()`; unless
    `resume_on_new_data`), with RunFinished if the run already finished, and with RunDirError if
    the checkpoint is past this run's last step (the run would otherwise log and save later
    weights under earlier step names). Returns where to resume (None: start from scratch).
    The caller holds the run lock."""
    from recsys.training.checkpoint import CheckpointError, Checkpointer
    from recsys.training.checkpoint.integrity import incomplete_reason
    from recsys.training.checkpoint.layout import step_of

    run_dir = cfg.resolved_run_dir()
    resume = bool(cfg.resume)  # RECSYS_RESUME=1 is resolved into it when the config loads
    aside = check_fresh(run_dir, resume, getattr(cfg, "overwrite", False))
    if aside is not None:  # (in the launcher, logging's last-resort handler prints it)
        log.warning("overwrite=true: moved the earlier run in %s to %s", run_dir, aside)
    if not resume:
        return None
    ckpt = Checkpointer(run_dir / "checkpoints", 0 if warn else -1, 1, shape=shape, data=source.identity())
    path = ckpt.latest_complete(verify_bytes=warn)  # the bytes once, on the workers' rank 0, not in the launcher too
    if path is None:
        broken = ckpt.committed()
        if broken:  # starting from scratch would overwrite and prune them
            raise CheckpointError(
                f"resume=true, but none of the {len(broken)} checkpoints in {ckpt.root} is complete (newest: "
                f"{incomplete_reason(broken[-1], verify_bytes=warn)}); to start from scratch, pass overwrite=true "
                "instead of resume=true (the old run is moved aside)"
            )
        return None
    ckpt.check_compatible(path)
    data_start = ckpt.check_data(path, bool(getattr(cfg, "resume_on_new_data", False)), warn)
    last = total_steps(cfg, source, data_start)
    saved_step = step_of(path)
    if saved_step is not None and saved_step > last:  # continuing would save a step-N name on later weights
        raise RunDirError(
            f"cannot resume from {path}: the run is already at step {saved_step}, past {_length_option(cfg, last)}; "
            f"nothing written (raise it above {saved_step} to train on, or start a new run: another run_dir, or overwrite=true)"
        )
    if saved_step == last and finished_step(run_dir, last) is not None:
        raise RunFinished(
            f"the run in {run_dir} already finished at step {last} ({path.name}, summary.json); nothing to do "
            "(raise train.max_steps or train.epochs to train on)"
        )
    return ResumePoint(path, data_start)


def _length_option(cfg, total: int) -> str:
    """The option that set the run's length, as the user gave it."""
    t = cfg.train
    return f"train.max_steps={t.max_steps}" if t.max_steps else f"train.epochs={t.epochs} (to step {total})"


def total_steps(cfg, source, data_start_step: int = 0) -> int:
    """The run's last step: train.max_steps, else epochs x steps per epoch (counted from the step
    its data began at: 0, or where a `resume_on_new_data` run switched data)."""
    from recsys.data.batching import steps_per_epoch
    from recsys.data.source import TRAIN

    t = cfg.train
    total = t.max_steps or data_start_step + t.epochs * steps_per_epoch(source, TRAIN, t.batch_size)
    if total < 1:  # config checks refuse these first; a step -5 would never be found by resume
        raise RunDirError(
            f"nothing to train: train.max_steps={t.max_steps}, train.epochs={t.epochs} "
            f"and train.batch_size={t.batch_size} give {total} steps"
        )
    return total


def shard_world_size(cfg, world_size: int) -> int:
    """Ranks the embeddings are sharded over: the world, or one host's ranks (merge_every > 0)."""
    from recsys.training.kstep.host_groups import resolve_hosts

    return world_size // resolve_hosts(cfg.train.hosts) if cfg.train.merge_every > 0 else world_size
