"""The worker entry point (recsys/train.py) in this process, with the training itself replaced: how
each way a run ends becomes an exit code and at most one line, printed by rank 0 only. (Real
workers under torchrun: tests/integration/training/.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import recsys.train as worker
from recsys.training.checkpoint import CheckpointError
from recsys.training.comm_failure import HostLostError
from recsys.training.finite import NonFiniteError
from recsys.training.run_dir import RunDirError, RunFinished

REPO = Path(__file__).resolve().parents[3]
SMOKE = str(REPO / "configs" / "experiments" / "smoke.yaml")
LOGGERS = ("recsys", "torchrec.distributed.utils", "torch.fx._symbolic_trace")


class _Exited(Exception):
    """os._exit(code), which a worker calls where its peers may hang in a collective."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.fixture
def ended(monkeypatch):
    """The worker without its side effects on this process: no parent-death signal, os._exit
    raises, the loggers' levels are put back; records what was called."""
    calls: dict[str, list] = {"die_with_parent": [], "shutdown": []}
    monkeypatch.setattr(worker, "die_with_parent", lambda *a: calls["die_with_parent"].append(a))
    monkeypatch.setattr(worker, "shutdown", lambda: calls["shutdown"].append(()))

    def exit_now(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    for var in ("RANK", "RECSYS_RUN_LOCK_PID", "RECSYS_LAUNCHER_GRACE_S"):
        monkeypatch.delenv(var, raising=False)
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    yield calls
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _run_with(monkeypatch, outcome: BaseException | None):
    """Replaces the training run: it raises ``outcome`` (or returns)."""
    seen = []

    def run(cfg):
        seen.append(cfg)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr("recsys.training.trainer.run", run)
    return seen


def test_a_finished_run_exits_0_with_the_config_it_was_given(ended, monkeypatch, tmp_path, capsys):
    seen = _run_with(monkeypatch, None)
    assert worker.main(["--config", SMOKE, f"run_dir={tmp_path}", "train.batch_size=1024"]) == 0
    assert seen[0].train.batch_size == 1024 and seen[0].run_dir == str(tmp_path)
    assert ended["die_with_parent"] == [()] and ended["shutdown"] == [()]
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("rank, line", [("0", True), ("1", False)])
def test_a_bad_config_is_one_line_from_rank_0(ended, monkeypatch, capsys, rank, line):
    monkeypatch.setenv("RANK", rank)
    seen = _run_with(monkeypatch, None)
    assert worker.main(["--config", SMOKE, "model.name=fm"]) == 2
    message = "error: override 'model.name=fm': key 'model.name': expected one of deepfm, wide_deep, dcn, dcnv2, got 'fm'\n"
    assert capsys.readouterr().err == (message if line else "")
    assert seen == []


@pytest.mark.parametrize("rank, level", [("0", logging.INFO), ("3", logging.WARNING)])
def test_progress_lines_come_from_rank_0_only(ended, monkeypatch, tmp_path, rank, level):
    monkeypatch.setenv("RANK", rank)
    _run_with(monkeypatch, None)
    assert worker.main(["--config", SMOKE, f"run_dir={tmp_path}"]) == 0
    assert logging.getLogger("recsys").level == level
    assert logging.getLogger("torchrec.distributed.utils").level == logging.ERROR


def test_resume_of_a_finished_run_exits_0_with_its_line(ended, monkeypatch, tmp_path, capsys):
    _run_with(monkeypatch, RunFinished("run already finished at step 40; nothing to do"))
    assert worker.main(["--config", SMOKE, f"run_dir={tmp_path}"]) == 0
    assert capsys.readouterr().err == "run already finished at step 40; nothing to do\n"


@pytest.mark.parametrize(
    "error",
    [RunDirError("run_dir r is in use"), CheckpointError("disk full"), NonFiniteError("loss is nan at step 3"), FileExistsError("x")],
)
@pytest.mark.parametrize("rank", ["0", "1"])
def test_expected_failures_exit_2_at_once_with_one_line_from_rank_0(ended, monkeypatch, tmp_path, capsys, error, rank):
    monkeypatch.setenv("RANK", rank)
    _run_with(monkeypatch, error)
    with pytest.raises(_Exited, match="^2$"):
        worker.main(["--config", SMOKE, f"run_dir={tmp_path}"])
    assert capsys.readouterr().err == (f"error: {error}\n" if rank == "0" else "")


@pytest.mark.parametrize("first", [True, False])
def test_a_lost_host_is_said_once_per_host_and_the_launcher_is_ended(ended, monkeypatch, tmp_path, capsys, first):
    import recsys.training.comm_failure as comm_failure

    graces = []
    monkeypatch.setattr(comm_failure, "first_to_report", lambda: first)
    monkeypatch.setattr(comm_failure, "end_stuck_launcher", lambda grace: graces.append(grace))
    monkeypatch.setenv("RANK", "5")  # any rank: the first of its host to ask prints
    monkeypatch.setenv("RECSYS_LAUNCHER_GRACE_S", "2.5")
    _run_with(monkeypatch, HostLostError("host 1 (ranks 2-3) is gone"))
    with pytest.raises(_Exited, match="^2$"):
        worker.main(["--config", SMOKE, f"run_dir={tmp_path}"])
    assert capsys.readouterr().err == ("error: host 1 (ranks 2-3) is gone\n" if first else "")
    assert graces == [2.5]


@pytest.mark.parametrize("under_launcher", [False, True])
def test_ctrl_c_exits_130_and_rank_0_says_so_unless_the_launcher_does(ended, monkeypatch, tmp_path, capsys, under_launcher):
    if under_launcher:
        monkeypatch.setenv("RECSYS_RUN_LOCK_PID", "12345")
    _run_with(monkeypatch, KeyboardInterrupt())
    with pytest.raises(_Exited, match="^130$"):
        worker.main(["--config", SMOKE, f"run_dir={tmp_path}"])
    said = "interrupted: the last complete checkpoint is kept (resume=true continues from it)\n"
    assert capsys.readouterr().err == ("" if under_launcher else said)


def test_exit_now_flushes_the_logs_and_both_streams_before_leaving(ended, monkeypatch):
    order = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def flush(self) -> None:
            order.append(self.name)

    monkeypatch.setattr(worker.sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(worker.sys, "stderr", Stream("stderr"))
    monkeypatch.setattr(worker.logging, "shutdown", lambda: order.append("logging"))
    monkeypatch.setattr(os, "_exit", lambda code: order.append(f"exit {code}"))
    worker._exit_now(3)
    assert order == ["logging", "stdout", "stderr", "exit 3"]


def test_config_is_required(capsys):
    with pytest.raises(SystemExit, match="^2$"):
        worker.main(["train.batch_size=8"])
    assert capsys.readouterr().err.splitlines()[-1] == "python -m recsys.train: error: the following arguments are required: --config"
