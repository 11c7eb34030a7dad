"""Session-wide test set-up: the tiers, and triton in interpreter mode.

The tier of a test is the directory it lives in, and nothing else (a marker typed by hand drifts):

- ``unit/``: one process, no subprocess, no second rank; a unit test that starts a process fails;
- ``integration/``: processes, torchrun and gloo ranks, the CLIs, the wheel; `make test` runs
  these with the unit tier, in parallel (pytest-xdist, one worker per file);
- ``system/``: what needs root, network namespaces, Slurm, Chromium or wall-clock timeouts
  between hosts; `make test-system` runs them one at a time;
- ``gpu/``: a CUDA device (`make test-gpu`); skipped with one reason line elsewhere.

``support/`` holds the helpers those tests share (workers, model factories), not tests.

triton chooses between compiled and interpreted mode once, when it is first imported, and
torchrec/fbgemm import it as a side effect wherever it is installed. On a machine without a CUDA
device the Triton CowClip kernel can only run under the interpreter (TRITON_INTERPRET=1), so
triton is imported here in interpreter mode before any test module imports torchrec; the
environment is put back so subprocesses (torchrun workers) do not inherit the variable.
"""

from __future__ import annotations

import importlib.util
import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "system", "gpu")


def _import_triton_interpreted() -> None:
    if importlib.util.find_spec("triton") is None or "triton" in sys.modules:
        return
    import torch

    if torch.cuda.is_available():
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_triton_interpreted()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test file outside this directory (e.g. named on the command line)
            continue
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test module must live in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier's promise, kept by failing: a unit test that starts a process belongs in
    integration/."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: move it to tests/integration/")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
