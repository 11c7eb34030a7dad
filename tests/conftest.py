"""Session-wide test set-up.

triton chooses between compiled and interpreted mode once, when it is first imported, and
torchrec/fbgemm import it as a side effect wherever it is installed. On a machine without a CUDA
device the Triton CowClip kernel can only run under the interpreter (TRITON_INTERPRET=1), so
triton is imported here in interpreter mode before any test module imports torchrec; the
environment is put back so subprocesses (torchrun workers) do not inherit the variable.
"""

from __future__ import annotations

import importlib.util
import os
import sys


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
