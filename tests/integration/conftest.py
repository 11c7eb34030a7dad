"""The integration tier's torchrun agents and training workers start from a zygote
(``tests/support/zygote.py``): the processes stay real, the imports each would spend ~4.5 CPU-s
on (a worker) are spent once per test process. A test whose subject is the process tree (killing
it, parent death) asks for ``real_worker_processes``. ``RECSYS_TEST_NO_ZYGOTE=1``: no zygote;
``RECSYS_TEST_ZYGOTE_KEEP=1``: its directory (with a log of what it served and refused) stays."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support import zygote


@pytest.fixture(scope="session", autouse=True)
def worker_zygote():
    if os.environ.get("RECSYS_TEST_NO_ZYGOTE"):  # every worker starts as torchrun starts it
        yield None
        return
    procs, where, extra = zygote.start(dict(os.environ))
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in extra.items():
                mp.setenv(k, v)
            yield where
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        if not os.environ.get("RECSYS_TEST_ZYGOTE_KEEP"):  # its log says which tests' workers it served
            shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def real_worker_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents and workers this test launches start as usual (children of their launcher,
    importing everything themselves)."""
    monkeypatch.delenv(zygote.ENV_SOCKET, raising=False)
