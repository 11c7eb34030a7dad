"""Triton in interpreter mode for the CowClip kernel tests, and the fixture that skips a test the
Triton kernels cannot run for.

triton picks compiled or interpreted mode once, when it is first imported. Without a CUDA device
the Triton kernels run on CPU tensors only under its interpreter, so triton is imported here with
``TRITON_INTERPRET=1`` (before the test modules of this folder import anything that imports it),
then the environment is put back so nothing else in this process, nor its subprocesses, sees the
variable. With a CUDA device (``make test-gpu``) the same tests compile the kernels for real.

Without triton installed the kernel tests are SKIPPED with the reason "triton not installed"
(shown by ``-ra``); the tests that a CPU install without triton keeps working run everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAVE_TRITON = importlib.util.find_spec("triton") is not None

if HAVE_TRITON and DEV.type == "cpu" and "triton" not in sys.modules:
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if _old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _old


def _skip_reason() -> str | None:
    """Why the Triton kernels cannot run on ``DEV`` in this process; None when they can."""
    if not HAVE_TRITON:
        return "triton not installed"
    from recsys.optim.cowclip.kernels.triton_update import triton_available

    if not triton_available(DEV):
        return (
            "triton was imported without TRITON_INTERPRET=1 before this folder's conftest and there is no CUDA device: "
            "run with TRITON_INTERPRET=1"
        )
    return None


@pytest.fixture
def needs_triton() -> None:
    """Skips the test (with the reason) where the Triton kernels cannot run on ``DEV``."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
