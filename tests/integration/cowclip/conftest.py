"""The fixture that loads the fused C++ CowClip op for the tests that call it.

If the extension cannot be built those tests FAIL (``load_extension(require=True)`` raises),
unless ``RECSYS_NO_CPP=1`` is set: then they are skipped with that reason (shown by ``-ra``).
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def ext():
    """The op ``torch.ops.recsys.cowclip_adam_step_``, built or loaded once per test module."""
    import recsys.optim.cowclip.kernels.cpp_op as ck

    if os.environ.get("RECSYS_NO_CPP", "") not in ("", "0"):
        pytest.skip("RECSYS_NO_CPP=1: C++ CowClip op not built")
    ck.load_extension(require=True)
    return torch.ops.recsys.cowclip_adam_step_
