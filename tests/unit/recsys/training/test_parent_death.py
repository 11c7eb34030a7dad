"""The parent-death signal: asked of the kernel for this process (read back with
PR_GET_PDEATHSIG, then put back), an immediate exit when the expected parent is already gone,
and nothing off Linux."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Iterator

import pytest

import recsys.training.parent_death as parent_death
from recsys.training.parent_death import die_with_parent

PR_GET_PDEATHSIG = 2
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def _pdeathsig() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    out = ctypes.c_int(-1)
    assert libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(out), 0, 0, 0) == 0
    return out.value


@pytest.fixture
def restored_pdeathsig() -> Iterator[int]:
    before = _pdeathsig()
    try:
        yield before
    finally:
        ctypes.CDLL(None, use_errno=True).prctl(parent_death.PR_SET_PDEATHSIG, before, 0, 0, 0)


class _Exited(Exception):
    pass


def _exit(code: int) -> None:
    raise _Exited(code)


@linux_only
def test_the_signal_is_set_for_this_process(restored_pdeathsig, monkeypatch):
    monkeypatch.setattr(parent_death.os, "_exit", _exit)
    die_with_parent(signal.SIGUSR1, expected_parent=os.getppid())  # the parent is alive: no exit
    assert _pdeathsig() == signal.SIGUSR1
    die_with_parent()
    assert _pdeathsig() == signal.SIGTERM


@linux_only
def test_a_parent_already_gone_exits_now_with_128_plus_the_signal(restored_pdeathsig, monkeypatch):
    monkeypatch.setattr(parent_death.os, "_exit", _exit)
    with pytest.raises(_Exited, match=r"^143$"):
        die_with_parent(signal.SIGTERM, expected_parent=os.getppid() + 100_000)
    with pytest.raises(_Exited, match=r"^137$"):
        die_with_parent(signal.SIGKILL, expected_parent=os.getppid() + 100_000)


@linux_only
def test_off_linux_nothing_is_asked(restored_pdeathsig, monkeypatch):
    monkeypatch.setattr(parent_death.sys, "platform", "darwin")
    monkeypatch.setattr(parent_death.os, "_exit", _exit)
    die_with_parent(signal.SIGUSR2, expected_parent=os.getppid() + 100_000)  # not even the exit
    assert _pdeathsig() == restored_pdeathsig
