"""The fixture that skips a CowClip kernel test the Triton kernels cannot run for.

Without a CUDA device the Triton kernels run on CPU tensors only under triton's interpreter, which
tests/conftest.py switches on by importing triton with ``TRITON_INTERPRET=1`` before any test
module imports it. With a CUDA device (``make test-gpu``) the same tests compile the kernels.

Without triton installed the kernel tests are SKIPPED with the reason "triton not installed"
(shown by ``-ra``); the tests that a CPU install without triton keeps working run everywhere.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _skip_reason() -> str | None:
    """Why the Triton kernels cannot run on ``DEV`` in this process; None when they can."""
    if not HAVE_TRITON:
        return "triton not installed"
    from recsys.optim.cowclip.kernels.triton_update import triton_available

    if not triton_available(DEV):
        return (
            "triton was imported without TRITON_INTERPRET=1 before tests/conftest.py and there is no CUDA device: "
            "run with TRITON_INTERPRET=1"
        )
    return None


@pytest.fixture
def needs_triton() -> None:
    """Skips the test (with the reason) where the Triton kernels cannot run on ``DEV``."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
