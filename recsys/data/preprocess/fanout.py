"""Preprocessing fanned out over tasks (a Slurm array through TorchX, or local processes), then
joined into one dataset without copying a byte of the arrays.

Task ``i`` of ``n`` takes a contiguous group of the input files (in the order training reads
them, balanced by bytes) and preprocesses it into its own complete shard directory,
``<cache>/parts/NNNNN``, with the same parser, options and atomic writes as a single process.
Whichever task finishes last (a file lock decides) writes ``<cache>/manifest.json``: the parts'
shards listed in file order where they lie (``"dir": "parts/NNNNN"``), their bad-row reports
concatenated, and the cache key of the *whole* input list, i.e. exactly the key a single-process
preprocessing of the same files writes. So training with the same config finds an up-to-date
cache and reads the same rows in the same order as from a single-process cache.

Re-running a task (a requeue, a retry) is cheap: its part is content-keyed like any cache and is
reused when its files are unchanged. The joined manifest is written atomically, last; a reader
sees either no dataset or a complete one.
"""

from __future__ import annotations

import fcntl
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

from recsys.data.durable_writes import replace_manifest
from recsys.data.shard_format import InvalidShardDirError
from recsys.data.shard_reader import ShardedDataset

__all__ = ["task_files", "part_dir", "run_task", "join_parts", "JOINED_BY"]

logger = logging.getLogger(__name__)

JOINED_BY = "recsys.data.preprocess.fanout.join_parts"
PARTS = "parts"


def task_files(paths: Sequence[Path], task: int, tasks: int) -> list[Path]:
    """Task ``task``'s contiguous group of ``paths`` (order kept): the list is cut where the
    running byte total crosses ``k * total / tasks``, so groups carry similar bytes. With more
    tasks than files some groups are empty."""
    if not 0 <= task < tasks:
        raise ValueError(f"task {task} is not in 0..{tasks - 1}")
    sizes = [max(1, Path(p).stat().st_size) for p in paths]
    total, seen, groups = sum(sizes), 0, [[] for _ in range(tasks)]
    for p, size in zip(paths, sizes):
        # the group of a file is decided by where its middle byte falls
        g = min(tasks - 1, (2 * seen + size) * tasks // (2 * total))
        groups[g].append(Path(p))
        seen += size
    return groups[task]


def part_dir(out_dir: Path, task: int) -> Path:
    return Path(out_dir) / PARTS / f"{task:05d}"


def run_task(
    paths: Sequence[Path],
    out_dir: Path,
    task: int,
    tasks: int,
    preprocess_files: Callable[[list[Path], Path], dict[str, Any]],
    key_of: Callable[[list[Path]], dict[str, Any]],
) -> dict[str, Any] | None:
    """Task ``task`` of ``tasks``: preprocess its files with ``preprocess_files(files, part)`` (a
    single-process preprocessing call, which reuses an up-to-date part), then join if every part
    is there and up to date. ``key_of(files)`` is the cache key that call writes for ``files``.
    Returns the joined manifest, or None while parts are missing."""
    out_dir = Path(out_dir)
    key = key_of(list(paths))  # hashes every file's head and tail: once per task
    done = _complete_with_key(out_dir, key)
    if done is not None:
        logger.info("%s: shard cache is up to date (%d rows); task %d has nothing to do", out_dir, done["num_rows"], task)
        return done
    files = task_files(paths, task, tasks)
    if files:
        part_dir(out_dir, task).parent.mkdir(parents=True, exist_ok=True)
        preprocess_files(files, part_dir(out_dir, task))
    return join_parts(out_dir, paths, tasks, key_of, key)


def _complete_with_key(out_dir: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        manifest = ShardedDataset.open(out_dir).manifest
    except InvalidShardDirError:
        return None
    return manifest if manifest.get("cache_key") == key else None


def join_parts(
    out_dir: Path, paths: Sequence[Path], tasks: int, key_of: Callable[[list[Path]], dict[str, Any]], key: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Write ``out_dir``'s manifest over the parts of ``tasks`` tasks once each of them is
    complete and built from its files as they are now (None before that). Under a lock, so
    concurrent finishers join once; shard files and parts that the new manifest does not list (an
    older cache in the same place) are removed after the manifest is in place. ``key``: the whole
    input's key when the caller has it already (``key_of(paths)``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = key_of(list(paths)) if key is None else key
    with open(out_dir / ".join.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = _complete_with_key(out_dir, key)
        if done is not None:
            return done
        parts = []
        for t in range(tasks):
            files = task_files(paths, t, tasks)
            if not files:
                continue
            part = _complete_with_key(part_dir(out_dir, t), key_of(files))
            if part is None:
                logger.info("%s: part %d of %d is not written (or stale) yet; the last task to finish joins", out_dir, t, tasks)
                return None
            parts.append((t, part))
        first = parts[0][1]
        shards, sources = [], []
        for t, m in parts:
            if (m["kind"], m["dense_names"], m["sparse_names"]) != (first["kind"], first["dense_names"], first["sparse_names"]):
                raise ValueError(f"{part_dir(out_dir, t)}: its columns differ from {part_dir(out_dir, parts[0][0])}'s")
            where = part_dir(out_dir, t).relative_to(out_dir).as_posix()
            shards += [{**s, "dir": where} for s in m["shards"]]
            sources += m.get("sources", [])
        manifest = {k: v for k, v in first.items() if k not in ("shards", "sources", "num_rows", "cache_key", "created_by")}
        manifest.update(
            num_rows=sum(s["num_rows"] for s in shards),
            shards=shards,
            sources=sources,
            created_by=f"{JOINED_BY} ({len(parts)} parts)",
            cache_key=key,
        )
        replace_manifest(out_dir, manifest)
        _remove_unlisted(out_dir, {part_dir(out_dir, t).name for t, _ in parts})
        ShardedDataset.open(out_dir)  # every listed file is there, with its dtype and shape
        logger.info("%s: joined %d parts, %d rows (no arrays copied)", out_dir, len(parts), manifest["num_rows"])
        return manifest


def _remove_unlisted(out_dir: Path, kept_parts: set[str]) -> None:
    """Shard files of an older single-process cache and parts of an older fan-out, now unlisted."""
    for p in out_dir.glob("shard_*.npy"):
        if re.match(r"^shard_\d{5,}\.(dense|sparse|labels)\.npy$", p.name):
            p.unlink()
    for p in (out_dir / PARTS).iterdir():
        if p.is_dir() and re.match(r"^\d{5,}$", p.name) and p.name not in kept_parts:
            shutil.rmtree(p)
