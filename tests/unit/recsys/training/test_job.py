"""A job's set-up steps that decide something: rank 0's work handed to every rank (expected
failures raised everywhere as one line), the checkpoint cadence rounded to merge steps, the run
directory's files written or refused in one line, and the sharding types of a host's group.
The whole `setup` (DMP, planner, process groups) runs in the integration tests."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from recsys.config import ExperimentConfig, ShardingConfig
from recsys.training.checkpoint import Checkpointer, CheckpointError
from recsys.training.distributed import DistEnv
from recsys.training.job import _cache_stats, _checkpoint_at_merges, _on_rank0, _save_plan_files, _write_or_fail, host_local_sharding
from recsys.training.run_dir import RunDirError, RunFinished

ONE = DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo")


def test_rank0_work_returns_its_value():
    assert _on_rank0(ONE, lambda: {"resume": 20}) == {"resume": 20}


@pytest.mark.parametrize("error", [RunDirError("in use"), RunFinished("done"), CheckpointError("corrupt")])
def test_expected_failures_are_raised_as_they_are(error):
    def fail() -> None:
        raise error

    with pytest.raises(type(error), match=f"^{error}$") as e:
        _on_rank0(ONE, fail)
    assert e.value is error


@pytest.mark.parametrize("error", [FileNotFoundError("no file data/x.tsv"), ValueError("batch 0 is not positive")])
def test_data_and_config_errors_become_one_line_run_dir_errors(error):
    def fail() -> None:
        raise error

    with pytest.raises(RunDirError, match=rf"^{error}$"):
        _on_rank0(ONE, fail)


def test_other_failures_are_not_turned_into_expected_ones():
    def fail() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError, match="bug"):
        _on_rank0(ONE, fail)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "recsys.train"]


def test_the_cadence_is_rounded_up_to_merge_steps_and_the_log_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="recsys.train")
    ckpt = Checkpointer(tmp_path, 0, 1, every_steps=30)
    _checkpoint_at_merges(ckpt, every_k=16, total=100, is_main=True)
    assert ckpt.every_steps == 32
    ckpt = Checkpointer(tmp_path, 0, 1, every_steps=30)
    _checkpoint_at_merges(ckpt, every_k=16, total=20, is_main=True)
    assert _messages(caplog) == [
        "checkpoint.every_steps=30 rounded up to 32: checkpoints are taken at merge steps only (train.merge_every=16)",
        "checkpoint.every_steps=30 rounded up to 32: checkpoints are taken at merge steps only (train.merge_every=16); "
        "none before the final one at step 20",
    ]


def test_a_cadence_already_on_merge_steps_is_not_mentioned(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="recsys.train")
    for every in (32, 0):
        ckpt = Checkpointer(tmp_path, 0, 1, every_steps=every)
        _checkpoint_at_merges(ckpt, every_k=16, total=100, is_main=True)
        assert ckpt.every_steps == every
    ckpt = Checkpointer(tmp_path, 0, 1, every_steps=30)
    _checkpoint_at_merges(ckpt, every_k=16, total=100, is_main=False)  # other ranks round silently
    assert ckpt.every_steps == 32 and _messages(caplog) == []


def test_write_or_fail(tmp_path):
    _write_or_fail(tmp_path / "config.yaml", "name: x\n")
    assert (tmp_path / "config.yaml").read_text() == "name: x\n"
    with pytest.raises(RunDirError, match=rf"^cannot write {tmp_path / 'gone' / 'config.yaml'}: No such file or directory$"):
        _write_or_fail(tmp_path / "gone" / "config.yaml", "")


def test_plan_files_are_written_or_refused_without_temp_files(tmp_path):
    _save_plan_files(tmp_path, {"version": 1, "plan": {}}, "table | rank")
    assert json.loads((tmp_path / "plan.json").read_text()) == {"version": 1, "plan": {}}
    assert (tmp_path / "plan.txt").read_text() == "table | rank\n"
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.txt").mkdir()  # plan.json goes in, plan.txt cannot be written
    with pytest.raises(RunDirError, match=rf"^cannot write the plan files in {run}: Is a directory$"):
        _save_plan_files(run, {"version": 1}, "t")
    assert sorted(p.name for p in run.iterdir()) == ["plan.json", "plan.txt"]
    assert not list(run.glob(".plan.json.tmp*"))


def test_a_hosts_group_never_shards_table_row_wise():
    cfg = ShardingConfig(sharding_types=["table_wise", "table_row_wise", "row_wise"])
    assert host_local_sharding(cfg).sharding_types == ["table_wise", "row_wise"]
    assert cfg.sharding_types == ["table_wise", "table_row_wise", "row_wise"]  # a copy
    assert host_local_sharding(ShardingConfig()).sharding_types == ["table_wise", "row_wise", "column_wise", "table_column_wise"]


def test_no_cache_statistics_without_a_data_sample():
    assert _cache_stats(ExperimentConfig(), torch.nn.Linear(1, 1)) is None
