"""Preprocessing fanned out over tasks and joined without copying (recsys/data/preprocess/fanout.py): the
joined dataset equals a single-process preprocessing of the same files (rows, order, bad-row
reports, cache key), training finds it up to date, re-runs reuse parts, a changed file rebuilds
its part, and the CLI and the TorchX component (local_cwd) run it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recsys.config import load_config
from recsys.data.preprocess.fanout import task_files
from recsys.data.shard_reader import ShardedDataset
from recsys.data.source import build_source, prepare_data, preprocess_task

REPO = Path(__file__).resolve().parents[3]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _criteo_lines(rng: np.random.Generator, n: int) -> list[str]:
    out = []
    for _ in range(n):
        ints = ["" if rng.random() < 0.1 else str(int(rng.integers(0, 500))) for _ in range(13)]
        ids = ["" if rng.random() < 0.05 else f"{int(rng.integers(0, 1 << 32)):08x}" for _ in range(26)]
        out.append("\t".join([str(int(rng.random() < 0.25)), *ints, *ids]) + "\n")
    return out


@pytest.fixture
def raw_dir(tmp_path) -> Path:
    """Five Criteo TSV files of different sizes, one with a bad row (counted, not fatal)."""
    rng = np.random.default_rng(7)
    d = tmp_path / "raw"
    d.mkdir()
    for i, n in enumerate([700, 150, 400, 900, 260]):
        lines = _criteo_lines(rng, n)
        if i == 2:
            lines[17] = "x\tnot a row\n"
        (d / f"day_{i}.tsv").write_text("".join(lines))
    return d


def _cfg(raw: Path, cache: Path, *more: str):
    return load_config(SMOKE, ["data.source=criteo", f"data.path={raw}", f"data.cache_dir={cache}", "train.batch_size=128", *more])


def _rows(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ds = ShardedDataset.open(path)
    return ds.read(0, ds.num_rows)


def test_task_files_are_contiguous_byte_balanced_groups(tmp_path):
    paths = []
    for i, size in enumerate([100, 100, 100, 700, 50, 50]):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * size)
        paths.append(p)
    groups = [task_files(paths, t, 3) for t in range(3)]
    assert sum(groups, []) == paths  # every file once, in order
    assert groups == [paths[:3], paths[3:4], paths[4:]]  # 300 / 700 / 100 bytes: cut at the middles
    assert [task_files(paths[:2], t, 4) for t in range(4)] == [[], [paths[0]], [], [paths[1]]]  # 2 idle tasks
    with pytest.raises(ValueError, match="task 3 is not in 0..2"):
        task_files(paths, 3, 3)


def test_two_tasks_join_into_the_single_process_dataset(raw_dir, tmp_path, caplog):
    single, fan = tmp_path / "single", tmp_path / "fan"
    ref = prepare_data(_cfg(raw_dir, single))
    cfg = _cfg(raw_dir, fan)
    assert preprocess_task(cfg, 1, 2) is None  # the later task first: part 0 is still missing
    assert not (fan / "manifest.json").exists()
    joined = preprocess_task(cfg, 0, 2)  # the last one joins
    assert joined["num_rows"] == ref["num_rows"] == 2409  # 2410 rows, one bad
    assert joined["cache_key"] == ref["cache_key"]
    assert joined["sources"] == ref["sources"]  # per-file bad-row reports, in file order
    assert {s["dir"] for s in joined["shards"]} == {"parts/00000", "parts/00001"}
    for a, b in zip(_rows(fan), _rows(single)):
        np.testing.assert_array_equal(a, b)
    # no array copied: the join wrote only a manifest beside the parts
    assert sorted(p.name for p in fan.iterdir()) == [".join.lock", "manifest.json", "parts"]
    # training with the same config finds the joined cache up to date and reads it
    caplog.set_level(logging.INFO, logger="recsys.data.preprocess.raw_formats")
    again = prepare_data(cfg)
    assert again["created_by"].startswith("recsys.data.preprocess.fanout.join_parts") and "rebuilding" not in caplog.text
    src = build_source(cfg)
    assert src.num_rows(0) + src.num_rows(1) == 2409
    np.testing.assert_array_equal(src.read(0, 1000, 1100).sparse, _rows(single)[1][1000:1100])


def test_rerun_reuses_parts_and_a_changed_file_rebuilds_only_its_part(raw_dir, tmp_path):
    fan = tmp_path / "fan"
    cfg = _cfg(raw_dir, fan)
    for t in (0, 1, 2):
        preprocess_task(cfg, t, 3)
    parts = {p.parent.name: p.stat().st_mtime_ns for p in (fan / "parts").glob("*/manifest.json")}
    stamp = (fan / "manifest.json").stat().st_mtime_ns
    assert preprocess_task(cfg, 1, 3)["num_rows"] == 2409  # a requeued task: nothing to do
    assert (fan / "manifest.json").stat().st_mtime_ns == stamp
    # day_4 (the last task's file) gets more rows: only part 00002 is rebuilt, then a new join
    with open(raw_dir / "day_4.tsv", "a") as f:
        f.writelines(_criteo_lines(np.random.default_rng(1), 40))
    assert preprocess_task(cfg, 0, 3) is None and preprocess_task(cfg, 1, 3) is None  # part 2 is stale
    assert (fan / "manifest.json").stat().st_mtime_ns == stamp  # the old dataset stays until the join
    joined = preprocess_task(cfg, 2, 3)
    assert joined["num_rows"] == 2449
    now = {p.parent.name: p.stat().st_mtime_ns for p in (fan / "parts").glob("*/manifest.json")}
    assert [k for k in sorted(parts) if parts[k] != now[k]] == ["00002"]
    prepare_data(_cfg(raw_dir, tmp_path / "single"))
    for a, b in zip(_rows(fan), _rows(tmp_path / "single")):
        np.testing.assert_array_equal(a, b)


def test_fan_out_over_an_older_single_process_cache_removes_its_shards(raw_dir, tmp_path):
    fan = tmp_path / "fan"
    cfg = _cfg(raw_dir, fan)
    prepare_data(cfg)  # a single-process cache in the same place
    assert list(fan.glob("shard_*.npy"))
    (raw_dir / "day_1.tsv").unlink()  # the inputs change: the cache is stale
    for t in (0, 1):
        preprocess_task(cfg, t, 2)
    assert not list(fan.glob("shard_*.npy"))  # unlisted now, removed after the new manifest
    assert ShardedDataset.open(fan).num_rows == 2409 - 150


def test_cli_task_from_the_slurm_array_environment_and_one_line_errors(raw_dir, tmp_path):
    fan = tmp_path / "fan"
    args = [
        sys.executable,
        "-m",
        "recsys.cli",
        "preprocess",
        "--config",
        str(SMOKE),
        "data.source=criteo",
        f"data.path={raw_dir}",
        f"data.cache_dir={fan}",
        "train.batch_size=128",
    ]
    outs = []
    for task in ("1", "0"):
        env = dict(ENV, SLURM_ARRAY_TASK_ID=task, SLURM_ARRAY_TASK_COUNT="2")
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.strip())
    assert outs == [f"task 1 of 2: part written; the last task to finish joins {fan}", f"task 0 of 2: {fan} holds 2409 rows in 2 shards"]
    r = subprocess.run(args[:6] + ["--tasks", "2", "--task", "2"], capture_output=True, text=True, env=ENV, timeout=300)
    assert (r.returncode, r.stderr.strip()) == (2, "error: --task 2 of --tasks 2 (--procs 1): need 0 <= task < tasks and procs >= 1")
    # one task in 3 processes (3 parts), into another cache: the same rows
    three = [a.replace(str(fan), str(tmp_path / "three")) for a in args] + ["--tasks", "1", "--procs", "3"]
    r = subprocess.run(three, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"task 0 of 1 (parts 0-2 of 3): {tmp_path / 'three'} holds 2409 rows in 3 shards", (
        r.stderr[-2000:]
    )
    for a, b in zip(_rows(fan), _rows(tmp_path / "three")):
        np.testing.assert_array_equal(a, b)
    r = subprocess.run(args[:6], capture_output=True, text=True, env=ENV, timeout=300)
    assert (r.returncode, r.stderr.strip()) == (
        2,
        f"error: {SMOKE}: key 'data.source': generated data (synthetic) has nothing to preprocess",
    )


def test_torchx_component_on_local_cwd_gives_the_single_process_dataset(raw_dir, tmp_path):
    """`torchx run -s local_cwd recsys.preprocess --tasks 2 --procs_per_task 2`: two local tasks of
    two processes each, four parts, one join."""
    fan = tmp_path / "fan"
    torchx = Path(sys.executable).parent / "torchx"
    r = subprocess.run(
        [
            str(torchx),
            "run",
            "-s",
            "local_cwd",
            "--wait",
            "--log",
            f"{REPO}/torchx_components/launch.py:preprocess",
            "--config",
            str(SMOKE),
            "--tasks",
            "2",
            "--procs_per_task",
            "2",
            "data.source=criteo",
            f"data.path={raw_dir}",
            f"data.cache_dir={fan}",
            "train.batch_size=128",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    manifest = json.loads((fan / "manifest.json").read_text())
    assert manifest["created_by"] == "recsys.data.preprocess.fanout.join_parts (4 parts)"
    ref = prepare_data(_cfg(raw_dir, tmp_path / "single"))
    assert manifest["cache_key"] == ref["cache_key"]
    for a, b in zip(_rows(fan), _rows(tmp_path / "single")):
        np.testing.assert_array_equal(a, b)


def test_a_joined_manifest_may_only_point_into_its_parts(raw_dir, tmp_path):
    from recsys.data.shard_format import InvalidShardDirError

    fan = tmp_path / "fan"
    cfg = _cfg(raw_dir, fan)
    preprocess_task(cfg, 0, 2)
    preprocess_task(cfg, 1, 2)
    good = (fan / "manifest.json").read_text()
    for bad in ("../single", "/etc", "parts/00000/../../x"):
        m = json.loads(good)
        m["shards"][0]["dir"] = bad
        (fan / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(InvalidShardDirError, match="corrupt manifest \\(bad shard entry"):
            ShardedDataset.open(fan)
    m = json.loads(good)
    (fan / "parts" / "00001" / f"{m['shards'][-1]['name']}.labels.npy").unlink()
    (fan / "manifest.json").write_text(good)
    with pytest.raises(InvalidShardDirError, match=f"shard file parts/00001/{m['shards'][-1]['name']}.labels.npy is missing"):
        ShardedDataset.open(fan)
