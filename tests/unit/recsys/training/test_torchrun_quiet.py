"""torchrun as `recsys train` runs it: the exit code and the one stderr line for each way the
workers end (torchrun's own run replaced by a stand-in that ends that way; nothing starts)."""

from __future__ import annotations

import logging
import signal

import pytest
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import recsys.training.torchrun_quiet as quiet

ARGV = ["--nproc_per_node", "2", "train.py"]


def _ends(monkeypatch, error: BaseException | None) -> list:
    seen = []

    def run(args) -> None:
        seen.append(args)
        if error is not None:
            raise error

    monkeypatch.setattr(quiet.torchrun, "run", run)
    return seen


def _failed(rank: int, exitcode: int) -> ChildFailedError:
    return ChildFailedError("train.py", {rank: ProcessFailure(local_rank=rank, pid=4242, exitcode=exitcode, error_file="<N/A>")})


def test_a_clean_run_exits_0_with_torchruns_arguments(monkeypatch, capsys):
    seen = _ends(monkeypatch, None)
    assert quiet.main(ARGV) == 0
    assert seen[0].nproc_per_node == "2" and seen[0].training_script == "train.py"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("code", quiet.EXPECTED)
def test_a_worker_that_explained_itself_passes_its_code_on_silently(monkeypatch, capsys, code):
    _ends(monkeypatch, _failed(1, code))
    assert quiet.main(ARGV) == code
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("code, what", [(1, "exit code 1"), (-9, "signal 9")])
def test_any_other_failure_gets_one_line_naming_rank_and_code(monkeypatch, capsys, code, what):
    _ends(monkeypatch, _failed(3, code))
    assert quiet.main(ARGV) == 1
    assert capsys.readouterr().err == f"error: worker rank 3 failed with {what} (its output is above)\n"


def test_a_stop_by_signal_exits_128_plus_the_signal(monkeypatch, capsys):
    _ends(monkeypatch, SignalException("stopped", signal.SIGTERM))
    assert quiet.main(ARGV) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ""


def test_torchruns_loggers_are_quieted(monkeypatch):
    name = "torch.distributed.elastic.agent.server.api"
    logger = logging.getLogger(name)
    monkeypatch.setattr(logger, "level", logging.INFO)
    _ends(monkeypatch, None)
    quiet.main(ARGV)
    assert logger.level == logging.CRITICAL
