"""A run directory belongs to one run at a time: its lock, the refusal (or move aside) of an
earlier run's checkpoints, a finished run, the state shape and length of a run, and the
preflight a resume makes before anything is written."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import recsys.training.run_dir as run_dir_mod
from recsys.config import ExperimentConfig
from recsys.data.source import DataSource
from recsys.data.synthetic import TRAIN, RowBlock
from recsys.training.checkpoint import CheckpointError
from recsys.training.run_dir import (
    LAUNCHER_ENV,
    ResumePoint,
    RunDirError,
    RunFinished,
    RunLock,
    _ancestors,
    check_fresh,
    committed_steps,
    finished_step,
    preflight,
    shard_world_size,
    state_shape,
    total_steps,
)


def exactly(text: str) -> str:
    """The whole of `text` as a `pytest.raises(match=)` pattern."""
    return f"^{re.escape(text)}$"


def test_the_lock_holds_its_pid_and_refuses_a_second_holder(tmp_path):
    run = tmp_path / "run"
    with RunLock(run) as lock:
        assert (run / ".lock").read_text() == f"{os.getpid()}\n" and lock.holder() == os.getpid()
        message = f"run_dir {run} is in use by another run (pid {os.getpid()}); wait for it to finish, stop it, or choose another run_dir"
        with pytest.raises(RunDirError, match=exactly(message)):
            RunLock(run).acquire()
    RunLock(run).acquire().release()  # released: free again


def test_a_lock_held_by_our_launcher_counts_as_ours(tmp_path, monkeypatch):
    run = tmp_path / "run"
    held = RunLock(run).acquire()
    try:
        monkeypatch.setattr(run_dir_mod, "_ancestors", lambda pid: {os.getpid()})  # as if the holder started us
        with pytest.raises(RunDirError, match=r"is in use by another run"):
            RunLock(run).acquire(allow_ancestor=True)  # not named in the environment
        monkeypatch.setenv(LAUNCHER_ENV, str(os.getpid()))
        RunLock(run).acquire(allow_ancestor=True)
        with pytest.raises(RunDirError, match=r"is in use by another run"):
            RunLock(run).acquire()  # only when asked
    finally:
        held.release()


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(RunDirError, match=rf"^run_dir {tmp_path / 'run'} exists and is not a directory$"):
        RunLock(tmp_path / "run").acquire()


def test_ancestors_start_at_the_parent():
    ours = _ancestors(os.getpid())
    assert os.getppid() in ours and os.getpid() not in ours


def _commit(root: Path, step: int) -> Path:
    d = root / f"step_{step:09d}"
    d.mkdir(parents=True)
    (d / "COMMITTED").write_text(json.dumps({"step": step, "world_size": 1, "extra": {}}))
    return d


def test_committed_steps(tmp_path):
    assert committed_steps(tmp_path / "absent") == []
    _commit(tmp_path, 40)
    _commit(tmp_path, 8)
    (tmp_path / "step_000000050.tmp").mkdir()
    assert committed_steps(tmp_path) == [8, 40]


def test_a_fresh_run_refuses_an_earlier_runs_checkpoints_or_moves_them_aside(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert check_fresh(run, resume=False, overwrite=False) is None
    _commit(run / "checkpoints", 20)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / ".lock").write_text("1\n")
    assert check_fresh(run, resume=True, overwrite=False) is None
    message = (
        f"run_dir {run} holds checkpoints of an earlier run (newest step 20); pass resume=true "
        "to continue it, overwrite=true to move it aside, or choose another run_dir"
    )
    with pytest.raises(RunDirError, match=exactly(message)):
        check_fresh(run, resume=False, overwrite=False)
    monkeypatch.setattr(run_dir_mod.time, "strftime", lambda fmt: "20250102-030405")
    aside = check_fresh(run, resume=False, overwrite=True)
    assert aside == tmp_path / "run.old-20250102-030405"
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "metrics.jsonl"]
    _commit(run / "checkpoints", 10)
    assert check_fresh(run, resume=False, overwrite=True) == tmp_path / "run.old-20250102-030405-2"


def test_finished_step_needs_the_summary_and_the_last_checkpoint(tmp_path):
    assert finished_step(tmp_path, 30) is None
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 30}))
    assert finished_step(tmp_path, 30) is None  # no checkpoint of step 30
    _commit(tmp_path / "checkpoints", 30)
    assert finished_step(tmp_path, 30) == 30
    assert finished_step(tmp_path, 40) is None  # a longer run now


class _Train(DataSource):
    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.dense_names, self.sparse_names, self.cardinalities = ["I1"], ["C1", "C2"], [10, 20]

    def num_rows(self, split: int) -> int:
        return self.rows if split == TRAIN else 8

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        n = stop - start
        return RowBlock(np.zeros((n, 1), np.float32), np.zeros((n, 2), np.int64), np.zeros(n, np.float32))

    def identity(self) -> dict:
        return {"source": "test", "rows": self.rows}


def _cfg(tmp_path: Path, **train: object) -> ExperimentConfig:
    cfg = ExperimentConfig(run_dir=str(tmp_path / "run"))
    cfg.train.batch_size = 10
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_total_steps_from_max_steps_or_epochs(tmp_path):
    assert total_steps(_cfg(tmp_path, max_steps=7), _Train(1000)) == 7
    assert total_steps(_cfg(tmp_path, epochs=3), _Train(105)) == 30  # 10 full batches an epoch
    assert total_steps(_cfg(tmp_path, epochs=2), _Train(105), data_start_step=25) == 45
    with pytest.raises(RunDirError, match=r"^nothing to train: train.max_steps=0, train.epochs=0 and train.batch_size=10 give 0 steps$"):
        total_steps(_cfg(tmp_path, epochs=0), _Train(105))


def test_the_shard_world_is_one_hosts_ranks_with_merges(tmp_path):
    assert shard_world_size(_cfg(tmp_path, hosts=2), 8) == 8
    assert shard_world_size(_cfg(tmp_path, hosts=2, merge_every=4), 8) == 4


def test_state_shape(tmp_path):
    cfg = _cfg(tmp_path, merge_every=4)
    cfg.model.embedding_dim, cfg.model.dnn, cfg.model.table_rows_factor = 8, [64, 32], 2
    cfg.optim.embedding = "cowclip_adam"
    cfg.data.shuffle_seed, cfg.data.shuffle_block_rows, cfg.data.shuffle_buffer_rows = 5, 128, 0
    assert state_shape(cfg, ["C1", "C2"], [10, 20], 4) == {
        "model.name": "deepfm",
        "model.embedding_dim": 8,
        "model.dnn": [64, 32],
        "model.cross_layers": 3,
        "model.cross_low_rank": 0,
        "model.table_rows_factor": 2,
        "data.tables": {"C1": 10, "C2": 20},
        "optim.embedding": "cowclip_adam",
        "train.batch_size": 10,
        "train.world_size": 4,
        "train.merge_every": 4,
        "train.merge_moments": False,
        "data.order": "shuffle seed=5 block=128 buffer=0",
        "optim.embedding_l2_scope": "catchup",  # auto, resolved for CowClip-Adam
    }
    cfg.data.shuffle, cfg.optim.embedding, cfg.model.table_rows_factor = False, "rowwise_adagrad", 1
    shape = state_shape(cfg, ["C1", "C2"], [10, 20], 4)
    assert not {"data.order", "optim.embedding_l2_scope", "model.table_rows_factor"} & set(shape)


def _checkpoint(root: Path, step: int, shape: dict, data: dict) -> Path:
    """A checkpoint that passes the completeness check (DCP metadata and files, rank0.pt)."""
    d = root / f"step_{step:09d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.ones(2)}}, storage_writer=dcp.FileSystemWriter(str(d), single_file_per_rank=False))
    torch.save({"state": {}}, d / "rank0.pt")
    marker = {"step": step, "world_size": 1, "extra": {}, "shape": shape, "data": data, "data_start_step": 0}
    (d / "COMMITTED").write_text(json.dumps(marker))
    return d


def test_preflight_picks_the_newest_complete_checkpoint(tmp_path):
    cfg, source = _cfg(tmp_path, max_steps=40), _Train(1000)
    shape = {"train.batch_size": 10}
    assert preflight(cfg, source, shape, warn=False) is None  # a fresh run
    cfg.resume = True
    assert preflight(cfg, source, shape, warn=False) is None  # nothing to resume: from scratch
    root = cfg.resolved_run_dir() / "checkpoints"
    good = _checkpoint(root, 20, shape, source.identity())
    broken = _commit(root, 30)  # a marker and nothing else
    assert preflight(cfg, source, shape, warn=False) == ResumePoint(good, 0)
    with pytest.raises(CheckpointError, match=r"the config changed \(train.batch_size 10 -> 20\)"):
        preflight(cfg, source, {"train.batch_size": 20}, warn=False)
    with pytest.raises(CheckpointError, match=r"it trained on other data \(rows 1000 -> 2000\)"):
        preflight(cfg, _Train(2000), shape, warn=False)
    cfg.resume_on_new_data = True
    assert preflight(cfg, _Train(2000), shape, warn=False) == ResumePoint(good, 20)
    cfg.resume_on_new_data = False
    (good / "rank0.pt").unlink()
    message = (
        f"resume=true, but none of the 2 checkpoints in {root} is complete (newest: {broken / '.metadata'} is missing or "
        "unreadable); to start from scratch, pass overwrite=true instead of resume=true (the old run is moved aside)"
    )
    with pytest.raises(CheckpointError, match=exactly(message)):
        preflight(cfg, source, shape, warn=False)


def test_preflight_stops_a_resume_past_the_last_step_or_of_a_finished_run(tmp_path):
    cfg, source = _cfg(tmp_path, max_steps=20), _Train(1000)
    cfg.resume = True
    root = cfg.resolved_run_dir() / "checkpoints"
    _checkpoint(root, 30, {}, source.identity())
    message = (
        f"cannot resume from {root / 'step_000000030'}: the run is already at step 30, past train.max_steps=20; nothing written "
        "(raise it above 30 to train on, or start a new run: another run_dir, or overwrite=true)"
    )
    with pytest.raises(RunDirError, match=exactly(message)):
        preflight(cfg, source, {}, warn=False)
    cfg.train.max_steps = 30
    assert preflight(cfg, source, {}, warn=False) == ResumePoint(root / "step_000000030", 0)  # not finished: no summary
    (cfg.resolved_run_dir() / "summary.json").write_text(json.dumps({"steps": 30}))
    message = (
        f"the run in {cfg.resolved_run_dir()} already finished at step 30 (step_000000030, summary.json); nothing to do "
        "(raise train.max_steps or train.epochs to train on)"
    )
    with pytest.raises(RunFinished, match=exactly(message)):
        preflight(cfg, source, {}, warn=False)
