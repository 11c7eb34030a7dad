"""The GPU suite (``make test-gpu``): runs where torch sees a CUDA device, skips loudly elsewhere.

Without CUDA every test here is skipped by one autouse fixture with one reason, and one line
says so at the end of the run ("tests/gpu: N GPU test(s) SKIPPED: no CUDA device (...)"; the
session header says it too, ``-ra`` lists the tests). Collection stays cheap: the test modules
import only torch and pytest at module level. CI (no GPU, ``make test``) shows them that way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def cuda_skip_reason() -> str | None:
    """Why this suite cannot run here, in one line; None where a CUDA device is visible."""
    if torch.cuda.is_available():
        return None
    build = f"torch {torch.__version__}, built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}"
    return f"no CUDA device ({build}, 0 GPUs visible): the GPU suite runs with `make test-gpu` on a machine with a CUDA torch"


REASON = cuda_skip_reason()


def pytest_report_header(config):
    if REASON is not None:
        return [f"tests/gpu: SKIPPED, {REASON}"]
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return [f"tests/gpu: {torch.cuda.device_count()} CUDA device(s): {names}"]


@pytest.fixture(autouse=True, scope="session")
def _needs_cuda():  # session scope: before any module fixture (test_train_cuda's GPU run)
    if REASON is not None:
        pytest.skip(REASON)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if REASON is None:
        return
    prefix = HERE.relative_to(config.rootpath).as_posix() + "/"
    n = sum(1 for r in terminalreporter.stats.get("skipped", []) if getattr(r, "nodeid", "").startswith(prefix))
    if n:
        terminalreporter.write_line(f"tests/gpu: {n} GPU test(s) SKIPPED: {REASON}", yellow=True, bold=True)
